"""ragged_dot's upstream Tokamax arguments (`activation`, positional `precision`,
`group_offset`) and `ragged_dot_general`, against float32 HIGHEST references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from tokamax_kernels.ragged_dot.general import TRANSPOSED_RHS_DIMENSION_NUMBERS
from tokamax_kernels.ragged_dot.pallas_triton import Config as TritonConfig

HIGHEST = jax.lax.Precision.HIGHEST
M, K, N = 10, 16, 12
# Two batch entries: 2 rows past the groups in the first, an empty group in the second.
GROUP_SIZES = jnp.array([[3, 0, 5], [4, 6, 0]], jnp.int32)
RAGGED_CONTRACTING = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def group_of_rows(group_sizes):
    """Each row's group, or -1 for rows past the groups."""
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(M), side="right")
    return jnp.where(jnp.arange(M) < ends[-1], group, -1)


def reference(lhs, rhs, group_sizes, activation=None):
    group = group_of_rows(group_sizes)
    out = jnp.einsum("mk,mkn->mn", lhs, rhs[jnp.maximum(group, 0)], precision=HIGHEST)
    out = jnp.where(group[:, None] >= 0, out, 0.0)
    return out if activation is None else activation(out)


def reference_ragged_contracting(lhs, rhs, group_sizes):
    group = group_of_rows(group_sizes)
    onehot = (group[:, None] == jnp.arange(3)).astype(lhs.dtype)  # (M, G)
    return jnp.einsum("mg,mk,mn->gkn", onehot, lhs, rhs, precision=HIGHEST)


def per_entry(f):
    """`f` over the batch of group sizes, one entry at a time (jax.lax.ragged_dot_general
    does not batch group sizes alone under vmap)."""
    return lambda a, b, gs: jnp.stack([f(a, b, g) for g in gs])


def check(f, ref, lhs, rhs, out_shape, dtype=jnp.float32, batch=jax.vmap):
    dout = random_normal(9, (2, *out_shape))
    batched = batch(f) if batch is per_entry else batch(f, in_axes=(None, None, 0))
    out, pullback = jax.vjp(batched, lhs, rhs, GROUP_SIZES)
    expected, ref_pullback = jax.vjp(jax.vmap(ref, in_axes=(None, None, 0)), lhs.astype(
        jnp.float32), rhs.astype(jnp.float32), GROUP_SIZES)
    assert out.dtype == dtype
    assert_close(out, expected, dtype)
    for g, e in zip(pullback(dout.astype(dtype))[:2], ref_pullback(dout)[:2], strict=True):
        assert_close(g, e, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_activation_applies_to_the_whole_product(dtype):
    lhs, rhs = random_normal(0, (M, K), dtype), random_normal(1, (3, K, N), dtype)
    # sigmoid(0) = 0.5: rows past the groups show the activation was applied there too.
    check(lambda a, b, g: tokamax.ragged_dot(a, b, g, HIGHEST, activation=jax.nn.sigmoid),
          lambda a, b, g: reference(a, b, g, jax.nn.sigmoid), lhs, rhs, (M, N), dtype)


def test_general_with_the_default_and_transposed_rhs_dimension_numbers():
    lhs, rhs = random_normal(2, (M, K)), random_normal(3, (3, K, N))
    default = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    check(lambda a, b, g: tokamax.ragged_dot_general(a, b, g, default, HIGHEST),
          reference, lhs, rhs, (M, N))
    check(lambda a, b, g: tokamax.ragged_dot_general(
        a, jnp.swapaxes(b, 1, 2), g, TRANSPOSED_RHS_DIMENSION_NUMBERS, HIGHEST,
        activation=jnp.tanh), lambda a, b, g: reference(a, b, g, jnp.tanh), lhs, rhs, (M, N))


def test_general_with_ragged_contracting_dimensions_runs_in_xla():
    lhs, rhs = random_normal(4, (M, K)), random_normal(5, (M, N))
    for implementation in (None, "xla", ["triton", "xla"]):
        check(lambda a, b, g, impl=implementation: tokamax.ragged_dot_general(
            a, b, g, RAGGED_CONTRACTING, HIGHEST, implementation=impl),
            reference_ragged_contracting, lhs, rhs, (3, K, N), batch=per_entry)
    with pytest.raises(NotImplementedError, match="'xla' implementation only"):
        tokamax.ragged_dot_general(lhs, rhs, GROUP_SIZES[0], RAGGED_CONTRACTING,
                                   implementation="triton")
    with pytest.raises(ValueError, match="unknown implementation"):
        tokamax.ragged_dot_general(lhs, rhs, GROUP_SIZES[0], RAGGED_CONTRACTING,
                                   implementation=["xla", "fastest"])


@pytest.mark.parametrize("lhs_contracting,rhs_contracting", [(0, 1), (1, 0), (1, 1)])
def test_ragged_contracting_in_every_matrix_layout_has_a_gradient(lhs_contracting,
                                                                    rhs_contracting):
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([lhs_contracting], [rhs_contracting]), ([], [])),
        lhs_ragged_dimensions=[lhs_contracting], rhs_group_dimensions=[])
    lhs, rhs = random_normal(4, (M, K)), random_normal(5, (M, N))
    check(lambda a, b, g: tokamax.ragged_dot_general(
        a if lhs_contracting == 0 else a.T, b if rhs_contracting == 0 else b.T, g, numbers,
        HIGHEST), reference_ragged_contracting, lhs, rhs, (3, K, N), batch=per_entry)


