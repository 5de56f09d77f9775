"""PallasMosaicTpuRaggedDot on CPU beyond the base suite (`test_ragged_dot_suite.py`): the
kernels in the Pallas TPU interpreter (every variant, entries and nested vmap) against the
float32 reference, and every variant lowered for a TPU (`tpu_custom_call`) by `jax.export` from this
CPU machine, vmapped too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from conftest import assert_close, measured, random_normal, reference_precision
from tokamax_kernels.ragged_dot import api as ragged_api
from tokamax_kernels.ragged_dot._mosaic_tpu_kernels import (
    group_tiles,
    ragged_dot_drhs,
    ragged_dot_rows,
    row_tiles,
)
from tokamax_kernels.ragged_dot.base import RaggedDot
from tokamax_kernels.ragged_dot.pallas_mosaic_tpu import Config, PallasMosaicTpuRaggedDot
from tokamax_pass import core

# 44 rows in 16-row blocks: the last block is partial; N = 192 gives a partial column tile.
M, K, N = 44, 256, 192
# Uneven, an empty group, a group inside one block, and rows past the sum (zeros).
SIZES = np.array([5, 0, 20, 3], np.int32)
G = len(SIZES)
SHAPES = {"forward": ((M, K), (G, K, N)), "dlhs": ((M, N), (G, K, N)), "drhs": ((M, K), (M, N))}
# forward walks K in two 128-deep steps; dlhs contracts N = 192 in one (the whole axis).
CONFIGS = {"forward": Config(block_m=16, block_k=128, block_n=128),
           "dlhs": Config(block_m=16, block_k=256, block_n=128),
           "drhs": Config(block_m=16, block_k=128, block_n=128)}


def _operands(variant: str, dtype=jnp.float32):
    lhs_shape, rhs_shape = SHAPES[variant]
    return random_normal(0, lhs_shape, dtype), random_normal(1, rhs_shape, dtype)


def _reference(lhs, rhs, variant):
    with reference_precision():
        return RaggedDot()(lhs.astype(jnp.float32), rhs.astype(jnp.float32), SIZES,
                           variant=variant)


def test_work_lists_cover_every_row_once():
    rows = np.asarray(row_tiles(jnp.asarray(SIZES), M, 16))
    owner = np.full(M, -1)
    for group, block, lo, hi in rows.T:
        for r in range(block * 16 + lo, block * 16 + hi):
            assert owner[r] == -1
            owner[r] = group
    tail = np.full(M - SIZES.sum(), G)
    np.testing.assert_array_equal(owner, np.concatenate([np.repeat(np.arange(G), SIZES), tail]))
    groups = np.asarray(group_tiles(jnp.asarray(SIZES), M, 16))
    # Every group (the empty one too) owns a consecutive run, marked first and last.
    for g in range(G):
        mine = np.flatnonzero(groups[0] == g)
        assert len(mine) and np.all(np.diff(mine) == 1)
        assert groups[4, mine[0]] == 1 and groups[5, mine[-1]] == 1
        assert groups[4, mine[1:]].sum() == 0 and groups[5, mine[:-1]].sum() == 0


@pytest.mark.parametrize("variant", ["forward", "dlhs", "drhs"])
def test_kernels_in_the_tpu_interpreter(variant):
    """The kernels alone under `pltpu.InterpretParams`, which models TPU block pipelining
    (an output block is written back when its index changes; unwritten VMEM is NaN)."""
    lhs, rhs = _operands(variant)
    config = CONFIGS[variant]
    blocks = dict(block_m=config.block_m, block_k=min(config.block_k, lhs.shape[1]),
                  block_n=config.block_n, out_dtype=jnp.float32,
                  interpret=pltpu.InterpretParams())
    sizes = jnp.asarray(SIZES)
    if variant == "drhs":
        got = ragged_dot_drhs(lhs, rhs, sizes, **blocks)
    else:
        got = ragged_dot_rows(lhs, rhs, sizes, transpose_rhs=variant == "dlhs", **blocks)
    assert_close(got, _reference(lhs, rhs, variant))


@pytest.mark.parametrize("variant", ["forward", "dlhs", "drhs"])
def test_variants_match_reference(variant):
    lhs, rhs = _operands(variant)
    got = PallasMosaicTpuRaggedDot(interpret=True, config=CONFIGS[variant])(
        lhs, rhs, SIZES, variant=variant)
    assert_close(got, _reference(lhs, rhs, variant))
    if variant == "drhs":
        np.testing.assert_array_equal(np.asarray(got[1]), 0.0)  # the empty group
    else:
        np.testing.assert_array_equal(np.asarray(got[SIZES.sum():]), 0.0)  # rows past the sum


def test_unsupported_inputs_and_bad_configs():
    op = PallasMosaicTpuRaggedDot(interpret=True)
    lhs, rhs = _operands("forward")
    with pytest.raises(NotImplementedError, match="one dtype"):
        op(lhs, rhs.astype(jnp.bfloat16), SIZES)
    with pytest.raises(NotImplementedError, match="multiple of block_k"):
        PallasMosaicTpuRaggedDot(interpret=True, config=Config(16, 128, 128))(
            *_operands("dlhs"), SIZES, variant="dlhs")  # 128 does not divide N = 192
    with pytest.raises(ValueError, match="block_m must be a positive multiple of 16"):
        Config(block_m=24, block_k=128, block_n=128)
    with pytest.raises(ValueError, match="block_n must be a positive multiple of 128"):
        Config(block_m=16, block_k=128, block_n=64)


def test_heuristics_follow_the_tpu_generation():
    ba = PallasMosaicTpuRaggedDot().bind(jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16),
                                         jax.ShapeDtypeStruct((8, 4096, 4096), jnp.bfloat16),
                                         jax.ShapeDtypeStruct((8,), jnp.int32))
    with core.targeting("TPU v6 lite", "tpu"):
        v6 = ba.heuristics_config
        assert len(ba.autotuning_configs) > 10
    with core.targeting("TPU v5 lite", "tpu"):
        v5 = ba.heuristics_config
    assert (v6.block_n, v5.block_n) == (512, 256)  # two MXUs wide: 256 on v6e, 128 on v5e
    assert v6.block_k == 512


def test_not_on_cpu_without_interpret():
    lhs, rhs = _operands("forward")
    with pytest.raises(NotImplementedError, match="tpu"):
        PallasMosaicTpuRaggedDot()(lhs, rhs, SIZES)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_tpu_forward_and_gradients(dtype):
    def f(lhs, rhs, sizes):
        def loss(lhs, rhs):
            out = ragged_api.ragged_dot(lhs, rhs, sizes, implementation="mosaic_tpu")
            return out.astype(jnp.float32).sum()
        return jax.value_and_grad(loss, argnums=(0, 1))(lhs, rhs)

    args = (jax.ShapeDtypeStruct((1000, 512), dtype),
            jax.ShapeDtypeStruct((8, 512, 384), dtype),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    with core.targeting("TPU v6 lite", "tpu"):
        text = jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
    assert text.count("tpu_custom_call") == 3  # forward, dlhs, drhs
    assert "PallasMosaicTpuRaggedDot" in text
    for variant in ("forward", "dlhs", "drhs"):
        assert f"variant\\22:\\22{variant}" in text.replace(" ", "")


TPU_ARGS = (jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((4,), jnp.int32))


def _export_for_tpu(implementation):
    def f(lhs, rhs, sizes):
        return ragged_api.ragged_dot(lhs, rhs, sizes, implementation=implementation)

    with core.targeting("TPU v5p"):
        return jax.export.export(jax.jit(f), platforms=["tpu"])(*TPU_ARGS).mlir_module()


def test_mosaic_names_the_platforms_kernel_and_gpu_kernels_refuse_a_tpu():
    assert "tpu_custom_call" in _export_for_tpu("mosaic")  # the GPU kernel steps aside
    assert "tpu_custom_call" in _export_for_tpu("mosaic_tpu")
    for name in ("triton", "mosaic_gpu"):
        with pytest.raises(NotImplementedError, match=r"\['cuda'\], not on tpu"):
            _export_for_tpu(name)
    with pytest.raises(ValueError, match="mosaic_tpu"):
        _export_for_tpu("mosaic_tpuu")


def test_none_runs_the_tpu_kernel_only_where_measured_faster():
    assert "tpu_custom_call" not in _export_for_tpu(None)
    faster = measured("TPU v5p", {PallasMosaicTpuRaggedDot(): 1.0, RaggedDot(): 3.0}, *TPU_ARGS)
    with faster:
        assert "tpu_custom_call" in _export_for_tpu(None)
    slower = measured("TPU v5p", {PallasMosaicTpuRaggedDot(): 3.0, RaggedDot(): 1.0}, *TPU_ARGS)
    with slower:
        assert "tpu_custom_call" not in _export_for_tpu(None)
    other_tpu = measured("TPU v6 lite", {PallasMosaicTpuRaggedDot(): 1.0, RaggedDot(): 3.0},
                         *TPU_ARGS)
    with other_tpu:  # a measurement on another generation is no evidence for this one
        assert "tpu_custom_call" not in _export_for_tpu(None)


def test_seed_snippet_binds_on_cpu():
    import tokamax_pass as tokamax

    x, w = _operands("forward", jnp.bfloat16)
    ba = tokamax.PallasMosaicTpuRaggedDot.bind(x, w, jnp.asarray(SIZES))
    assert isinstance(ba.op, PallasMosaicTpuRaggedDot) and ba.arguments["variant"] == "forward"


def test_autotune_without_a_tpu_says_timing_needs_the_device():
    import tokamax_pass as tokamax

    ba = tokamax.PallasMosaicTpuRaggedDot.bind(*_operands("forward"), jnp.asarray(SIZES))
    with pytest.raises(RuntimeError, match=r"runs on \['tpu'\], not on cpu.*Timing needs"):
        tokamax.autotune([ba], progress=False)


def test_work_lists_of_entries_cover_every_row_once():
    """(E, G) sizes: entry e's rows from e * M, its tail rows with no matrix (R * G), and
    its groups reading matrix (e % R) * G + g."""
    sizes = np.array([[5, 0, 20, 3], [0, 44, 9, 0], [1, 2, 3, 4]], np.int32)
    e = len(sizes)
    for rhs_entries in (1, e):
        owner = np.full(e * M, -1)
        for matrix, block, lo, hi in np.asarray(row_tiles(sizes, M, 16, rhs_entries)).T:
            for r in range(block * 16 + lo, block * 16 + hi):
                assert owner[r] == -1
                owner[r] = matrix
        for i, entry in enumerate(sizes):
            clipped = np.minimum(np.cumsum(entry), M)
            counts = np.diff(np.concatenate([[0], clipped, [M]]))
            matrices = np.append((i % rhs_entries) * G + np.arange(G), rhs_entries * G)
            np.testing.assert_array_equal(owner[i * M:(i + 1) * M], np.repeat(matrices, counts))
    groups = np.asarray(group_tiles(sizes, M, 16))
    for g in range(e * G):  # every group of every entry owns a consecutive run
        mine = np.flatnonzero(groups[0] == g)
        assert len(mine) and np.all(np.diff(mine) == 1)
        rows = [r for _, block, lo, hi, *_ in groups[:, mine].T
                for r in range(block * 16 + lo, block * 16 + hi)]
        i, j = divmod(g, G)
        start = i * M + min(sizes[i, :j].sum(), M)
        assert rows == list(range(start, i * M + min(sizes[i, :j + 1].sum(), M)))


@pytest.mark.parametrize("variant", ["forward", "dlhs", "drhs"])
def test_kernels_over_entries_in_the_tpu_interpreter(variant):
    """Two entries of M rows in one launch (row blocks straddle the entries; the forward
    shares one rhs, dlhs reads one per entry) against each entry alone."""
    lhs, rhs = _operands(variant)
    lhs2 = random_normal(9, lhs.shape)
    sizes = jnp.asarray(np.stack([SIZES, [0, 30, 14, 0]]))
    config = CONFIGS[variant]
    blocks = dict(block_m=config.block_m, block_k=min(config.block_k, lhs.shape[1]),
                  block_n=config.block_n, out_dtype=jnp.float32,
                  interpret=pltpu.InterpretParams())
    rhs2 = rhs if variant == "forward" else random_normal(10, rhs.shape)
    if variant == "drhs":
        got = ragged_dot_drhs(jnp.concatenate([lhs, lhs2]), jnp.concatenate([rhs, rhs2]),
                              sizes, **blocks).reshape(2, G, K, N)
    else:
        both = rhs if variant == "forward" else jnp.concatenate([rhs, rhs2])
        got = ragged_dot_rows(jnp.concatenate([lhs, lhs2]), both, sizes,
                              transpose_rhs=variant == "dlhs", **blocks).reshape(2, M, -1)
    with reference_precision():
        for i, (x, w) in enumerate(((lhs, rhs), (lhs2, rhs2))):
            want = RaggedDot()(x, w, sizes[i], variant=variant)
            assert_close(got[i], want)


# Nested vmap (an outer level of 2 around an inner one of 3): "shared_rhs" maps rhs only
# at the inner level and the group sizes only there (the outer one reads both in place
# or broadcast); "shared_inner" maps rhs only at the outer level (broadcast to entries).
VMAPS = {"shared_rhs": ((0, 0, 0), (0, None, None)), "shared_inner": ((0, None, 0), (0, 0, 0))}


def _lead(*axes: int | None) -> tuple[int, ...]:
    """The leading (outer 2, inner 3) axes of an operand the two levels map as `axes`."""
    return tuple(n for n, a in zip((2, 3), axes, strict=True) if a == 0)


@pytest.mark.parametrize("name", VMAPS)
def test_nested_vmap_forward_and_gradients_match_reference(name):
    inner, outer = VMAPS[name]
    lhs = random_normal(20, (2, 3, M, K))
    rhs = random_normal(21, (*_lead(outer[1], inner[1]), G, K, N))
    sizes = jax.random.randint(jax.random.key(22), (*_lead(outer[2], inner[2]), G), 0, 16)
    ct = random_normal(23, (2, 3, M, N))

    def loss(impl, lhs, rhs):
        one = jax.vmap(lambda x, w, s: ragged_api.ragged_dot(x, w, s, implementation=impl),
                       in_axes=inner)
        out = jax.vmap(one, in_axes=outer)(lhs, rhs, sizes)
        return (out * ct).sum(), out

    op = PallasMosaicTpuRaggedDot(interpret=True, config=CONFIGS["forward"])
    grad = jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)
    (_, got), got_grads = grad(op, lhs, rhs)
    with reference_precision():
        (_, want), want_grads = grad("xla", lhs, rhs)
    assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert_close(g, w)


def _export_vmapped(implementation, vmapped=True):
    def f(lhs, rhs, sizes):
        def loss(lhs, rhs):
            def one(x, s):
                return ragged_api.ragged_dot(x, rhs, s, implementation=implementation)
            out = jax.vmap(jax.vmap(one))(lhs, sizes) if vmapped else one(lhs, sizes)
            return out.astype(jnp.float32).sum()
        return jax.value_and_grad(loss, argnums=(0, 1))(lhs, rhs)

    lead = (2, 3) if vmapped else ()
    args = (jax.ShapeDtypeStruct((*lead, 256, 256), jnp.bfloat16), TPU_ARGS[1],
            jax.ShapeDtypeStruct((*lead, 4), jnp.int32))
    with core.targeting("TPU v5p", "tpu"):
        return jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()


def test_nested_vmap_lowers_for_tpu_as_one_launch_per_kernel():
    text = _export_vmapped("mosaic_tpu")
    assert text.count("tpu_custom_call") == 3  # forward, dlhs, drhs
    # As many loops as without vmap (the work lists' searches): no loop of launches.
    assert text.count("stablehlo.while") == _export_vmapped("mosaic_tpu", False).count(
        "stablehlo.while")


def test_none_keeps_the_tpu_kernel_under_vmap_where_measured_faster():
    assert "tpu_custom_call" not in _export_vmapped(None)
    # Leaves in tree order: group_sizes, lhs, rhs; the outer level first.
    level = core.bound_arguments.VmapLevel
    vmap = (level((0, 0, None), 2), level((0, 0, None), 3))
    times = {PallasMosaicTpuRaggedDot(): 1.0, RaggedDot(): 3.0}
    with measured("TPU v5p", times, *TPU_ARGS, vmap=vmap):
        assert _export_vmapped(None).count("tpu_custom_call") == 1  # the forward measured
