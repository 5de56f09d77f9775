"""Attention as upstream Tokamax calls it: `q`/`k`/`v` keywords on the op's `bind`, and
functions mixed with names in `implementation`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from tokamax_kernels.attention import DotProductAttention

B, T, N, H = 2, 8, 2, 16


def reference(query, key, value, is_causal=False):
    logits = jnp.einsum("btnh,bsnh->bnts", query, key,
                        precision=jax.lax.Precision.HIGHEST) / jnp.sqrt(H)
    if is_causal:
        logits = jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), value,
                      precision=jax.lax.Precision.HIGHEST)


def inputs(seed):
    return tuple(random_normal(seed + i, (B, T, N, H)) for i in range(3))


def check_forward_and_gradient(f, is_causal=False, seed=0):
    qkv = inputs(seed)
    dout = random_normal(seed + 9, (B, T, N, H))
    out, pullback = jax.vjp(f, *qkv)
    expected, ref_pullback = jax.vjp(lambda *a: reference(*a, is_causal=is_causal), *qkv)
    assert_close(out, expected)
    for g, e in zip(pullback(dout), ref_pullback(dout), strict=True):
        assert_close(g, e)


def test_bind_takes_q_k_v_keywords():
    q, k, v = inputs(0)
    by_name = DotProductAttention().bind(q=q, k=k, v=v, is_causal=True)
    positional = DotProductAttention().bind(q, k, v, is_causal=True)
    assert by_name.arguments.keys() == positional.arguments.keys()
    assert by_name.arguments["value"] is v and by_name.arguments["query"] is q
    with pytest.raises(TypeError, match="alias 'q'"):
        DotProductAttention().bind(q=q, query=q, k=k, v=v)
    check_forward_and_gradient(
        lambda q, k, v: DotProductAttention()(q=q, k=k, v=v, is_causal=True,
                                              precision="highest"),
        is_causal=True)


def test_a_function_that_declines_moves_on_to_the_next():
    calls = []

    def declines(query, key, value, bias, mask, **keywords):
        calls.append((bias, mask, keywords))
        raise NotImplementedError("not this shape")

    check_forward_and_gradient(lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=True, precision="highest", implementation=[declines, "xla"]),
        is_causal=True)
    assert calls and calls[0] == (None, None, {"is_causal": True, "precision": "highest"})


def test_a_function_runs_when_it_is_first():
    check_forward_and_gradient(lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=True, implementation=[jax.nn.dot_product_attention, "xla"]),
        is_causal=True, seed=3)
    # jax.nn rejects `precision`, and its TypeError is not a reason to move on.
    with pytest.raises(TypeError):
        tokamax.dot_product_attention(*inputs(3), precision="highest",
                                      implementation=[jax.nn.dot_product_attention, "xla"])


def test_every_candidate_declining_raises_not_implemented():
    def declines(*args, **kwargs):
        raise NotImplementedError("never")

    with pytest.raises(NotImplementedError, match="never") as info:
        tokamax.dot_product_attention(*inputs(5), implementation=[declines, "cudnn"])
    assert "declines" in str(info.value)
    with pytest.raises(NotImplementedError, match="^never$"):
        tokamax.dot_product_attention(*inputs(5), implementation=declines)