def test_group_offset_is_not_supported():
    lhs, rhs = random_normal(6, (M, K)), random_normal(7, (3, K, N))
    with pytest.raises(NotImplementedError, match="group_offset"):
        tokamax.ragged_dot(lhs, rhs, GROUP_SIZES[0], group_offset=jnp.array([1]))
    with pytest.raises(TypeError, match="activation"):
        tokamax.ragged_dot(lhs, rhs, GROUP_SIZES[0], activation="gelu")


def test_functions_in_implementation_take_the_call_as_given():
    lhs, rhs = random_normal(10, (M, K)), random_normal(11, (3, K, N))
    calls = []

    def declines(*args, **keywords):
        calls.append(keywords)
        raise NotImplementedError("not this one")

    check(lambda a, b, g: tokamax.ragged_dot(
        a, b, g, HIGHEST, activation=jax.nn.sigmoid,
        implementation=[declines, jax.lax.ragged_dot, "xla"]),
        lambda a, b, g: reference(a, b, g, jax.nn.sigmoid), lhs, rhs, (M, N))
    # Accumulating in float32 for the activation: the output dtype is asked for.
    assert calls[0] == {"precision": HIGHEST, "preferred_element_type": jnp.float32}

    seen = []

    def general(lhs, rhs, group_sizes, numbers, **keywords):
        seen.append(numbers)
        return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, numbers, **keywords)

    lhs2 = random_normal(12, (M, N))
    out = tokamax.ragged_dot_general(lhs, lhs2, GROUP_SIZES[1], RAGGED_CONTRACTING, HIGHEST,
                                     implementation=[general])
    assert seen == [RAGGED_CONTRACTING]
    assert_close(out, reference_ragged_contracting(lhs, lhs2, GROUP_SIZES[1]))


def test_generate_group_sizes_spreads_m_rows_over_the_groups():
    sizes = tokamax.generate_ragged_dot_group_sizes(m=1000, num_groups=4, seed=3)
    assert len(sizes) == 4 and sum(sizes) == 1000 and all(150 < s < 350 for s in sizes)
    assert sizes == tokamax.generate_ragged_dot_group_sizes(m=1000, num_groups=4, seed=3)
    skewed = tokamax.generate_ragged_dot_group_sizes(m=1000, num_groups=4,
                                                     p=[0.8, 0.2, 0.0, 0.0])
    assert skewed[0] > 700 and skewed[1] > 100 and skewed[2:] == (0, 0)
    with pytest.raises(ValueError, match="entries"):
        tokamax.generate_ragged_dot_group_sizes(m=10, num_groups=3, p=[0.5, 0.5])


def test_ragged_dot_group_sizes_carry_their_value_and_a_representative():
    lhs, rhs = random_normal(13, (M, K)), random_normal(14, (3, K, N))

    def wrapped(a, b, g):
        return jax.jit(lambda a, b, gs: tokamax.ragged_dot(a, b, gs, HIGHEST))(
            a, b, tokamax.RaggedDotGroupSizes(g, (2, 5, 3)))

    check(wrapped, reference, lhs, rhs, (M, N))
    abstract = tokamax.RaggedDotGroupSizes(jax.ShapeDtypeStruct((3,), jnp.int32), (2, 5, 3))
    assert abstract.value.tolist() == [2, 5, 3] and abstract.value.dtype == jnp.int32
    spread = tokamax.RaggedDotGroupSizes(jax.ShapeDtypeStruct((3,), jnp.int32), 9)
    assert spread.value.sum() == 9 and spread.representative_value == tuple(spread.value)
    with pytest.raises(ValueError, match="integers"):
        tokamax.RaggedDotGroupSizes(jnp.ones(3), 3)
    with pytest.raises(ValueError, match="representative"):
        tokamax.RaggedDotGroupSizes(GROUP_SIZES[0], (1, 2))


