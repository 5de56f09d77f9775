"""PallasTritonGatedLinearUnit (+ VJP) beyond the base suite
(`test_gated_linear_unit_suite.py`): interpret-mode numerics at tiles that mask every edge,
configs, cuda lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass
from conftest import H200, assert_close, random_normal, reference_precision
from tokamax_kernels.gated_linear_unit import api
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_triton import Config, PallasTritonGatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_triton_vjp import PallasTritonGatedLinearUnitVjp
from tokamax_pass import core

# 16-wide tiles do not divide M = 2 * 17, K = 40 or N = 24: every edge is masked.
TILES = Config(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
K, N = 40, 24


def _op() -> PallasTritonGatedLinearUnit:
    return PallasTritonGatedLinearUnit(
        interpret=True, config=TILES,
        vjp=PallasTritonGatedLinearUnitVjp(interpret=True, config=TILES))


def _weights(fused: bool, dtype=jnp.float32):
    w = random_normal(1, (K, 2, N), dtype) / 4
    return w if fused else (w[:, 0], w[:, 1])


@pytest.mark.exhaustive
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("activation", [jax.nn.swish, jax.nn.gelu, jax.nn.relu])
def test_forward_and_gradient_match_reference(fused, activation):
    x = random_normal(0, (2, 17, K))
    weights = _weights(fused)
    ct = random_normal(2, (2, 17, N))
    op = _op()

    def loss(impl, x, weights):
        return (impl(x, weights, activation=activation) * ct).sum()

    with reference_precision():
        expected = GatedLinearUnit()(x, weights, activation=activation)
        want = jax.grad(lambda *a: loss(GatedLinearUnit(), *a), argnums=(0, 1))(x, weights)
    assert_close(op(x, weights, activation=activation), expected)
    got = jax.grad(lambda *a: loss(op, *a), argnums=(0, 1))(x, weights)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w)


def test_unsupported_inputs_and_configs():
    op = PallasTritonGatedLinearUnit(interpret=True)
    x = random_normal(0, (4, K))
    with pytest.raises(NotImplementedError, match="dtype"):
        op(x, _weights(True, jnp.bfloat16))
    ba = op.bind(jax.ShapeDtypeStruct((4, K), jnp.float64),
                 jax.ShapeDtypeStruct((K, 2, N), jnp.float64))
    with pytest.raises(NotImplementedError, match="float64"):
        op.check_supported(ba, None)
    with pytest.raises(ValueError, match="power of 2"):
        Config(block_m=24, block_n=16, block_k=16, num_warps=4, num_stages=2)


def test_heuristics_and_search_space():
    ba = PallasTritonGatedLinearUnit().bind(jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16),
                                            jax.ShapeDtypeStruct((4096, 2, 8192), jnp.bfloat16))
    assert ba.heuristics_config.block_m == 128
    assert len(ba.autotuning_configs) > 10


def test_implementation_triton_on_cpu_raises_and_none_falls_back():
    x = random_normal(0, (4, K))
    with pytest.raises(NotImplementedError, match="cuda"):
        api.gated_linear_unit(x, _weights(True), implementation="triton")
    text = jax.jit(lambda x: api.gated_linear_unit(x, _weights(True))).lower(x).as_text()
    assert "PallasTritonGatedLinearUnit" not in text and "GatedLinearUnit" in text


@pytest.mark.parametrize("fused", [True, False])
def test_lowers_for_cuda_with_grad(fused):
    def f(x, weights):
        def loss(x, weights):
            out = api.gated_linear_unit(x, weights, implementation="triton")
            return out.astype(jnp.float32).sum()
        return jax.value_and_grad(loss, argnums=(0, 1))(x, weights)

    w = jax.ShapeDtypeStruct((512, 2, 384), jnp.bfloat16)
    w_pair = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((4, 250, 512), jnp.bfloat16), w if fused else (w_pair, w_pair))
    with core.targeting(H200):
        exported = jax.export.export(
            jax.jit(f), platforms=["cuda"],
            disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(*args)
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 2  # forward + backward gates kernels
    assert "tokamax_pass_spec" in text and "PallasTritonGatedLinearUnitVjp" in text


def test_a_dense_kernel_forward_must_beat_xla_by_half():
    """XLA's GLU gradient reruns the products, which XLA merges with its forward's inside
    a program: a kernel forward puts those GEMMs back, so `None` wants it twice as fast.
    A grouped call's gradient reads the residuals instead: the default margin."""
    from tokamax_pass.core import selection

    x = jax.ShapeDtypeStruct((16384, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2048, 2, 5632), jnp.bfloat16)
    candidates = [op.bind(x, w) for op in (PallasTritonGatedLinearUnit(), GatedLinearUnit())]
    assert selection.rank_with_evidence(candidates, [0.8, 1.05]) == [1]
    assert selection.rank_with_evidence(candidates, [0.5, 1.05]) == [0, 1]
    grouped = GatedLinearUnit().bind(
        x, jax.ShapeDtypeStruct((4, 2048, 2, 5632), jnp.bfloat16),
        group_sizes=jax.ShapeDtypeStruct((4,), jnp.int32))
    assert GatedLinearUnit().kernel_margin_for(grouped) == core.Op.kernel_margin
    assert PallasTritonGatedLinearUnit().kernel_margin_for(candidates[0]) == 0.5
