"""The grouped GLU's Mosaic GPU kernel (`implementation="mosaic_gpu"`).

On CPU: the forward kernel runs in Pallas's GPU interpret mode
(`_mosaic_gpu_interpret.interpret_mode`) for the output and the residuals against the
float32 HIGHEST reference, and the gradient from those residuals (through the Mosaic
ragged dots, also interpreted, or the XLA ones) against the reference's; the forward and
gradient lower for an H200 through `jax.export` (`mosaic_gpu_v2` custom calls with their
JSON specs); unsupported inputs and devices raise `NotImplementedError`; configs and
heuristics.
On the GPU: `python -m pytest -m gpu tests/ops/gated_linear_unit/test_mosaic_gpu_glu.py`.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import tokamax_pass as tokamax
from _mosaic_gpu_interpret import interpret_mode
from conftest import H200, assert_close, random_normal
from test_grouped_glu import check_against_reference, inputs, reference
from tokamax_kernels.gated_linear_unit import (
    GatedLinearUnitVjp,
    PallasMosaicGpuGatedLinearUnit,
    PallasMosaicGpuGatedLinearUnitVjp,
)
from tokamax_kernels.gated_linear_unit import api as glu_api
from tokamax_kernels.gated_linear_unit import pallas_mosaic_gpu as mosaic
from tokamax_kernels.gated_linear_unit._grouped import grouped_backward
from tokamax_kernels.ragged_dot import PallasMosaicGpuRaggedDot
from tokamax_kernels.ragged_dot.pallas_mosaic_gpu import Config

glu = tokamax.gated_linear_unit
Op, Vjp = PallasMosaicGpuGatedLinearUnit, PallasMosaicGpuGatedLinearUnitVjp
# 200 rows (a multiple of 8, not of 64): uneven groups, an empty one, 24 tail rows.
SIZES = (70, 0, 51, 55)
M, K, N, G = 200, 128, 128, len(SIZES)
SMALL = Config(tile_m=64, tile_n=64, tile_k=64, num_stages=2, epi_n=64, grid_tile_width=1)
BENCH = (32768, 2048, 5632, 8)  # Mixtral-style experts: M, K, N, G


def _target(kind: str = H200):
    return jax.sharding.use_abstract_mesh(AbstractMesh(
        (1,), ("_target",), axis_types=(AxisType.Auto,),
        abstract_device=AbstractDevice(kind, None, "cuda")))


def _shapes(m=M, k=K, n=N, g=G, fused=True, dtype=jnp.bfloat16):
    x = jax.ShapeDtypeStruct((m, k), dtype)
    w = (jax.ShapeDtypeStruct((g, k, 2, n), dtype) if fused
         else (jax.ShapeDtypeStruct((g, k, n), dtype),) * 2)
    return x, w, jax.ShapeDtypeStruct((g,), jnp.int32)


def _export_text(fn, *args) -> str:
    with _target():
        exported = jax.export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(*args)
    return exported.mlir_module()


def _kernel_specs(text: str) -> list[str]:
    """The op names in the JSON specs stamped on the Mosaic GPU custom calls."""
    calls = [line for line in text.splitlines()
             if "mosaic_gpu_v2" in line and "custom_call" in line]
    return [re.search(r"tokamax_kernels\.[\w.]+\.(\w+)\\22", c).group(1) for c in calls]


# --- lowering for the H200 --------------------------------------------------------------

@pytest.mark.variants
@pytest.mark.parametrize("fused, activation", [(True, jax.nn.swish), (False, jax.nn.gelu)])
@pytest.mark.parametrize("shape", ["small", "bench"])
def test_forward_lowers_to_one_kernel(fused, activation, shape):
    m, k, n, g = BENCH if shape == "bench" else (M, K, N, G)
    text = _export_text(
        lambda x, w, s: glu(x, w, group_sizes=s, activation=activation, implementation="mosaic"),
        *_shapes(m, k, n, g, fused))
    assert _kernel_specs(text) == ["PallasMosaicGpuGatedLinearUnit"]


@pytest.mark.parametrize("fused", [True, False])
def test_gradient_lowers_forward_kernel_and_mosaic_ragged_dots(fused):
    """The forward kernel (with residuals), then dx and dW as Mosaic ragged dots: one dlhs
    and one drhs for fused weights, two of each for a pair. No GEMM is recomputed."""
    def loss(x, w, s):
        return jnp.sum(glu(x, w, group_sizes=s, implementation="mosaic_gpu").astype(jnp.float32))

    text = _export_text(jax.grad(loss, argnums=(0, 1)), *_shapes(*BENCH, fused=fused))
    specs = _kernel_specs(text)
    assert specs[0] == "PallasMosaicGpuGatedLinearUnit"
    assert specs[1:] == ["PallasMosaicGpuRaggedDot"] * (2 if fused else 4)
    assert "chlo.ragged_dot" not in text


def test_none_lowers_xla_where_nothing_is_measured(monkeypatch, tmp_path):
    from tokamax_pass.autotuning import cache

    def none_text():
        cache.library_result.cache_clear()
        cache._USER.invalidate()
        return _export_text(lambda x, w, s: glu(x, w, group_sizes=s, activation=jax.nn.swish),
                            *_shapes(*BENCH))

    # The shipped H200 cache measured the kernel at the Mixtral shape: None runs it.
    monkeypatch.setenv("TOKAMAX_PASS_CACHE_DIR", str(tmp_path / "user"))
    assert "mosaic_gpu_v2" in none_text()
    # With nothing measured, the XLA GLU: at this shape its ragged dots run the tiled form
    # (`ragged_dot.xla_tiled`: a loop over row tiles), not `jax.lax.ragged_dot`.
    monkeypatch.setattr(cache, "library_cache_dir", lambda kind: tmp_path / "none")
    try:
        text = none_text()
    finally:
        monkeypatch.undo()
        cache.library_result.cache_clear()
        cache._USER.invalidate()
    assert "mosaic_gpu_v2" not in text and "xla.gpu.triton" not in text
    assert "stablehlo.while" in text and "chlo.ragged_dot" not in text


# --- what the kernel does not run ------------------------------------------------------

@pytest.mark.parametrize("shapes, kwargs, why", [
    (_shapes(dtype=jnp.float32), {}, "bf16 or f16"),
    (_shapes(n=96), {}, "N \\(96\\) a multiple of 128"),
    (_shapes(k=100), {}, "K \\(100\\) a multiple of 64"),
    (_shapes(m=60), {}, "M \\(rows of x, 60\\)"),
    (_shapes(m=204), {}, "M \\(rows of x, 204\\)"),
    (_shapes(), dict(activation=functools.partial(jax.nn.gelu, approximate=False)), "erf"),
    (_shapes(), dict(activation=jax.nn.relu), "custom_jvp_call"),
    (_shapes(), dict(activation=lambda v: v.astype(jnp.bfloat16)), "elementwise"),
])
def test_unsupported_inputs_raise_not_implemented(shapes, kwargs, why):
    # "mosaic_gpu", not "mosaic": traced for an H200 that is not here, "mosaic" also keeps
    # the TPU kernel (for a TPU lowering), which runs grouped calls these shapes fit.
    with _target(), pytest.raises(NotImplementedError, match=why):
        jax.eval_shape(lambda x, w, s: glu(x, w, group_sizes=s, implementation="mosaic_gpu",
                                           **kwargs), *shapes)


def test_dense_calls_old_gpus_and_cpu_raise_and_none_falls_back():
    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
    # "mosaic" names the GPU and TPU kernels: on an H200 neither runs a dense call.
    with tokamax.core.targeting(H200), pytest.raises(
            NotImplementedError, match="(?s)runs on \\['tpu'\\].*grouped calls"):
        tokamax.optimize(lambda x, w: glu(x, w, implementation="mosaic")).plan(
            x, jax.ShapeDtypeStruct((K, 2, N), jnp.bfloat16))
    with tokamax.core.targeting("NVIDIA A100-SXM4-40GB"), pytest.raises(
            NotImplementedError, match="Hopper"):
        tokamax.optimize(lambda x, w, s: glu(x, w, group_sizes=s, implementation="mosaic")
                         ).plan(*_shapes())
    xs, weights = inputs(True, jnp.bfloat16, m=M, k=K, n=N)
    sizes = jnp.array(SIZES, jnp.int32)
    with pytest.raises(NotImplementedError, match="cuda"):
        glu(xs, weights, group_sizes=sizes, implementation="mosaic")
    assert_close(glu(xs, weights, group_sizes=sizes, activation=jax.nn.swish),
                 reference(xs, weights, SIZES, jax.nn.swish), jnp.bfloat16)


def test_pinned_config_that_does_not_fit_raises():
    too_many_registers = Config(tile_m=128, tile_n=128, tile_k=64, num_stages=2)
    with _target(), pytest.raises(NotImplementedError, match="does not fit"):
        jax.eval_shape(lambda x, w, s: glu(x, w, group_sizes=s,
                                           implementation=Op(config=too_many_registers)),
                       *_shapes(m=256, n=256))


def test_registration_and_vjp():
    assert glu_api.FAMILY.implementations["mosaic_gpu"] is Op
    assert glu_api.FAMILY.aliases["mosaic"] == ("mosaic_gpu", "mosaic_tpu")
    assert glu_api.FAMILY.automatic[-1] == "xla"
    assert isinstance(Op().vjp_op(), Vjp)
    assert Vjp().reference_op() == GatedLinearUnitVjp()
    assert not Op().runs_without_evidence and not Vjp().runs_without_evidence


@pytest.mark.parametrize("m, k, n", [(M, K, N), BENCH[:3], (64, 64, 128), (4096, 4096, 14336)])
def test_heuristics_and_search_space_fit(m, k, n):
    x, w, sizes = _shapes(m, k, n)
    ba = Op().bind(x, w, group_sizes=sizes)
    config = Op()._get_heuristics_config(ba)
    assert mosaic._fits(config, m, k, n, 2)
    if m >= 128:
        assert (config.tile_m, config.tile_n, config.tile_k, config.num_stages) == (128, 64, 64, 4)
    space = Op()._get_autotuning_configs(ba)
    assert space and all(mosaic._fits(c, m, k, n, 2) for c in space)
    assert all(2 * c.tile_m * c.tile_n <= 2 * 128 * 64 for c in space)


# --- numerics: the kernels in GPU interpret mode ----------------------------------------

def _mosaic_ragged_dot(lhs, rhs, group_sizes, *, precision, preferred_element_type, variant):
    """The Mosaic ragged dot's kernels, called directly (interpretable: no device check)."""
    out, _ = PallasMosaicGpuRaggedDot()._fwd(
        lhs, rhs, group_sizes, precision=precision, preferred_element_type=preferred_element_type,
        variant=variant, config=Config(tile_m=64, tile_n=64, tile_k=64, num_stages=2),
        return_residuals=False)
    return out


