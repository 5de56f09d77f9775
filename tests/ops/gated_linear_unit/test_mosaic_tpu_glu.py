"""PallasMosaicTpuGatedLinearUnit on CPU beyond the base suite
(`test_gated_linear_unit_suite.py`, which runs its numerics in Pallas interpret mode): the
kernel alone in the TPU interpreter, the family's residual contract with another gradient, what
the kernel refuses, its heuristics per TPU generation, the forward lowered for TPUs
(`tpu_custom_call`) by `jax.export`, and `None` running it only where measured faster.

The same for grouped calls (`group_sizes`, MoE expert GEMMs) against a per-group float32
HIGHEST reference: uneven groups, an empty one, rows past the last group (zeros), row
blocks straddling group boundaries and a last row block past x's end; the residuals in
the family's form, which the family's XLA gradient reads. Both under nested `jax.vmap`
(per-example x inside a vmap over weights), interpreted and lowered for TPUs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

import tokamax_pass
from conftest import assert_close, measured, random_normal, reference_precision
from test_grouped_glu import (
    PAIRWISE,
    check_against_reference,
    check_nested_vmap,
    nested_vmap_inputs,
    reference,
)
from tokamax_kernels.gated_linear_unit import (
    GatedLinearUnit,
    PallasMosaicTpuGatedLinearUnit,
    PallasTritonGatedLinearUnitVjp,
    api,
)
from tokamax_kernels.gated_linear_unit._mosaic_tpu_grouped_kernel import grouped_glu_forward
from tokamax_kernels.gated_linear_unit._mosaic_tpu_kernel import glu_forward
from tokamax_kernels.gated_linear_unit.pallas_mosaic_tpu import Config
from tokamax_pass import core

# 2 x 19 = 38 rows in 16-row blocks (the last block has 6 rows and reads past the end:
# NaN in the interpreter); K = 256 in two 128-deep steps; N = 384 in three column blocks
# (the up half of fused weights starts three blocks in).
LEAD, K, N = (2, 19), 256, 384
TILES = Config(block_m=16, block_n=128, block_k=128)


def exact_gelu(x):
    return jax.nn.gelu(x, approximate=False)


def _op(config: Config | None = TILES) -> PallasMosaicTpuGatedLinearUnit:
    return PallasMosaicTpuGatedLinearUnit(interpret=True, config=config)


def _inputs(dtype, fused: bool, seed: int = 0):
    x = (2 * random_normal(seed, (*LEAD, K)) + 0.5).astype(dtype)
    w = (random_normal(seed + 1, (K, 2, N)) / 16).astype(dtype)
    return x, w if fused else (w[:, 0], w[:, 1])


def _loss(implementation, activation, cotangent, x, weights):
    out = api.gated_linear_unit(x, weights, activation=activation,
                                implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * cotangent)


def test_kernel_in_the_tpu_interpreter():
    """The kernel alone under `pltpu.InterpretParams`, which models TPU block pipelining
    (an output block is written back when its index changes; unwritten VMEM is NaN)."""
    x, weights = _inputs(jnp.float32, True, seed=7)
    rows = x.reshape(-1, K)
    both = weights.reshape(K, 2 * N)
    got = glu_forward(rows, both, both, up_offset=N, activation=jax.nn.swish, block_m=16,
                      block_n=128, block_k=128, interpret=pltpu.InterpretParams())
    with reference_precision():
        want = GatedLinearUnit()(rows, weights, activation=jax.nn.swish)
    assert_close(got, want)


def test_pairs_with_another_gradient_through_no_residuals():
    """Dense calls keep no residuals: this forward feeds any gradient of the family (the
    Triton one here, in its interpreter) and the XLA forward feeds the XLA gradient."""
    x, weights = _inputs(jnp.float32, False, seed=9)
    op = _op().replace(vjp=PallasTritonGatedLinearUnitVjp(interpret=True))
    cotangent = random_normal(10, (*LEAD, N))
    grads = jax.grad(functools.partial(_loss, op, jax.nn.swish, cotangent),
                     argnums=(0, 1))(x, weights)
    with reference_precision():
        want = jax.grad(functools.partial(_loss, "xla", jax.nn.swish, cotangent),
                        argnums=(0, 1))(x, weights)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        assert_close(g, w)


def test_unsupported_inputs_and_bad_configs():
    x, weights = _inputs(jnp.float32, True)
    with pytest.raises(NotImplementedError, match="bf16 or f32 x and weights of one dtype"):
        _op()(x.astype(jnp.float16), weights.astype(jnp.float16))
    with pytest.raises(NotImplementedError, match="of one dtype"):
        _op()(x, weights.astype(jnp.bfloat16))
    with pytest.raises(NotImplementedError, match=r"K \(200\) and N \(384\) multiples of 128"):
        _op()(x[..., :200], weights[:200])
    with pytest.raises(NotImplementedError, match=r"cannot lower \[.*'erfc'"):
        _op()(x, weights, activation=exact_gelu)
    with pytest.raises(NotImplementedError, match="tpu"):
        PallasMosaicTpuGatedLinearUnit()(x, weights)  # CPU, no interpret
    with pytest.raises(NotImplementedError, match="block_n must divide N"):
        _op(Config(16, 256, 128))(x, weights)  # 256 does not divide N = 384
    big = (jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
           jax.ShapeDtypeStruct((4096, 2, 4096), jnp.float32))
    with core.targeting("TPU v4", "tpu"), pytest.raises(NotImplementedError, match="VMEM"):
        jax.eval_shape(lambda x, w: _op(Config(512, 512, 512))(x, w), *big)
    with pytest.raises(ValueError, match="block_m must be a positive multiple of 16"):
        Config(24, 128, 128)
    with pytest.raises(ValueError, match="block_n must be a positive multiple of 128"):
        Config(16, 64, 128)
    with pytest.raises(ValueError, match="block_k must be a positive multiple of 128"):
        Config(16, 128, 0)
    with pytest.raises(ValueError, match="block_m must be a positive multiple of 16"):
        Config(True, 128, 128)


def _bound(m, k, n, dtype):
    return PallasMosaicTpuGatedLinearUnit.bind(jax.ShapeDtypeStruct((m, k), dtype),
                                               jax.ShapeDtypeStruct((k, 2, n), dtype))


def test_heuristics_follow_the_tpu_generation():
    configs = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        ba = _bound(16384, 2048, 5632, dtype)  # the Llama MLP
        for kind in ("TPU v4", "TPU v5p", "TPU v5 lite", "TPU v6 lite"):
            with core.targeting(kind, "tpu"):
                configs[dtype, kind] = ba.heuristics_config
                assert ba.heuristics_config in ba.autotuning_configs
                assert 10 <= len(ba.autotuning_configs) <= 27
                ba.op.replace(config=ba.heuristics_config).check_supported(ba, None)
    assert configs[jnp.bfloat16, "TPU v6 lite"] == Config(512, 512, 512)
    # float32 tiles take twice the VMEM: v4's 16 MiB holds narrower ones than v6e's 128.
    assert configs[jnp.float32, "TPU v4"].block_n < configs[jnp.float32, "TPU v6 lite"].block_n
    # Fewer rows than a block: one block of all of them; K = 2304 is not a multiple of
    # 512, so the deepest step that divides it is 256.
    decode = _bound(8, 2304, 9216, jnp.bfloat16)
    with core.targeting("TPU v5 lite", "tpu"):
        assert decode.heuristics_config.block_k == 256
        assert {c.block_m for c in decode.autotuning_configs} == {128}  # one row tiling


def _export(implementation, *, fused=True, dtype=jnp.bfloat16, gradient=True,
            kind="TPU v5 lite"):
    def forward(x, weights):
        return api.gated_linear_unit(x, weights, implementation=implementation)

    def f(x, weights):
        if not gradient:
            return forward(x, weights)
        return jax.value_and_grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)),
                                  argnums=(0, 1))(x, weights)

    with core.targeting(kind):
        return jax.export.export(jax.jit(f), platforms=["tpu"])(
            *_tpu_args(fused, dtype)).mlir_module()


def _tpu_args(fused=True, dtype=jnp.bfloat16):
    x = jax.ShapeDtypeStruct((4, 1000, 2048), dtype)
    if fused:
        return x, jax.ShapeDtypeStruct((2048, 2, 5632), dtype)
    return x, (jax.ShapeDtypeStruct((2048, 5632), dtype),) * 2


@pytest.mark.parametrize("fused, dtype", [(True, jnp.bfloat16), (False, jnp.float32)])
def test_lowers_for_tpu_forward_and_gradients(fused, dtype):
    text = _export("mosaic_tpu", fused=fused, dtype=dtype)
    assert text.count("tpu_custom_call") == 1  # the forward; the gradient is XLA's
    for name in ("tokamax_glu_forward", "PallasMosaicTpuGatedLinearUnit",
                 "GatedLinearUnitVjp"):
        assert name in text


def test_mosaic_names_the_tpu_kernel_and_the_gpu_kernels_refuse_a_tpu():
    assert _export("mosaic", gradient=False).count("tpu_custom_call") == 1
    with pytest.raises(NotImplementedError, match=r"\['cuda'\], not on tpu"):
        _export("triton")


def test_none_runs_the_tpu_kernel_only_where_measured_faster():
    assert "tpu_custom_call" not in _export(None)  # nothing measured: the XLA path
    assert "tpu_custom_call" not in _export(None, gradient=False)

    def timed(kernel_ms, kind="TPU v5 lite"):
        return measured(kind, {PallasMosaicTpuGatedLinearUnit(): kernel_ms,
                               GatedLinearUnit(): 3.0}, *_tpu_args())

    with timed(1.0):  # faster by more than the dense GLU's margin of half
        assert "tpu_custom_call" in _export(None, gradient=False)
        assert _export(None).count("tpu_custom_call") == 1  # the forward; XLA's gradient
    with timed(2.0):  # faster, but XLA merges its gradient's products with its forward's
        assert "tpu_custom_call" not in _export(None, gradient=False)
    with timed(1.0, kind="TPU v6 lite"):  # another generation's measurement is no evidence
        assert "tpu_custom_call" not in _export(None, gradient=False)


def test_exported_by_tokamax_pass():
    assert tokamax_pass.PallasMosaicTpuGatedLinearUnit is PallasMosaicTpuGatedLinearUnit
    assert api.FAMILY.implementations["mosaic_tpu"] is PallasMosaicTpuGatedLinearUnit
    assert api.FAMILY.aliases["mosaic"] == ("mosaic_gpu", "mosaic_tpu")


# --- grouped calls (group_sizes) -----------------------------------------------------------

# Uneven groups, an empty one, 141 of 150 rows (9 rows past the last group give zeros). In
# 32-row blocks, the boundaries at rows 37, 98 and 141 straddle blocks 1, 3 and 4, and the
# last block (22 rows) reads past x's end (NaN in the interpreter). K = 256 in two steps;
# N = 256 in two column blocks (the up half of fused weights starts two blocks in).
SIZES = (37, 0, 61, 43)
GM, GK, GN, G = 150, 256, 256, len(SIZES)
GROUPED_TILES = Config(block_m=32, block_n=128, block_k=128)


def _grouped_inputs(dtype, fused: bool, seed: int = 0):
    x = (2 * random_normal(seed, (GM, GK)) + 0.5).astype(dtype)
    w = (random_normal(seed + 1, (G, GK, 2, GN)) / 16).astype(dtype)
    return x, w if fused else (w[:, :, 0], w[:, :, 1])


def _grouped(implementation, activation=jax.nn.swish):
    sizes = jnp.array(SIZES, jnp.int32)
    return lambda x, w: api.gated_linear_unit(x, w, group_sizes=sizes, activation=activation,
                                              implementation=implementation)


# Every pair of (fused, activation, dtype) values in four cases (`test_grouped_glu.PAIRWISE`).
@pytest.mark.parametrize("fused, activation, dtype", PAIRWISE, ids=[
    f"{'fused' if f else 'pair'}-{'swish' if a is jax.nn.swish else 'gelu'}-"
    f"{'f32' if d == jnp.float32 else 'bf16'}" for f, a, d in PAIRWISE])
def test_grouped_forward_and_gradients_match_reference(fused, activation, dtype):
    """Forward (tail rows exactly zero) and the gradients of x and the weights (the
    family's XLA gradient, reading this kernel's residuals) under a random cotangent."""
    x, weights = _grouped_inputs(dtype, fused, seed=11)
    check_against_reference(_grouped(_op(GROUPED_TILES), activation), x, weights, SIZES,
                            activation, dtype, seed=12)


def test_grouped_heuristics_config_matches_reference():
    """`config=None`: the heuristic tiles (one block of all 150 rows here, f32)."""
    x, weights = _grouped_inputs(jnp.float32, True, seed=13)
    assert_close(_grouped(_op(None))(x, weights),
                 reference(x, weights, SIZES, jax.nn.swish))


def test_grouped_kernel_in_the_tpu_interpreter():
    """The grouped kernel alone under `pltpu.InterpretParams`, which writes an output block
    back when its index changes: the work tiles that share a row block must be consecutive
    and each write only its rows. Output and residuals, pair weights."""
    x, (w_gate, w_up) = _grouped_inputs(jnp.float32, False, seed=15)
    sizes = jnp.array(SIZES, jnp.int32)
    out, gate, up = grouped_glu_forward(
        x, w_gate, w_up, sizes, up_offset=0, activation=jax.nn.swish, residuals=True,
        block_m=32, block_n=128, block_k=128, interpret=pltpu.InterpretParams())
    assert_close(out, reference(x, (w_gate, w_up), SIZES, jax.nn.swish))
    for got, w in ((gate, w_gate), (up, w_up)):  # the pre-activations; tail rows zero
        assert_close(got, jax.lax.ragged_dot(x, w, sizes, precision="highest"))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pair"])
def test_grouped_residuals_take_the_family_form(fused):
    """The residuals are XLA's (the pre-activations, one (M, 2N) array for fused weights,
    a pair for a pair), so the forward pairs with every grouped gradient of the family."""
    x, weights = _grouped_inputs(jnp.float32, fused, seed=17)
    sizes = jnp.array(SIZES, jnp.int32)

    def residuals(implementation):
        with reference_precision():
            return api.FAMILY(implementation, x, weights, group_sizes=sizes,
                              return_residuals=True)[1]

    got, want = residuals(_op(GROUPED_TILES)), residuals("xla")
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_close(g, w)


def test_grouped_unsupported_inputs():
    x, weights = _grouped_inputs(jnp.float32, True)
    sizes = jnp.array(SIZES, jnp.int32)
    with pytest.raises(NotImplementedError, match=r"K \(200\) and N \(256\) multiples of 128"):
        api.gated_linear_unit(x[:, :200], weights[:, :200], group_sizes=sizes,
                              implementation=_op())
    with pytest.raises(NotImplementedError, match=r"cannot lower \[.*'erfc'"):
        _grouped(_op(), exact_gelu)(x, weights)
    wide = random_normal(19, (G, GK, 2, 384)) / 16
    with pytest.raises(NotImplementedError, match="block_n must divide N"):
        _grouped(_op(Config(32, 256, 128)))(x, wide)  # 256 does not divide N = 384
    with pytest.raises(ValueError, match="group_sizes"):  # the family's own checks
        api.gated_linear_unit(x, weights, group_sizes=jnp.array([100, 100], jnp.int32),
                              implementation=_op())


def test_grouped_heuristics_follow_the_tpu_generation():
    """Mixtral's experts; grouped configs leave VMEM for the residual tiles."""
    ba = PallasMosaicTpuGatedLinearUnit.bind(
        jax.ShapeDtypeStruct((32768, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 4096, 2, 14336), jnp.bfloat16),
        group_sizes=jax.ShapeDtypeStruct((8,), jnp.int32))
    dense = _bound(32768, 4096, 14336, jnp.bfloat16)
    for kind in ("TPU v4", "TPU v5p", "TPU v5 lite", "TPU v6 lite"):
        with core.targeting(kind, "tpu"):
            config = ba.heuristics_config
            assert config in ba.autotuning_configs
            assert ba.autotuning_configs <= dense.autotuning_configs
            ba.op.replace(config=config).check_supported(ba, None)
    with core.targeting("TPU v4", "tpu"):  # 8 MiB budget: residual tiles rule some out
        assert ba.autotuning_configs < dense.autotuning_configs


