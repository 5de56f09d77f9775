"""The tiled XLA ragged dot: forward and gradients against a float32 HIGHEST reference,
under jit with traced sizes and under vmap, and the static rule that picks it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass
from conftest import assert_close, random_normal
from tokamax_kernels.ragged_dot import ragged_dot
from tokamax_kernels.ragged_dot.base import xla_ragged_dot
from tokamax_kernels.ragged_dot.xla_tiled import DEFAULT_RULE, Problem, TilingRule, row_tiles
from tokamax_pass.core import targeting

HIGHEST = jax.lax.Precision.HIGHEST
M, K, N = 45, 12, 10
# Sizes summing to M or less (rows past the sum give zeros); tiles of 8 rows cut groups of
# 1, 8, 9 and 17 rows at every kind of boundary.
GROUP_SIZES = {
    "even": [9, 9, 9, 9, 9],
    "skewed": [1, 0, 30, 2, 12],
    "empty_and_past_sum": [0, 8, 0, 17, 0],
}
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def reference(variant, lhs, rhs, sizes):
    """Per-group float32 matmuls at HIGHEST precision, from concrete sizes."""
    lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    ends = np.cumsum(sizes)
    starts = ends - np.asarray(sizes)
    if variant == "drhs":
        return jnp.stack([jnp.matmul(lhs[s:e].T, rhs[s:e], precision=HIGHEST)
                          for s, e in zip(starts, ends, strict=True)])
    out = jnp.zeros((lhs.shape[0], rhs.shape[1] if variant == "dlhs" else rhs.shape[2]))
    for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
        w = rhs[g].T if variant == "dlhs" else rhs[g]
        out = out.at[s:e].set(jnp.matmul(lhs[s:e], w, precision=HIGHEST))
    return out


def operands(variant, groups, dtype, seed=0, lead=()):
    shapes = {"forward": ((M, K), (groups, K, N)), "dlhs": ((M, N), (groups, K, N)),
              "drhs": ((M, K), (M, N))}[variant]
    return (random_normal(seed, (*lead, *shapes[0]), dtype),
            random_normal(seed + 1, (*lead, *shapes[1]), dtype))


# Small tiles and steps, so the test shapes cross many tile boundaries and scan steps (the
# last one padded with empty tiles).
SMALL_TILES = TilingRule(tile_m=8, rows_per_step=24)


def tiled(variant):
    return xla_ragged_dot(variant, HIGHEST, None, "tiled", SMALL_TILES)


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", list(GROUP_SIZES))
@pytest.mark.parametrize("variant", ["forward", "dlhs", "drhs"])
def test_tiled_matches_reference_forward_and_gradients(variant, case, dtype):
    sizes = GROUP_SIZES[case]
    lhs, rhs = operands(variant, len(sizes), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    fn = jax.jit(tiled(variant))  # sizes traced
    out, vjp = jax.vjp(lambda a, b: fn(a, b, group_sizes), lhs, rhs)
    assert out.dtype == dtype
    assert_close(out, reference(variant, lhs, rhs, sizes), scale_rtol=TOLERANCE[dtype])
    cotangent = random_normal(7, out.shape, dtype)
    got = vjp(cotangent)
    want = jax.vjp(lambda a, b: reference(variant, a, b, sizes),
                   lhs.astype(jnp.float32), rhs.astype(jnp.float32))[1](
        cotangent.astype(jnp.float32))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        assert_close(g, w, scale_rtol=TOLERANCE[dtype])


def test_tiled_under_vmap_with_per_entry_sizes():
    batch_sizes = [GROUP_SIZES["skewed"], GROUP_SIZES["empty_and_past_sum"]]
    lhs, rhs = operands("forward", 5, jnp.float32, seed=3, lead=(2,))
    sizes = jnp.asarray(batch_sizes, jnp.int32)
    fn = jax.jit(jax.vmap(tiled("forward")))
    out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
    cotangent = random_normal(9, out.shape)
    dlhs, drhs = vjp(cotangent)
    for i, entry in enumerate(batch_sizes):
        assert_close(out[i], reference("forward", lhs[i], rhs[i], entry), scale_rtol=1e-5)
        want = jax.vjp(lambda a, b, e=entry: reference("forward", a, b, e), lhs[i], rhs[i])[1](
            cotangent[i])
        assert_close(dlhs[i], want[0], scale_rtol=1e-5)
        assert_close(drhs[i], want[1], scale_rtol=1e-5)


def test_tiled_sizes_past_m_end_groups_at_m_like_lax():
    lhs, rhs = operands("forward", 3, jnp.float32, seed=5)
    sizes = jnp.asarray([20, 30, 10], jnp.int32)  # sums past M: traced, not checked
    got = jax.jit(tiled("forward"))(lhs, rhs, sizes)
    want = jax.jit(xla_ragged_dot("forward", HIGHEST, None, "lax"))(lhs, rhs, sizes)
    assert_close(got, want, scale_rtol=1e-5)


def test_tiled_honours_preferred_element_type():
    lhs, rhs = operands("forward", 5, jnp.bfloat16, seed=11)
    sizes = jnp.asarray(GROUP_SIZES["skewed"], jnp.int32)
    got = xla_ragged_dot("forward", HIGHEST, jnp.float32, "tiled", SMALL_TILES)(lhs, rhs, sizes)
    assert got.dtype == jnp.float32
    assert_close(got, reference("forward", lhs, rhs, GROUP_SIZES["skewed"]), scale_rtol=1e-5)


@pytest.mark.parametrize("case", list(GROUP_SIZES))
@pytest.mark.parametrize("tile", [1, 8, 16])
def test_row_tiles_cover_each_row_once_in_its_group(case, tile):
    sizes = np.asarray(GROUP_SIZES[case])
    group, first, rows = (np.asarray(x) for x in row_tiles(jnp.asarray(sizes), M, tile))
    assert len(group) == -(-M // tile) + len(sizes)
    owner = np.full(M, -1)
    for g, f, r in zip(group, first, rows, strict=True):
        assert 0 <= r <= tile
        assert (owner[f:f + r] == -1).all()
        owner[f:f + r] = g
    want = np.full(M, -1)
    want[:sizes.sum()] = np.repeat(np.arange(len(sizes)), sizes)
    np.testing.assert_array_equal(owner, want)


def test_rule_predicts_lax_for_few_groups_and_tiles_many():
    def problem(m, groups, k, n):
        return Problem(m=m, groups=groups, k=k, n=n, itemsize=2)

    decode, fine = problem(1536, 64, 2048, 1408), problem(24576, 64, 2048, 1408)
    assert DEFAULT_RULE.prefers_tiled(decode) and DEFAULT_RULE.tile_rows(decode) == 128
    assert DEFAULT_RULE.prefers_tiled(fine) and DEFAULT_RULE.tile_rows(fine) == 512
    # lax's dense work per group: about G times the rows' work.
    assert DEFAULT_RULE.lax_seconds(fine) > 10 * DEFAULT_RULE.tiled_seconds(fine, 512)
    assert not DEFAULT_RULE.prefers_tiled(problem(16384, 1, 4096, 4096))  # one matmul
    assert not DEFAULT_RULE.prefers_tiled(problem(512, 8, 4096, 14336))  # weights dominate
    assert not DEFAULT_RULE.prefers_tiled(problem(0, 8, 16, 16))
    assert TilingRule(tile_m=64).tile_rows(decode) == 64
    assert DEFAULT_RULE.tile_rows(problem(40, 8, 2048, 2048)) <= 64  # no tile past M


def _export(fn, *args, platform):
    exported = jax.export.export(jax.jit(fn), platforms=[platform],
                                 disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(*args)
    return exported.mlir_module()


@pytest.mark.parametrize(("platform", "groups", "want_tiled"), [
    ("cuda", 64, True), ("cpu", 64, True), ("cpu", 2, False), ("cuda", 2, False),
    ("tpu", 64, False),
])
def test_auto_path_by_platform_and_shape(platform, groups, want_tiled):
    specs = (jax.ShapeDtypeStruct((1536, 64), jnp.bfloat16),
             jax.ShapeDtypeStruct((groups, 64, 32), jnp.bfloat16),
             jax.ShapeDtypeStruct((groups,), jnp.int32))

    def fn(a, b, s):
        return ragged_dot(a, b, s, implementation="xla")

    kind = {"cuda": "NVIDIA H200", "cpu": "cpu", "tpu": "TPU v5p"}[platform]
    with targeting(kind):
        text = _export(fn, *specs, platform=platform)
    assert ("stablehlo.while" in text) == want_tiled  # the tiled form's scan over tiles


def one_hot_reference(lhs, rhs, sizes):
    """The forward as every group's float32 HIGHEST product, each row keeping its own
    group's (rows past the sizes none): one program for many small groups, where the
    per-group slices of `reference` would dispatch a matmul per group."""
    groups = len(sizes)
    owner = np.repeat(np.arange(groups + 1), [*sizes, lhs.shape[0] - sum(sizes)])
    one_hot = jnp.asarray(owner[:, None] == np.arange(groups), jnp.float32)
    every = jnp.einsum("mk,gkn->mgn", lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                       precision=HIGHEST)
    return jnp.einsum("mgn,mg->mn", every, one_hot, precision=HIGHEST)


def test_op_on_cpu_runs_tiled_under_vmap_with_gradients():
    """`ragged_dot(implementation="xla")` at 64 groups of about 24 rows picks the tiled form
    on CPU by itself; batched (per-entry traced sizes) and differentiated, it matches the
    per-group reference."""
    m, k, n, groups = 1536, 64, 32, 64
    weights = np.linspace(1, 3, groups)
    skewed = np.random.default_rng(0).multinomial(m - 100, weights / weights.sum())
    skewed[[3, 40]] = 0  # empty groups, and 100 rows past the sum
    batch_sizes = [skewed.tolist(), [m // groups] * groups]
    lhs, rhs = random_normal(20, (2, m, k)), random_normal(21, (2, groups, k, n))
    sizes = jnp.asarray(batch_sizes, jnp.int32)
    folded = Problem(m=2 * m, groups=2 * (groups + 1), k=k, n=n, itemsize=4)
    assert DEFAULT_RULE.prefers_tiled(folded)

    def fn(a, b, s):
        return ragged_dot(a, b, s, precision=HIGHEST, implementation="xla")

    text = _export(jax.vmap(fn), lhs, rhs, sizes, platform="cpu")
    assert "stablehlo.while" in text
    out, vjp = jax.vjp(lambda a, b: jax.jit(jax.vmap(fn))(a, b, sizes), lhs, rhs)
    cotangent = random_normal(22, out.shape)
    dlhs, drhs = vjp(cotangent)
    for i, entry in enumerate(batch_sizes):
        want_out, want_vjp = jax.vjp(
            jax.jit(lambda a, b, e=entry: one_hot_reference(a, b, e)), lhs[i], rhs[i])
        assert_close(out[i], want_out, scale_rtol=1e-5)
        want_dlhs, want_drhs = want_vjp(cotangent[i])
        assert_close(dlhs[i], want_dlhs, scale_rtol=1e-5)
        assert_close(drhs[i], want_drhs, scale_rtol=1e-5)


def test_an_empty_output_axis_gives_an_empty_product_and_zero_gradients():
    """rhs with no columns (N = 0): the product is (M, 0) and the lhs gradient zeros, as
    `jax.lax.ragged_dot` gives; the row tiles' products are flattened to rows without
    inferring a length from an empty array (a ZeroDivisionError)."""
    lhs, rhs = random_normal(0, (9, 12)), jnp.zeros((3, 12, 0))
    sizes = jnp.asarray([4, 0, 3], jnp.int32)

    def grads(impl):
        return jax.grad(lambda lhs, rhs: impl(lhs, rhs, sizes).sum(), argnums=(0, 1))(lhs, rhs)

    tiled = lambda lhs, rhs, sizes: ragged_dot(lhs, rhs, sizes, implementation="xla")
    assert tiled(lhs, rhs, sizes).shape == (9, 0)
    for got, want in zip(grads(tiled), grads(jax.lax.ragged_dot), strict=True):
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