@pytest.mark.parametrize("fused, activation, mosaic_backward", [
    (True, jax.nn.swish, True),
    pytest.param(False, jax.nn.gelu, False, marks=pytest.mark.slow)])
def test_interpreted_kernel_matches_reference(fused, activation, mosaic_backward):
    x, weights = inputs(fused, jnp.bfloat16, seed=21, m=M, k=K, n=N)
    sizes = jnp.array(SIZES, jnp.int32)
    statics = dict(activation=activation, precision=None)
    with interpret_mode():
        out, residuals = Op()._fwd(x, weights, **statics, config=SMALL, return_residuals=True,
                                   group_sizes=sizes)
        cotangent = random_normal(28, out.shape).astype(out.dtype)
        ragged_dot = _mosaic_ragged_dot if mosaic_backward else GatedLinearUnitVjp().ragged_dot_op()
        grads = grouped_backward(ragged_dot, residuals, cotangent, x=x, weights=weights,
                                 group_sizes=sizes, **statics)
    want = reference(x, weights, SIZES, activation)
    assert_close(out, want, jnp.bfloat16)
    assert not np.any(np.asarray(out[sum(SIZES):], np.float32))
    # The residuals: the pre-activations as the ragged dot gives them (zeros in the tail).
    expected_residuals = Op().reference_op()._fwd(x, weights, **statics, config=None,
                                                  return_residuals=True, group_sizes=sizes)[1]
    for got, expected in zip(jax.tree.leaves(residuals), jax.tree.leaves(expected_residuals),
                             strict=True):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert_close(got, expected, jnp.bfloat16)
    wants = jax.grad(lambda x, w: jnp.sum(reference(x, w, SIZES, activation)
                                          * cotangent.astype(jnp.float32)), argnums=(0, 1))(
        *jax.tree.map(lambda a: a.astype(jnp.float32), (x, weights)))
    for got, expected in zip(jax.tree.leaves((grads["x"], grads["weights"])),
                             jax.tree.leaves(wants), strict=True):
        assert got.dtype == jnp.bfloat16
        assert_close(got, expected, jnp.bfloat16)


