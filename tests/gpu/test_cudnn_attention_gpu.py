"""CudnnDotProductAttention on the GPU: forward and gradients against a float32 HIGHEST
reference for every option cuDNN takes, its softmax statistics against the family's
lse contract, and its residuals exchanged with the Triton kernels in both directions."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import per_batch_element, reference_precision
from tokamax_kernels.attention.api import dot_product_attention
from tokamax_kernels.attention.base import DotProductAttention
from tokamax_kernels.attention.cudnn import CudnnDotProductAttention, CudnnDotProductAttentionVjp
from tokamax_kernels.attention.pallas_triton import PallasTritonFlashAttention
from tokamax_kernels.attention.pallas_triton_vjp import PallasTritonFlashAttentionVjp
from tokamax_pass.core import NullConfig

pytestmark = pytest.mark.gpu

B, S, H, D = 2, 256, 4, 64


def _rel_err(x: jax.Array, ref: jax.Array) -> float:
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _inputs(shape: tuple[int, ...], seed: int = 0) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(k, shape, jnp.bfloat16) for k in keys]


def _fwd_bwd(impl: Any, q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array,
             bias: jax.Array | None = None, **options: Any) -> tuple[jax.Array, ...]:
    def f(q, k, v, bias):
        return dot_product_attention(q, k, v, bias, implementation=impl, **options)

    out, pull = jax.vjp(f, q, k, v, bias)
    return (out, *(g for g in pull(do) if g is not None))


def _check_against_reference(impl: Any, q, k, v, do, bias=None, **options) -> None:
    got = jax.jit(lambda *a: _fwd_bwd(impl, *a, **options))(q, k, v, do, bias)
    f32 = [None if x is None else x.astype(jnp.float32) for x in (q, k, v, do, bias)]
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda *a: _fwd_bwd("xla", *a, **options))(*f32)
    names = ("out", "dq", "dk", "dv", "dbias")
    for name, x, r in zip(names, got, ref, strict=False):
        assert np.all(np.isfinite(np.asarray(x, np.float32))), f"{name}: not finite"
        err = _rel_err(x, r)
        assert err < 1.5e-2, f"{name}: relative error {err:.3g} ({options})"


def _mask() -> jax.Array:
    mask = jax.random.bernoulli(jax.random.key(7), 0.7, (B, 1, S, S))
    return mask.at[:, :, 5].set(False)  # one fully masked query row


OPTIONS = {
    "plain": {},
    "causal": {"is_causal": True},
    "mask_with_an_empty_row": {"mask": _mask},
    "seq_lengths": {"query_seq_lengths": lambda: jnp.array([S, 100], jnp.int32),
                    "key_value_seq_lengths": lambda: jnp.array([200, S], jnp.int32)},
    "causal_window": {"is_causal": True, "local_window_size": (32, 0)},
    "scale": {"scale": 0.3},
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_options_match_reference(name):
    options = {k: v() if callable(v) else v for k, v in OPTIONS[name].items()}
    _check_against_reference("cudnn", *_inputs((B, S, H, D)), **options)


def test_bias_gradient_matches_reference():
    q, k, v, do = _inputs((B, S, H, D))
    bias = jax.random.normal(jax.random.key(3), (1, H, S, S), jnp.bfloat16)
    _check_against_reference("cudnn", q, k, v, do, bias)


def test_gqa_matches_reference():
    q, _, _, do = _inputs((B, S, H, D))
    _, k, v, _ = _inputs((B, S, 1, D), seed=1)
    _check_against_reference("cudnn", q, k, v, do, is_causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_statistics_are_the_family_lse(causal):
    q, k, v, _ = _inputs((B, S, H, D))
    statics = dict(scale=D ** -0.5, is_causal=causal, query_seq_lengths=None,
                   key_value_seq_lengths=None, local_window_size=None,
                   logits_soft_cap=None, precision=None)

    def lse(op):
        return op._fwd(q, k, v, None, None, **statics, config=NullConfig(),
                       return_residuals=True)[1][0]

    got = jax.jit(lambda: lse(CudnnDotProductAttention()))()
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda: lse(DotProductAttention()))()
    assert got.dtype == jnp.float32 and got.shape == (B, H, S)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-2, rtol=0)


@pytest.mark.parametrize("forward, backward", [
    (CudnnDotProductAttention(vjp=PallasTritonFlashAttentionVjp()), "cudnn -> triton"),
    (PallasTritonFlashAttention(vjp=CudnnDotProductAttentionVjp()), "triton -> cudnn"),
])
def test_residuals_cross_between_implementations(forward, backward):
    del backward  # the test id
    _check_against_reference(forward, *_inputs((B, S, H, D)), is_causal=True)


@pytest.mark.parametrize(("b", "s", "h", "d", "causal"), [
    (32, 2048, 16, 64, False), (4, 8192, 16, 128, True)])
def test_benchmark_shapes_match_reference_and_rerun(b, s, h, d, causal):
    q, k, v, do = _inputs((b, s, h, d))
    run = jax.jit(lambda *a: _fwd_bwd("cudnn", *a, is_causal=causal))
    results, again = run(q, k, v, do), run(q, k, v, do)
    # cuDNN's backward accumulates in a nondeterministic order (XLA's
    # --xla_gpu_deterministic_ops picks its deterministic kernels); its forward does not.
    assert np.array_equal(np.asarray(results[0]), np.asarray(again[0])), "forward rerun differs"
    for x, y in zip(results[1:], again[1:], strict=True):
        assert _rel_err(x, y) < 1e-3, "backward rerun differs beyond accumulation order"
    with reference_precision():
        ref = per_batch_element(lambda *a: _fwd_bwd("xla", *a, is_causal=causal),
                                *(x.astype(jnp.float32) for x in (q, k, v, do)))
    for name, x, r in zip(("out", "dq", "dk", "dv"), results, ref, strict=True):
        for i in range(b):  # every batch element on its own: none may hide behind the others
            err = _rel_err(x[i], r[i])
            assert err < 1e-2, f"{name}[{i}]: relative error {err:.3g}"
