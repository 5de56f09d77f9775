"""layer_norm(scale_offset=...): the scale applied is `scale + scale_offset` (upstream
Tokamax's semantics), in the XLA reference, the Triton kernels (interpret mode) and the
Mosaic TPU kernels (interpret mode), forward and gradient, against float32 HIGHEST."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from tokamax_kernels.layer_norm._mosaic_tpu_common import Config as MosaicConfig
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_mosaic_tpu import PallasMosaicTpuLayerNorm
from tokamax_kernels.layer_norm.pallas_mosaic_tpu_vjp import PallasMosaicTpuLayerNormVjp
from tokamax_kernels.layer_norm.pallas_triton import Config, PallasTritonLayerNorm
from tokamax_kernels.layer_norm.pallas_triton_vjp import Config as VjpConfig
from tokamax_kernels.layer_norm.pallas_triton_vjp import PallasTritonLayerNormVjp

EPS = 1e-6
SCALE_OFFSET = 1.0  # Gemma's `(1 + scale)`


def reference(x, scale, offset, scale_offset, subtract_mean):
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True) if subtract_mean else 0.0
    centered = x - mean
    y = centered * jax.lax.rsqrt(jnp.square(centered).mean(-1, keepdims=True) + EPS)
    return y * (scale + scale_offset) + offset


def triton():
    return PallasTritonLayerNorm(
        interpret=True,
        config=Config(block_rows=2, block_n=16, rows_per_program=4, num_warps=4, num_stages=2),
        vjp=PallasTritonLayerNormVjp(interpret=True, config=VjpConfig(
            block_rows=4, block_n=16, rows_per_program=8, num_warps=4, num_stages=2)))


def mosaic_tpu():
    config = MosaicConfig(block_rows=16)
    return PallasMosaicTpuLayerNorm(
        interpret=True, config=config,
        vjp=PallasMosaicTpuLayerNormVjp(interpret=True, config=config))


CASES = {"xla": (LayerNorm, (2, 5, 40)), "triton": (triton, (3, 5, 40)),
         "mosaic_tpu": (mosaic_tpu, (2, 19, 200))}


@pytest.mark.exhaustive
@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_gradient_match_reference(name, subtract_mean):
    make_op, shape = CASES[name]
    n = shape[-1]
    x = random_normal(0, shape) * 2 + 0.5
    scale, offset = 0.5 * random_normal(1, (n,)), random_normal(2, (n,))
    dout = random_normal(3, shape)

    def norm(x, scale, offset):
        return tokamax.layer_norm(x, scale, offset, epsilon=EPS, scale_offset=SCALE_OFFSET,
                                  subtract_mean=subtract_mean, implementation=make_op())

    out, pullback = jax.vjp(norm, x, scale, offset)
    with jax.default_matmul_precision("highest"):
        expected, ref_pullback = jax.vjp(
            lambda *a: reference(*a, SCALE_OFFSET, subtract_mean), x, scale, offset)
    assert_close(out, expected)
    for g, e in zip(pullback(dout), ref_pullback(dout), strict=True):
        assert_close(g, e)


def test_no_scale_ignores_scale_offset():
    x = random_normal(4, (2, 3, 8))
    assert_close(tokamax.layer_norm(x, None, None, scale_offset=3.0, implementation="xla"),
                 reference(x, 1.0, 0.0, 0.0, True))


def test_scale_offset_keeps_the_scale_dtype_of_its_gradient():
    x = random_normal(5, (2, 4, 8), jnp.bfloat16)
    scale = random_normal(6, (8,), jnp.bfloat16)
    out = tokamax.layer_norm(x, scale, None, scale_offset=1.0)
    assert out.dtype == jnp.bfloat16
    assert_close(out, reference(x, scale.astype(jnp.float32), 0.0, 1.0, True), jnp.bfloat16)
    dscale = jax.grad(lambda s: tokamax.layer_norm(x, s, None, scale_offset=1.0).astype(
        jnp.float32).sum())(scale)
    assert dscale.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="scale_offset"):
        tokamax.layer_norm(x, scale, None, scale_offset=float("nan"))
