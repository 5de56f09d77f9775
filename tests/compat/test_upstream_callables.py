"""Functions in `implementation=` (upstream Tokamax's dispatch) for layer_norm,
gated_linear_unit and linear_softmax_cross_entropy_loss: tried in order with names, each
given the call's arguments as written; forward and gradient against float32 HIGHEST."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal

HIGHEST = jax.lax.Precision.HIGHEST


def declining(record):
    def declines(*args, **keywords):
        record.append(keywords)
        raise NotImplementedError("declined")
    return declines


def check(f, ref, args, out_shape, seed=20):
    dout = random_normal(seed, out_shape)
    out, pullback = jax.vjp(f, *args)
    expected, ref_pullback = jax.vjp(ref, *args)
    assert_close(out, expected)
    for g, e in zip(pullback(dout), ref_pullback(dout), strict=True):
        assert_close(g, e)


def layer_norm_reference(x, scale, offset):
    centered = x - x.mean(-1, keepdims=True)
    y = centered * jax.lax.rsqrt(jnp.square(centered).mean(-1, keepdims=True) + 1e-5)
    return y * (scale + 1.0) + offset


def test_layer_norm():
    args = (random_normal(0, (2, 5, 16)), random_normal(1, (16,)), random_normal(2, (16,)))
    record = []
    check(lambda *a: tokamax.layer_norm(*a, epsilon=1e-5, scale_offset=1.0,
                                        implementation=[declining(record), "xla"]),
          layer_norm_reference, args, (2, 5, 16))
    assert record[0] == {"epsilon": 1e-5, "scale_offset": 1.0}


def test_gated_linear_unit():
    x, weights = random_normal(3, (2, 6, 16)), random_normal(4, (16, 2, 8))

    def reference(x, weights):
        gate = jnp.einsum("bmk,kn->bmn", x, weights[:, 0], precision=HIGHEST)
        up = jnp.einsum("bmk,kn->bmn", x, weights[:, 1], precision=HIGHEST)
        return jax.nn.swish(gate) * up

    record = []
    check(lambda x, w: tokamax.gated_linear_unit(
        x, w, activation=jax.nn.swish, precision=HIGHEST,
        implementation=(declining(record), "xla")), reference, (x, weights), (2, 6, 8))
    assert record[0] == {"activation": jax.nn.swish, "precision": HIGHEST}


def test_linear_softmax_cross_entropy_loss():
    x, weights = random_normal(5, (2, 7, 16)), random_normal(6, (16, 24))
    labels = jax.random.randint(jax.random.key(7), (2, 7), 0, 24)

    def reference(x, weights):
        logits = jnp.einsum("bth,hv->btv", x, weights, precision=HIGHEST)
        picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked

    record = []
    check(lambda x, w: tokamax.linear_softmax_cross_entropy_loss(
        x, labels, w, reduction="none", precision=HIGHEST,
        implementation=[declining(record), "chunked_xla"]), reference, (x, weights), (2, 7))
    assert record[0] == {"reduction": "none", "precision": HIGHEST}


def test_a_lone_function_raises_its_own_error():
    x = random_normal(8, (2, 4, 8))
    with pytest.raises(NotImplementedError, match="^declined$"):
        tokamax.layer_norm(x, None, None, implementation=declining([]))
    with pytest.raises(NotImplementedError, match="declines: declined"):
        tokamax.layer_norm(x, None, None, implementation=[declining([]), "triton"])
