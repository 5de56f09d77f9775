"""PallasTritonRaggedDot beyond the base suite (`test_ragged_dot_suite.py`): the three
variants at tiles with masked edges in interpret mode, configs, heuristics, cuda
lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import tokamax_pass
from conftest import H200, assert_close, random_normal, reference_precision
from tokamax_kernels.ragged_dot import api
from tokamax_kernels.ragged_dot.base import RaggedDot
from tokamax_kernels.ragged_dot.pallas_triton import Config, PallasTritonRaggedDot

M, K, N = 40, 48, 40
# Uneven, with an empty group, a group inside one tile, and rows past the sum (zeros).
SIZES = np.array([5, 0, 20, 3], np.int32)
# 16-row tiles: the 20-row group takes two; 16 does not divide K, N or M (masked edges).
TILES = Config(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)


def _operands(variant: str, dtype=jnp.float32):
    g = len(SIZES)
    shapes = {"forward": ((M, K), (g, K, N)), "dlhs": ((M, N), (g, K, N)),
              "drhs": ((M, K), (M, N))}[variant]
    return random_normal(0, shapes[0], dtype), random_normal(1, shapes[1], dtype)


def _h200():
    """An H200 to lower for. Auto axes: jax's ragged_dot_general (the family's reference,
    used for shapes) has no sharding rule under the default Explicit axes."""
    return jax.sharding.use_abstract_mesh(AbstractMesh(
        (1,), ("_target",), axis_types=(AxisType.Auto,),
        abstract_device=AbstractDevice(H200, None, "cuda")))


@pytest.mark.parametrize("variant", ["forward", "dlhs", "drhs"])
def test_variants_match_reference(variant):
    lhs, rhs = _operands(variant)
    op = PallasTritonRaggedDot(interpret=True, config=TILES)
    with reference_precision():
        expected = RaggedDot()(lhs, rhs, SIZES, variant=variant)
    got = op(lhs, rhs, SIZES, variant=variant)
    assert_close(got, expected)
    if variant == "drhs":
        np.testing.assert_array_equal(np.asarray(got[1]), 0.0)  # the empty group
    else:
        np.testing.assert_array_equal(np.asarray(got[SIZES.sum():]), 0.0)  # rows past the sum


def test_unsupported_inputs_and_bad_configs():
    op = PallasTritonRaggedDot(interpret=True)
    lhs, rhs = _operands("forward")
    with pytest.raises(NotImplementedError, match="one dtype"):
        op(lhs, rhs.astype(jnp.bfloat16), SIZES)
    ba = op.bind(jax.ShapeDtypeStruct((M, K), jnp.float64),
                 jax.ShapeDtypeStruct((4, K, N), jnp.float64), SIZES)
    with pytest.raises(NotImplementedError, match="float64"):
        op.check_supported(ba, None)
    with pytest.raises(ValueError, match="power of 2"):
        Config(block_m=48, block_n=16, block_k=16, num_warps=4, num_stages=2)


def test_heuristics_for_the_benchmark_shape():
    ba = PallasTritonRaggedDot().bind(jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16),
                                      jax.ShapeDtypeStruct((8, 4096, 4096), jnp.bfloat16),
                                      jax.ShapeDtypeStruct((8,), jnp.int32))
    config = ba.heuristics_config
    assert (config.block_m, config.block_n, config.num_stages) == (128, 256, 3)
    assert len(ba.autotuning_configs) > 10


def test_implementation_triton_on_cpu_raises():
    lhs, rhs = _operands("forward")
    with pytest.raises(NotImplementedError, match="cuda"):
        api.ragged_dot(lhs, rhs, SIZES, implementation="triton")


def test_lowers_for_cuda_forward_and_gradients():
    def f(lhs, rhs, sizes):
        def loss(lhs, rhs):
            out = api.ragged_dot(lhs, rhs, sizes, implementation="triton")
            return out.astype(jnp.float32).sum()
        return jax.value_and_grad(loss, argnums=(0, 1))(lhs, rhs)

    args = (jax.ShapeDtypeStruct((1000, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((8, 512, 384), jnp.bfloat16),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    with _h200():
        exported = jax.export.export(
            jax.jit(f), platforms=["cuda"],
            disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(*args)
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dlhs, drhs
    assert "tokamax_pass_spec" in text and "PallasTritonRaggedDot" in text
    for variant in ("forward", "dlhs", "drhs"):
        assert f"variant\\22:\\22{variant}" in text.replace(" ", "")


def test_few_rows_a_group_heuristics_and_numerics():
    """A decode-like call (6 rows a group) takes the few-rows tiles; they compute the
    forward and both gradients right (interpret mode, masked K and N edges)."""
    m, k, n, g = 48, 160, 96, 8
    sizes = jnp.asarray([9, 2, 0, 11, 6, 1, 7, 5], jnp.int32)  # 41 of 48 rows
    decode = PallasTritonRaggedDot().bind(
        jax.ShapeDtypeStruct((1536, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((64, 2048, 1408), jnp.bfloat16),
        jax.ShapeDtypeStruct((64,), jnp.int32))
    assert decode.heuristics_config == Config(block_m=64, block_n=128, block_k=128,
                                              num_warps=4, num_stages=4)
    lhs, rhs = random_normal(3, (m, k)), random_normal(4, (g, k, n))
    ct = random_normal(5, (m, n))
    op = PallasTritonRaggedDot(interpret=True)
    assert op.bind(lhs, rhs, sizes).heuristics_config.block_m == 64

    def run(impl):
        return jax.vjp(lambda a, b: impl(a, b, sizes), lhs, rhs)

    with reference_precision():
        want, want_vjp = run(RaggedDot())
        want_grads = want_vjp(ct)
    got, got_vjp = run(op)
    assert_close(got, want)
    for a, b in zip(got_vjp(ct), want_grads, strict=True):
        assert_close(a, b)