def gateup_reference(name):
    """Upstream's `act(out[:, :n // 2]) * out[:, n // 2:]`; its "gelu" is `jax.nn.gelu`'s
    default, the tanh approximation."""
    act = {"silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, approximate=True),
           "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}[name]

    def ref(lhs, rhs, group_sizes):
        out = reference(lhs, rhs, group_sizes)
        return act(out[:, :N // 2]) * out[:, N // 2:]
    return ref


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_tanh"])
def test_fuse_gateup_activation_gates_the_first_half_of_n(name):
    lhs, rhs = random_normal(20, (M, K)), random_normal(21, (3, K, N))
    check(lambda a, b, g: tokamax.ragged_dot(a, b, g, HIGHEST, fuse_gateup_activation=name),
          gateup_reference(name), lhs, rhs, (M, N // 2))


def test_fuse_gateup_activation_in_general_and_kernels_and_before_activation():
    lhs, rhs = random_normal(22, (M, K), jnp.bfloat16), random_normal(23, (3, K, N), jnp.bfloat16)
    triton = tokamax.PallasTritonRaggedDot(interpret=True, config=TritonConfig(
        block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2))
    check(lambda a, b, g: tokamax.ragged_dot_general(
        a, jnp.swapaxes(b, 1, 2), g, TRANSPOSED_RHS_DIMENSION_NUMBERS, HIGHEST,
        activation=jnp.tanh, fuse_gateup_activation="silu", implementation=[triton]),
        lambda a, b, g: jnp.tanh(gateup_reference("silu")(a, b, g)), lhs, rhs, (M, N // 2),
        jnp.bfloat16, batch=per_entry)


def test_fuse_gateup_activation_names_and_widths():
    lhs, rhs = random_normal(24, (M, K)), random_normal(25, (3, K, N))
    with pytest.raises(NotImplementedError, match="swigluoai"):
        tokamax.ragged_dot(lhs, rhs, GROUP_SIZES[0], fuse_gateup_activation="swigluoai")
    with pytest.raises(ValueError, match="odd"):
        tokamax.ragged_dot(lhs, rhs[..., :N - 1], GROUP_SIZES[0], fuse_gateup_activation="silu")


def test_zero_initialize_and_positional_manual_axis_type_change_nothing():
    lhs, rhs = random_normal(26, (M, K)), random_normal(27, (3, K, N))
    expected = tokamax.ragged_dot(lhs, rhs, GROUP_SIZES[0], HIGHEST)
    for zero_initialize in (False, True):
        out = tokamax.ragged_dot(lhs, rhs, GROUP_SIZES[0], HIGHEST, None, None, None,
                                 jax.typeof(lhs).manual_axis_type,
                                 zero_initialize=zero_initialize)
        assert_close(out, expected)
    with pytest.raises(TypeError, match="zero_initialize"):
        tokamax.ragged_dot(lhs, rhs, GROUP_SIZES[0], zero_initialize=1)
    with pytest.raises(TypeError, match="manual_axis_type"):
        tokamax.ragged_dot_general(lhs, rhs, GROUP_SIZES[0], TRANSPOSED_RHS_DIMENSION_NUMBERS,
                                   None, None, None, None, "x")


def test_mosaic_tpu_v2_is_the_mosaic_tpu_kernel_and_moves_on_off_tpu():
    lhs, rhs = random_normal(28, (M, K)), random_normal(29, (3, K, N))
    family = tokamax.ragged_dot.__globals__["FAMILY"]
    ops, _ = family.resolve("mosaic_tpu_v2")
    assert [type(op) for op in ops] == [tokamax.PallasMosaicTpuRaggedDot]
    with pytest.raises(NotImplementedError, match="tpu"):
        tokamax.ragged_dot(lhs, rhs, GROUP_SIZES[0], implementation="mosaic_tpu_v2")
    out = tokamax.ragged_dot(lhs, rhs, GROUP_SIZES[0], HIGHEST,
                             implementation=("mosaic_tpu_v2", "xla"))
    assert_close(out, reference(lhs, rhs, GROUP_SIZES[0]))