def _grouped_export(implementation, *, fused=True, dtype=jnp.bfloat16, gradient=True):
    def forward(x, weights, sizes):
        return api.gated_linear_unit(x, weights, group_sizes=sizes,
                                     implementation=implementation)

    def f(x, weights, sizes):
        if not gradient:
            return forward(x, weights, sizes)
        return jax.value_and_grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)),
                                  argnums=(0, 1))(x, weights, sizes)

    with core.targeting("TPU v5 lite"):
        return jax.export.export(jax.jit(f), platforms=["tpu"])(
            *_grouped_tpu_args(fused, dtype)).mlir_module()


def _grouped_tpu_args(fused=True, dtype=jnp.bfloat16):
    x = jax.ShapeDtypeStruct((8192, 2048), dtype)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    if fused:
        return x, jax.ShapeDtypeStruct((8, 2048, 2, 5632), dtype), sizes
    return x, (jax.ShapeDtypeStruct((8, 2048, 5632), dtype),) * 2, sizes


@pytest.mark.parametrize("fused, dtype", [(True, jnp.bfloat16), (False, jnp.float32)])
def test_grouped_lowers_for_tpu_forward_and_gradients(fused, dtype):
    """One kernel (with residuals), then the XLA gradient's ragged dots: no GEMM reruns."""
    assert _grouped_export("mosaic_tpu", fused=fused, dtype=dtype,
                           gradient=False).count("tpu_custom_call") == 1
    text = _grouped_export("mosaic_tpu", fused=fused, dtype=dtype)
    assert text.count("tpu_custom_call") == 1
    for name in ("tokamax_grouped_glu_forward", "PallasMosaicTpuGatedLinearUnit",
                 "GatedLinearUnitVjp", "chlo.ragged_dot"):
        assert name in text


