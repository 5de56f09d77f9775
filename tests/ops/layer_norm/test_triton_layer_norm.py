"""PallasTritonLayerNorm (+ VJP) beyond the base suite (`test_layer_norm_suite.py`): exact
tiling, the residual contract, configs and heuristics, cuda lowering, fallback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass
from conftest import H200, assert_close, random_normal, reference_precision
from tokamax_kernels.layer_norm import api
from tokamax_kernels.layer_norm import pallas_triton as ln_triton
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_triton import Config, PallasTritonLayerNorm
from tokamax_kernels.layer_norm.pallas_triton_vjp import Config as VjpConfig
from tokamax_kernels.layer_norm.pallas_triton_vjp import PallasTritonLayerNormVjp
from tokamax_pass import core

# (forward config, backward config): the row in one block; rows looped in chunks that
# do not divide n; row blocks that do not divide the row count.
CONFIGS = {
    "one_block": (Config(block_rows=4, block_n=64, rows_per_program=4, num_warps=4, num_stages=1),
                  VjpConfig(block_rows=2, block_n=64, rows_per_program=8, num_warps=4,
                            num_stages=2)),
    "chunked": (Config(block_rows=2, block_n=16, rows_per_program=4, num_warps=4, num_stages=2),
                VjpConfig(block_rows=4, block_n=16, rows_per_program=8, num_warps=4,
                          num_stages=2)),
}


def _op(name: str) -> PallasTritonLayerNorm:
    fwd, bwd = CONFIGS[name]
    return PallasTritonLayerNorm(
        interpret=True, config=fwd, vjp=PallasTritonLayerNormVjp(interpret=True, config=bwd))


def _inputs(dtype=jnp.float32, shape=(3, 5, 40)):
    n = shape[-1]
    return (random_normal(0, shape, dtype) * 2 + 0.5, random_normal(1, (n,), dtype),
            random_normal(2, (n,), dtype), random_normal(3, shape, jnp.float32))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_exact_tiling_without_masks_matches_reference(name):
    """16 rows of 64: every config's blocks tile the array, so the kernels drop masks."""
    x, scale, offset, ct = _inputs(shape=(2, 8, 64))
    op = _op(name)
    fwd, bwd = CONFIGS[name]
    assert all(ln_triton.is_exact(16, 64, c.rows_per_program, c.block_n) for c in (fwd, bwd))
    with reference_precision():
        expected = LayerNorm()(x, scale, offset)
        expected_grads = jax.grad(lambda *a: (LayerNorm()(*a) * ct).sum(), argnums=(0, 1, 2))(
            x, scale, offset)
    assert_close(op(x, scale, offset), expected)
    grads = jax.grad(lambda *a: (op(*a) * ct).sum(), argnums=(0, 1, 2))(x, scale, offset)
    for got, want in zip(grads, expected_grads, strict=True):
        assert_close(got, want)


def test_residuals_match_family_contract():
    x, scale, offset, _ = _inputs()
    op = _op("chunked")
    _, (mean, rstd) = op._fwd(x, scale, offset, axis=2, epsilon=1e-6, subtract_mean=True,
                              config=op.config, return_residuals=True)
    _, (ref_mean, ref_rstd) = LayerNorm()._fwd(x, scale, offset, axis=2, epsilon=1e-6,
                                               subtract_mean=True, config=None,
                                               return_residuals=True)
    assert mean.shape == (3, 5) and mean.dtype == jnp.float32
    assert_close(mean, ref_mean)
    assert_close(rstd, ref_rstd)


def test_xla_forward_residuals_feed_triton_backward():
    x, scale, offset, ct = _inputs()
    op = LayerNorm(vjp=PallasTritonLayerNormVjp(interpret=True, config=CONFIGS["chunked"][1]))
    with reference_precision():
        want = jax.grad(lambda x: (LayerNorm()(x, scale, offset) * ct).sum())(x)
    assert_close(jax.grad(lambda x: (op(x, scale, offset) * ct).sum())(x), want)


def test_unsupported_inputs_raise_not_implemented():
    x, _, _, _ = _inputs()
    op = PallasTritonLayerNorm(interpret=True)
    with pytest.raises(NotImplementedError, match="last axis"):
        op(x, None, None, axis=1)
    ba = op.bind(jax.ShapeDtypeStruct((4, 64), jnp.float64))
    with pytest.raises(NotImplementedError, match="float64"):
        op.check_supported(ba, None)


def test_configs_must_be_powers_of_two():
    with pytest.raises(ValueError, match="power of 2"):
        Config(block_rows=3, block_n=64, rows_per_program=3, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="multiple of"):
        VjpConfig(block_rows=4, block_n=64, rows_per_program=6, num_warps=4, num_stages=1)


def test_heuristics_and_search_space():
    x = jax.ShapeDtypeStruct((65536, 4096), jnp.bfloat16)
    ba = PallasTritonLayerNorm().bind(x, None, None)
    with core.targeting(H200):
        config = ba.heuristics_config
        assert config.block_n == 4096
        assert len(ba.autotuning_configs) > 10
        long_row = PallasTritonLayerNorm().bind(jax.ShapeDtypeStruct((4, 100_000), jnp.bfloat16))
        assert long_row.heuristics_config.block_n < 100_000
        # Fitted to the width sweep (layer_norm_configs.jsonl): ~4 KiB blocks (up to 16
        # rows), one warp per 16 KiB of block.
        for width, dtype, rows, warps in ((256, jnp.float32, 4, 1), (768, jnp.float32, 1, 1),
                                          (1024, jnp.bfloat16, 2, 1), (64, jnp.bfloat16, 16, 1),
                                          (2688, jnp.bfloat16, 1, 1),
                                          (6400, jnp.float32, 1, 2),
                                          (5120, jnp.bfloat16, 1, 1)):
            call = PallasTritonLayerNorm().bind(jax.ShapeDtypeStruct((8192, width), dtype))
            forward = call.heuristics_config
            assert (forward.block_rows, forward.num_warps) == (rows, warps), width
            assert forward.block_n >= width and forward.rows_per_program == forward.block_rows


def test_implementation_triton_on_cpu_raises_and_none_falls_back():
    x, scale, offset, _ = _inputs()
    with pytest.raises(NotImplementedError, match="cuda"):
        api.layer_norm(x, scale, offset, implementation="triton")
    text = jax.jit(lambda x: api.layer_norm(x, scale, offset)).lower(x).as_text()
    assert "PallasTritonLayerNorm" not in text and "LayerNorm" in text


@pytest.mark.parametrize("subtract_mean", [True, False])
def test_lowers_for_cuda_with_grad(subtract_mean):
    def f(x, scale, offset):
        def loss(x, scale, offset):
            y = api.layer_norm(x, scale, offset, subtract_mean=subtract_mean,
                               implementation="triton")
            return y.astype(jnp.float32).sum()
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, scale, offset)

    args = (jax.ShapeDtypeStruct((64, 50_000), jnp.bfloat16),
            jax.ShapeDtypeStruct((50_000,), jnp.bfloat16),
            jax.ShapeDtypeStruct((50_000,), jnp.bfloat16))
    with core.targeting(H200):
        exported = jax.export.export(
            jax.jit(f), platforms=["cuda"],
            disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(*args)
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 2  # forward + backward kernels
    assert "tokamax_pass_spec" in text and "PallasTritonLayerNormVjp" in text