def test_interpreted_kernel_without_residuals():
    x, weights = inputs(True, jnp.bfloat16, seed=31, m=M, k=K, n=N)
    sizes = jnp.array((0, 200, 0, 0), jnp.int32)  # one group takes every row
    with interpret_mode():
        out, residuals = Op()._fwd(x, weights, activation=jax.nn.gelu, precision=None,
                                   config=SMALL, return_residuals=False, group_sizes=sizes)
    assert residuals is None
    assert_close(out, reference(x, weights, (0, 200, 0, 0), jax.nn.gelu), jnp.bfloat16)


# --- on the GPU ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("activation", [jax.nn.swish, jax.nn.gelu])
def test_gpu_matches_reference(fused, activation):
    sizes = (300, 0, 517, 129, 800)  # 1746 of 1800 rows
    x, weights = inputs(fused, jnp.bfloat16, seed=41, m=1800, k=512, n=768, g=len(sizes))
    group_sizes = jnp.array(sizes, jnp.int32)

    def fn(x, w):
        return glu(x, w, group_sizes=group_sizes, activation=activation, implementation="mosaic")

    check_against_reference(fn, x, weights, sizes, activation, jnp.bfloat16, seed=41)


@pytest.mark.gpu
def test_gpu_small_config_and_reruns_are_bitwise_equal():
    sizes = (64, 0, 100, 36)
    x, weights = inputs(True, jnp.bfloat16, seed=43, m=256, k=128, n=256, g=len(sizes))
    group_sizes = jnp.array(sizes, jnp.int32)
    fn = jax.jit(lambda x, w: glu(x, w, group_sizes=group_sizes,
                                  implementation=Op(config=SMALL)))
    out = fn(x, weights)
    assert_close(out, reference(x, weights, sizes, jax.nn.swish), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(fn(x, weights), np.float32),
                                  np.asarray(out, np.float32))


def test_an_explicit_triton_backward_for_a_grouped_call_raises_naming_the_fix():
    x = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2, 64, 2, 128), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((2,), jnp.int32)
    op = tokamax.GatedLinearUnit(vjp=tokamax.PallasTritonGatedLinearUnitVjp())

    def loss(x, w, sizes):
        out = tokamax.gated_linear_unit(x, w, group_sizes=sizes, implementation=op)
        return out.astype(jnp.float32).sum()

    with _target(), pytest.raises(NotImplementedError, match="no grouped form"):
        jax.export.export(jax.jit(jax.grad(loss)), platforms=["cuda"])(x, w, sizes)