def test_grouped_none_runs_the_tpu_kernel_only_where_measured_faster():
    assert "tpu_custom_call" not in _grouped_export(None)  # nothing measured: XLA
    x, weights, sizes = _grouped_tpu_args()

    def timed(kernel_ms, kind="TPU v5 lite"):
        return measured(kind, {PallasMosaicTpuGatedLinearUnit(): kernel_ms,
                               GatedLinearUnit(): 3.0}, x, weights, group_sizes=sizes)

    with timed(2.0):  # faster: grouped calls keep residuals, no margin of half
        assert "tpu_custom_call" in _grouped_export(None, gradient=False)
        assert _grouped_export(None).count("tpu_custom_call") == 1
    with timed(2.0, kind="TPU v6 lite"):  # another generation's measurement is no evidence
        assert "tpu_custom_call" not in _grouped_export(None, gradient=False)
    with timed(3.5):  # slower
        assert "tpu_custom_call" not in _grouped_export(None, gradient=False)


# --- jax.vmap ------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pair"])
def test_nested_vmap_matches_reference(fused):
    """Dense: Pallas batches the kernel (one more grid axis per level); an outer level maps
    the weights, an inner one x per example. Forward and gradients, random cotangent."""
    x = random_normal(30, (2, 3, 19, K))
    w = random_normal(31, (2, K, 2, N)) / 16
    weights = w if fused else (w[:, :, 0], w[:, :, 1])
    cotangent = random_normal(32, (2, 3, 19, N))

    def loss(implementation, x, weights):
        def one(x, w):
            return api.gated_linear_unit(x, w, implementation=implementation)
        out = jax.vmap(jax.vmap(one, in_axes=(0, None)))(x, weights)
        return jnp.sum(out * cotangent), out

    grad = jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)
    (_, got), grads = grad(_op(), x, weights)
    with reference_precision():
        (_, want), want_grads = grad("xla", x, weights)
    assert_close(got, want)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert_close(g, w)


