"""Quantized operands of `ragged_dot` / `ragged_dot_general`: int8 and float8 (e4m3) values
with scales, in `xla` (both forms) and `triton` (Pallas interpret mode; lowered for cuda),
forward and gradients, against float32 HIGHEST products of the dequantized operands."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import tokamax_pass
from conftest import H200, assert_close, random_normal, reference_precision
from tokamax_kernels.ragged_dot import PallasTritonRaggedDot, QuantizedArray
from tokamax_kernels.ragged_dot import pallas_triton_quantized as triton_quantized
from tokamax_kernels.ragged_dot.general import (
    RAGGED_CONTRACTING_DIMENSION_NUMBERS,
    TRANSPOSED_RHS_DIMENSION_NUMBERS,
    ragged_dot_general,
)
from tokamax_kernels.ragged_dot.pallas_triton import Config
from tokamax_kernels.ragged_dot.quantization import dequantize
from tokamax_kernels.ragged_dot.quantized import XlaBackend, _differentiable

M, K, N = 40, 64, 48
# Uneven, with an empty group, and rows past the sum (zeros).
SIZES = jnp.asarray([5, 0, 20, 3], jnp.int32)
G = int(SIZES.shape[0])
# 16-row tiles: the 20-row group takes two, the rows past the sum one; 16 divides K and N.
TILES = Config(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
TRITON = PallasTritonRaggedDot(interpret=True, config=TILES)
INT8, FP8 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)


def reference_dequantize(x) -> jax.Array:
    """float32 `(qvalue - zero_point) * scale`, each scale over its tile (written
    independently of the package's `dequantize`)."""
    if not hasattr(x, "qvalue"):
        return jnp.asarray(x, jnp.float32)
    values = np.asarray(x.qvalue.astype(jnp.float32))
    tiles = [o // s for o, s in zip(x.qvalue.shape, x.scale.shape, strict=True)]

    def spread(a):
        a = np.asarray(jnp.asarray(a, jnp.float32))
        for axis, t in enumerate(tiles):
            a = np.repeat(a, t, axis=axis)
        return a
    if x.zero_point is not None:
        values = values - spread(x.zero_point)
    return jnp.asarray(values * spread(x.scale))


def reference(lhs, rhs, sizes=SIZES) -> jax.Array:
    with reference_precision():
        return jax.lax.ragged_dot(reference_dequantize(lhs), reference_dequantize(rhs), sizes,
                                  precision=jax.lax.Precision.HIGHEST)


def weights(qtype, *, seed: int = 1, dtype=jnp.float32, **axes) -> QuantizedArray:
    axes = axes or dict(channelwise_axes=(0, 2))
    return QuantizedArray.quantize(random_normal(seed, (G, K, N), dtype), qtype, **axes)


def activations(qtype=None, *, seed: int = 0, dtype=jnp.float32):
    x = random_normal(seed, (M, K), dtype)
    return x if qtype is None else QuantizedArray.quantize(x, qtype, channelwise_axes=(0,))


def test_quantize_dequantize_round_trip_per_channel_and_per_tile():
    """int8 rounds to half a scale step; float8 e4m3 to 2**-4 of the value (3 mantissa
    bits), or half its smallest subnormal step (2**-10 of the scale)."""
    x = np.asarray(random_normal(0, (4, 64, 32)))
    per_channel = dict(channelwise_axes=(0, 2))
    per_tile = dict(tiled_axes={1: 16}, channelwise_axes=(0,))
    for qtype in (INT8, FP8):
        for axes in (per_channel, per_tile):
            qx = QuantizedArray.quantize(jnp.asarray(x), qtype, **axes)
            assert qx.qvalue.dtype == qtype and qx.dtype == x.dtype and qx.shape == x.shape
            scale = np.asarray(qx.scale)
            for axis, tile in enumerate(qx.tile_shape):
                scale = np.repeat(scale, tile, axis)
            err = np.abs(np.asarray(dequantize(qx)) - x)
            bound = (0.5 * scale if qtype == INT8
                     else 2.0**-4 * np.abs(x) + 2.0**-10 * scale)
            assert (err <= bound * (1 + 1e-6)).all()
    assert QuantizedArray.quantize(jnp.asarray(x), INT8, **per_tile).scale.shape == (4, 4, 1)


def test_quantized_array_rejects_scales_that_do_not_tile():
    with pytest.raises(ValueError, match="divide"):
        QuantizedArray(jnp.zeros((4, 6), jnp.int8), jnp.ones((4, 4)))
    with pytest.raises(ValueError, match="8-bit"):
        QuantizedArray(jnp.zeros((4, 6), jnp.int16), jnp.ones((4, 1)))


# (lhs qtype or None, rhs qtype): bf16-style activations with int8 or float8 weights,
# both float8 (per-row activation scales), both int8.
CASES = [(None, INT8), (None, FP8), (FP8, FP8), (INT8, INT8)]


@pytest.mark.exhaustive
@pytest.mark.parametrize("implementation", ["xla", TRITON], ids=["xla", "triton"])
@pytest.mark.parametrize(("lhs_qtype", "rhs_qtype"), CASES)
def test_forward_matches_dequantized_reference(implementation, lhs_qtype, rhs_qtype):
    lhs, rhs = activations(lhs_qtype), weights(rhs_qtype)
    got = tokamax_pass.ragged_dot(lhs, rhs, SIZES, implementation=implementation)
    assert got.dtype == jnp.float32
    assert_close(got, reference(lhs, rhs))
    assert not np.asarray(got[int(SIZES.sum()):]).any()  # rows past the groups


def test_int4_and_mixed_integer_values_in_xla():
    unsigned = QuantizedArray(
        jax.random.randint(jax.random.key(2), (G, K, N), 0, 256).astype(jnp.uint8),
        random_normal(3, (G, 1, N)))
    for lhs, rhs in ((activations(), weights(jnp.int4)), (activations(INT8), unsigned)):
        got = tokamax_pass.ragged_dot(lhs, rhs, SIZES, implementation="xla")
        assert_close(got, reference(lhs, rhs))


def test_under_vmap_each_batch_entry_has_its_own_groups():
    xs = jnp.stack([activations(seed=0), activations(seed=5)])
    sizes = jnp.stack([SIZES, jnp.asarray([10, 10, 0, 20], jnp.int32)])
    rhs = weights(INT8)
    got = jax.vmap(lambda x, s: tokamax_pass.ragged_dot(x, rhs, s))(xs, sizes)
    for i in range(2):
        assert_close(got[i], reference(xs[i], rhs, sizes[i]))


@pytest.mark.parametrize("path", ["lax", "tiled"])
def test_xla_forms_scale_after_the_dot(path):
    lhs, rhs = activations(dtype=jnp.bfloat16), weights(INT8)
    got = _differentiable(XlaBackend(path), None, jnp.dtype(jnp.float32))(lhs, rhs, SIZES)
    assert_close(got, reference(lhs, rhs))


@pytest.mark.parametrize("implementation", ["xla", TRITON], ids=["xla", "triton"])
def test_bf16_activations_int8_weights_forward_and_gradient(implementation):
    """The MoE case: bf16 activations, int8 weights with bf16 scales; bf16 output."""
    lhs = activations(dtype=jnp.bfloat16)
    rhs = weights(INT8, dtype=jnp.bfloat16)
    ct = random_normal(7, (M, N), jnp.bfloat16)
    got, vjp = jax.vjp(lambda x: tokamax_pass.ragged_dot(
        x, rhs, SIZES, implementation=implementation), lhs)
    want, want_vjp = jax.vjp(lambda x: reference(x, rhs), lhs.astype(jnp.float32))
    assert got.dtype == jnp.bfloat16
    assert_close(got, want, jnp.bfloat16)
    (dlhs,), (want_dlhs,) = vjp(ct), want_vjp(ct.astype(jnp.float32))
    assert dlhs.dtype == jnp.bfloat16
    assert_close(dlhs, want_dlhs, jnp.bfloat16)


@pytest.mark.parametrize("implementation", ["xla", TRITON], ids=["xla", "triton"])
@pytest.mark.parametrize("rhs_qtype", [INT8, FP8])
def test_gradient_of_unquantized_activations(implementation, rhs_qtype):
    lhs, rhs = activations(), weights(rhs_qtype)
    ct = random_normal(7, (M, N))
    _, vjp = jax.vjp(lambda x, w: tokamax_pass.ragged_dot(
        x, w, SIZES, implementation=implementation), lhs, rhs)
    dlhs, drhs = vjp(ct)
    _, want_vjp = jax.vjp(lambda x: reference(x, rhs), lhs)
    assert_close(dlhs, want_vjp(ct)[0])
    # A quantized operand is a constant: zero cotangents (float0 for integer values).
    assert isinstance(drhs, QuantizedArray)
    assert not np.asarray(drhs.scale).any()
    if rhs_qtype == INT8:
        assert drhs.qvalue.dtype == jax.dtypes.float0
    else:
        assert not np.asarray(drhs.qvalue.astype(jnp.float32)).any()


def test_gradient_of_unquantized_weights_with_quantized_activations():
    lhs, rhs = activations(FP8), random_normal(1, (G, K, N))
    ct = random_normal(7, (M, N))
    _, vjp = jax.vjp(lambda w: tokamax_pass.ragged_dot(lhs, w, SIZES), rhs)
    _, want_vjp = jax.vjp(lambda w: reference(lhs, w), rhs)
    assert_close(vjp(ct)[0], want_vjp(ct)[0])


@pytest.mark.parametrize("implementation", ["xla", TRITON], ids=["xla", "triton"])
def test_scales_per_block_of_k_and_zero_points(implementation):
    """Scales per 16 or 32 values of K (triton: on each 16-deep step's product), per 8
    (no step of 16 or more divides them: dequantized), a zero point (dequantized)."""
    x = random_normal(0, (M, K))
    for tile in (16, 32, 8):
        lhs = QuantizedArray.quantize(x, FP8, tiled_axes={1: tile}, channelwise_axes=(0,))
        rhs = weights(FP8, tiled_axes={1: 2 * tile}, channelwise_axes=(0, 2))
        assert lhs.scale.shape == (M, K // tile) and rhs.scale.shape == (G, K // tile // 2, N)
        got = tokamax_pass.ragged_dot(lhs, rhs, SIZES, implementation=implementation)
        assert_close(got, reference(lhs, rhs))
    per_tile = weights(INT8, tiled_axes={1: 16}, channelwise_axes=(0, 2))
    shifted = dataclasses.replace(per_tile, zero_point=jnp.full(per_tile.scale.shape, 3, INT8))
    got = tokamax_pass.ragged_dot(activations(), shifted, SIZES, implementation=implementation)
    assert_close(got, reference(activations(), shifted))


def test_triton_step_divides_the_scale_blocks():
    assert triton_quantized.block_k_for_scales(128, 512, 4, 1) == 128
    assert triton_quantized.block_k_for_scales(128, 512, 8, 16) == 32
    assert triton_quantized.block_k_for_scales(128, 512, 64) is None  # blocks of 8
    assert triton_quantized.block_k_for_scales(64, 96, 2) == 16  # blocks of 48


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QwixLikeArray:
    """qwix `QArray`'s fields, nothing of this package's: taken by duck typing."""

    qvalue: jax.Array
    scale: jax.Array
    zero_point: jax.Array | None = None
    qtype: object = dataclasses.field(default=None, metadata=dict(static=True))

    shape = property(lambda self: self.qvalue.shape)
    ndim = property(lambda self: self.qvalue.ndim)
    dtype = property(lambda self: self.scale.dtype)


def test_qwix_like_arrays_with_activation_and_output_dtype():
    ours = weights(FP8)
    rhs = QwixLikeArray(ours.qvalue, ours.scale, None, ours.qtype)
    lhs = activations()
    got = tokamax_pass.ragged_dot(lhs, rhs, SIZES, activation=jnp.tanh,
                                  preferred_element_type=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    assert_close(got, jnp.tanh(reference(lhs, rhs)), jnp.bfloat16)
    ct = random_normal(7, (M, N))
    dlhs = jax.grad(lambda x: (tokamax_pass.ragged_dot(x, rhs, SIZES) * ct).sum())(lhs)
    want = jax.grad(lambda x: (reference(x, rhs) * ct).sum())(lhs)
    assert_close(dlhs, want)


def test_ragged_dot_general_transposed_and_ragged_contracting_forms():
    lhs = activations()
    rhs = weights(INT8)
    transposed = rhs.swapaxes(1, 2)  # (G, N, K)
    got = ragged_dot_general(lhs, transposed, SIZES, TRANSPOSED_RHS_DIMENSION_NUMBERS,
                             implementation=TRITON)
    assert_close(got, reference(lhs, rhs))
    dout = QuantizedArray.quantize(random_normal(3, (M, N)), FP8, channelwise_axes=(0,))
    got = ragged_dot_general(lhs, dout, SIZES, RAGGED_CONTRACTING_DIMENSION_NUMBERS)
    with reference_precision():
        want = jax.lax.ragged_dot_general(
            lhs, reference_dequantize(dout), SIZES, RAGGED_CONTRACTING_DIMENSION_NUMBERS,
            precision=jax.lax.Precision.HIGHEST)
    assert_close(got, want)


def test_group_tiles_start_at_their_group_and_cover_every_row_once():
    sizes = jnp.asarray([70, 0, 64, 1, 30], jnp.int32)
    m, block_m = 180, 64
    group, first, rows = np.asarray(triton_quantized.group_tiles(sizes, m, block_m))
    assert len(group) == -(-m // block_m) + len(sizes) + 1  # the tail is one more group
    used = rows > 0
    starts = np.concatenate([[0], np.cumsum(sizes)])  # the tail (group 5) starts at 165
    owner = np.full(m, -1)
    for g, r0, count in zip(group[used], first[used], rows[used], strict=True):
        assert (r0 - starts[g]) % block_m == 0 and count <= block_m
        assert (owner[r0:r0 + count] == -1).all()
        owner[r0:r0 + count] = g
    np.testing.assert_array_equal(owner, np.repeat(np.arange(6), [*np.asarray(sizes), 15]))
    # A group of at most block_m rows is one tile (its weights read once a column block).
    assert [int((group[used] == g).sum()) for g in range(6)] == [2, 0, 1, 1, 1, 1]


def test_float8_weights_stored_contraction_major():
    """(G, N, K) float8 weights through the transposed form: the kernel reads them as
    they are, scales per group and column in its epilogue."""
    lhs = activations(FP8)
    rhs = QuantizedArray.quantize(random_normal(4, (G, N, K)), FP8, channelwise_axes=(0, 1))
    got = ragged_dot_general(lhs, rhs, SIZES, TRANSPOSED_RHS_DIMENSION_NUMBERS,
                             implementation=TRITON)
    assert_close(got, reference(lhs, rhs.swapaxes(1, 2)))
    assert not np.asarray(got[int(SIZES.sum()):]).any()


def _exported_dot(dtype, trans_b: bool) -> str:
    """The Triton module (serialized) of one Pallas Triton dot of two `dtype` tiles, from
    its cuda export for an H200."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = plgpu.dot(a_ref[...], b_ref[...], trans_b=trans_b)

    def f(a, b):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                              compiler_params=plgpu.CompilerParams(num_warps=4))(a, b)

    tile = jax.ShapeDtypeStruct((64, 64), dtype)
    with _h200():
        text = jax.export.export(jax.jit(f), platforms=["cuda"],
                                 disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(
            tile, tile).mlir_module()
    return re.search(r'ir = "(.*?)", name = "kernel"', text, re.S).group(1)


@pytest.mark.parametrize(("dtype", "trans_b", "changed"),
                         [(FP8, True, True), (FP8, False, False), (jnp.bfloat16, True, False)])
def test_float8_accumulation_rule_marks_only_contraction_major_float8_dots(dtype, trans_b,
                                                                          changed):
    from tokamax_kernels._triton_float8_dot import set_float8_imprecise_accumulation
    try:
        set_float8_imprecise_accumulation(None)
        pallas = _exported_dot(dtype, trans_b)
        set_float8_imprecise_accumulation(128)
        ours = _exported_dot(dtype, trans_b)
    finally:
        set_float8_imprecise_accumulation(triton_quantized.FLOAT8_IMPRECISE_ACCUMULATION)
    assert (ours != pallas) == changed


def test_mosaic_does_not_take_quantized_operands_and_a_sequence_moves_on():
    lhs, rhs = activations(), weights(INT8)
    with pytest.raises(NotImplementedError, match="quantized"):
        tokamax_pass.ragged_dot(lhs, rhs, SIZES, implementation="mosaic")
    got = tokamax_pass.ragged_dot(lhs, rhs, SIZES, implementation=("mosaic", "xla"))
    assert_close(got, reference(lhs, rhs))


def test_triton_on_cpu_raises_without_interpret():
    with pytest.raises(NotImplementedError, match="cuda"):
        tokamax_pass.ragged_dot(activations(), weights(INT8), SIZES, implementation="triton")


def _h200():
    return jax.sharding.use_abstract_mesh(AbstractMesh(
        (1,), ("_target",), axis_types=(AxisType.Auto,),
        abstract_device=AbstractDevice(H200, None, "cuda")))


@pytest.mark.parametrize(("lhs_dtype", "rhs_dtype", "k_block"),
                         [(jnp.bfloat16, INT8, None), (FP8, FP8, None), (FP8, FP8, 128)])
def test_triton_lowers_for_cuda_forward_and_gradient(lhs_dtype, rhs_dtype, k_block):
    """bf16 x int8 (forward and dlhs), float8 x float8 with scales per row and column,
    and per 128 values of K (as block-quantized float8 models store them)."""
    m, k, n, g = 1024, 512, 384, 8
    blocks = 1 if k_block is None else k // k_block

    def f(x, qvalue, scale, sizes):
        rhs = QuantizedArray(qvalue, scale)
        if jnp.dtype(lhs_dtype) == FP8:
            x = QuantizedArray(x, jnp.ones((m, blocks), jnp.bfloat16))
            return tokamax_pass.ragged_dot(x, rhs, sizes, implementation="triton")
        return jax.value_and_grad(lambda x: tokamax_pass.ragged_dot(
            x, rhs, sizes, implementation="triton").astype(jnp.float32).sum())(x)

    args = (jax.ShapeDtypeStruct((m, k), lhs_dtype), jax.ShapeDtypeStruct((g, k, n), rhs_dtype),
            jax.ShapeDtypeStruct((g, blocks, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((g,), jnp.int32))
    with _h200():
        exported = jax.export.export(
            jax.jit(f), platforms=["cuda"],
            disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(*args)
    text = exported.mlir_module()
    calls = 1 if jnp.dtype(lhs_dtype) == FP8 else 2  # forward; and the dlhs
    assert text.count("__gpu$xla.gpu.triton") == calls
    assert "tokamax_quantized_ragged_dot_forward" in text
    assert ("tokamax_quantized_ragged_dot_dlhs" in text) == (calls == 2)


def test_none_runs_triton_for_a_gpu_target_and_xla_on_cpu():
    """`implementation=None` takes the kernel where the target runs it (an export aimed at
    the H200 from this CPU machine) and the plain path here."""
    m, k, n, g = 256, 256, 128, 4

    def f(x, qvalue, scale, sizes):
        return tokamax_pass.ragged_dot(x, QuantizedArray(qvalue, scale), sizes)

    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((g, k, n), INT8),
            jax.ShapeDtypeStruct((g, 1, n), jnp.bfloat16), jax.ShapeDtypeStruct((g,), jnp.int32))
    with _h200():
        exported = jax.export.export(
            jax.jit(f), platforms=["cuda"],
            disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(*args)
    assert "tokamax_quantized_ragged_dot_forward" in exported.mlir_module()
    here = jax.jit(f).lower(*args).as_text()
    assert "triton" not in here


def test_quantize_an_empty_axis_takes_one_scale():
    """Weights with no columns quantized per column: a scale per index of an empty axis
    would be none (which `QuantizedArray` refuses), so the axis takes one scale; the
    ragged dot through them is (M, 0) (the Triton kernel refuses empty operands with a
    NotImplementedError, and `None` runs `xla`)."""
    rhs = QuantizedArray.quantize(jnp.zeros((G, K, 0)), INT8, channelwise_axes=(0, 2))
    assert rhs.qvalue.shape == (G, K, 0) and rhs.scale.shape == (G, 1, 1)
    assert tokamax_pass.ragged_dot(activations(), rhs, SIZES).shape == (M, 0)
    with pytest.raises(NotImplementedError, match="non-empty"):
        tokamax_pass.ragged_dot(activations(), rhs, SIZES, implementation=TRITON)


def test_no_groups_give_zeros_and_zero_gradients():
    """Quantized weights of no groups: every row is past the groups, so the product and
    the lhs gradient are zeros (the per-row scales were read from the last group, which
    there is not: a gather error)."""
    rhs = QuantizedArray.quantize(jnp.zeros((0, K, N)), INT8, channelwise_axes=(0, 2))
    sizes = jnp.zeros((0,), jnp.int32)
    lhs = activations()
    np.testing.assert_array_equal(np.asarray(tokamax_pass.ragged_dot(lhs, rhs, sizes)), 0.0)
    dlhs = jax.grad(lambda x: tokamax_pass.ragged_dot(x, rhs, sizes).sum())(lhs)
    np.testing.assert_array_equal(np.asarray(dlhs), 0.0)