@pytest.mark.parametrize("fused, tiles", [(True, GROUPED_TILES), (False, Config(256, 128, 128))],
                         ids=["fused-32-row-blocks", "pair-whole-entry-blocks"])
def test_grouped_nested_vmap_matches_reference(fused, tiles):
    """Grouped: the mapped axes fold into the kernel's entries (per-entry group sizes, the
    weights shared by the inner entries and mapped by the outer level). A block of an
    entry's 150 rows becomes 160-row blocks over all the entries' rows."""
    inputs = nested_vmap_inputs(fused, jnp.float32, seed=33, m=GM, k=GK, n=GN, g=G)
    check_nested_vmap(_op(tiles), *inputs, seed=34)


def _vmapped_export(implementation, grouped):
    """`value_and_grad` of a per-example call vmapped over 2 x 3 entries (weights shared),
    100 rows each: one row block of an entry's rows is no legal TPU block of all of them."""
    def f(x, weights, sizes):
        def one(x, s):
            group_sizes = dict(group_sizes=s) if grouped else {}
            return api.gated_linear_unit(x, weights, implementation=implementation,
                                         **group_sizes)
        out = jax.vmap(jax.vmap(one))(x, sizes)
        return out.astype(jnp.float32).sum()

    x = jax.ShapeDtypeStruct((2, 3, 100, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((8, 2048, 2, 5632) if grouped else (2048, 2, 5632), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((2, 3, 8), jnp.int32)
    with core.targeting("TPU v5 lite", "tpu"):
        return jax.export.export(jax.jit(jax.value_and_grad(f, argnums=(0, 1))),
                                 platforms=["tpu"])(x, w, sizes).mlir_module()


@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
def test_nested_vmap_lowers_for_tpu_and_none_keeps_the_kernel_where_measured(grouped):
    assert _vmapped_export("mosaic_tpu", grouped).count("tpu_custom_call") == 1
    assert "tpu_custom_call" not in _vmapped_export(None, grouped)
    x = jax.ShapeDtypeStruct((100, 2048), jnp.bfloat16)
    if grouped:  # leaves in tree order: group_sizes, weights, x; the outer level first
        args = (x, jax.ShapeDtypeStruct((8, 2048, 2, 5632), jnp.bfloat16))
        kwargs = dict(group_sizes=jax.ShapeDtypeStruct((8,), jnp.int32))
        axes = (0, None, 0)
    else:  # weights, x
        args, kwargs, axes = (x, jax.ShapeDtypeStruct((2048, 2, 5632), jnp.bfloat16)), {}, (
            None, 0)
    vmap = (core.bound_arguments.VmapLevel(axes, 2), core.bound_arguments.VmapLevel(axes, 3))
    times = {PallasMosaicTpuGatedLinearUnit(): 1.0, GatedLinearUnit(): 3.0}
    with measured("TPU v5 lite", times, *args, vmap=vmap, **kwargs):
        assert _vmapped_export(None, grouped).count("tpu_custom_call") == 1
