"""PallasMosaicGpuRaggedDot on CPU: every variant lowers for an H200 (the `mosaic_gpu_v2`
custom call with its JSON spec), also under `jax.grad`; unsupported inputs and devices
raise `NotImplementedError` so `implementation=None` falls back; configs and heuristics.
Numerics run on the GPU (`tests/gpu/test_mosaic_ragged_dot_gpu.py`)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import tokamax_pass
from _mosaic_gpu_interpret import interpret_mode
from conftest import H200, assert_close, measured, random_normal, reference_precision
from tokamax_kernels.ragged_dot import PallasMosaicGpuRaggedDot, RaggedDot, ragged_dot
from tokamax_kernels.ragged_dot import _mosaic_gpu_rows_kernel as rows_kernel
from tokamax_kernels.ragged_dot import api as ragged_api
from tokamax_kernels.ragged_dot._mosaic_gpu_common import SMEM_BUDGET_BYTES
from tokamax_kernels.ragged_dot.pallas_mosaic_gpu import Config

SIZES = (100, 0, 37, 119)  # uneven, one empty group, rows 256..: past the last group
M, K, N = 296, 128, 256
BENCH = dict(m=16384, k=4096, n=4096, g=8)


def _target(kind: str = H200):
    """A GPU to lower for. Auto axes: the family's reference (`ragged_dot_general`, used for
    output shapes) has no sharding rule under the Explicit axes of `core.targeting`."""
    return jax.sharding.use_abstract_mesh(AbstractMesh(
        (1,), ("_target",), axis_types=(AxisType.Auto,),
        abstract_device=AbstractDevice(kind, None, "cuda")))


G = len(SIZES)


def _shapes(variant, m=M, k=K, n=N, g=G, dtype=jnp.bfloat16):
    lhs, rhs = {"forward": ((m, k), (g, k, n)), "dlhs": ((m, n), (g, k, n)),
                "drhs": ((m, k), (m, n))}[variant]
    return (jax.ShapeDtypeStruct(lhs, dtype), jax.ShapeDtypeStruct(rhs, dtype),
            jax.ShapeDtypeStruct((g,), jnp.int32))


def _export_text(fn, *args) -> str:
    with _target():
        exported = jax.export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(*args)
    return exported.mlir_module()


def _specs(text: str) -> list[str]:
    """The JSON specs stamped on the custom calls (MLIR escapes quotes as \\22)."""
    found = re.findall(r'tokamax_pass_spec = "((?:[^"\\]|\\.)*)"', text)
    return [s.replace("\\22", '"') for s in found]


@pytest.mark.exhaustive
@pytest.mark.parametrize("variant", ["forward", "dlhs", "drhs"])
@pytest.mark.parametrize("shape", ["small", "bench"])
def test_variant_lowers_to_mosaic_gpu_with_spec(variant, shape):
    sizes = dict(m=M, k=K, n=N, g=G) if shape == "small" else BENCH
    op = PallasMosaicGpuRaggedDot()
    text = _export_text(lambda a, b, s: op(a, b, s, variant=variant), *_shapes(variant, **sizes))
    assert text.count("mosaic_gpu_v2") == 1
    specs = _specs(text)
    assert len(specs) == 1
    assert "PallasMosaicGpuRaggedDot" in specs[0] and f'"variant":"{variant}"' in specs[0]


def test_gradient_lowers_dlhs_and_drhs_kernels():
    def loss(x, w, s):
        return ragged_dot(x, w, s, implementation="mosaic").astype(jnp.float32).sum()

    text = _export_text(jax.value_and_grad(loss, argnums=(0, 1)), *_shapes("forward"))
    assert text.count("mosaic_gpu_v2") == 3  # forward, dlhs, drhs
    specs = _specs(text)
    assert all("PallasMosaicGpuRaggedDot" in s for s in specs)
    for variant in ("forward", "dlhs", "drhs"):
        assert any(f'"variant":"{variant}"' in s for s in specs), variant


def test_none_prefers_mosaic_on_hopper_where_measured_faster():
    assert ragged_api.FAMILY.automatic[0] == "mosaic_gpu"
    f = lambda a, b, s: ragged_dot(a, b, s)
    assert "mosaic_gpu_v2" not in _export_text(f, *_shapes("forward"))  # unmeasured
    with _target():
        evidence = measured(H200, {PallasMosaicGpuRaggedDot(): 1.0, RaggedDot(): 4.0},
                            *_shapes("forward"))
    with evidence:
        assert "mosaic_gpu_v2" in _export_text(f, *_shapes("forward"))
    # A measured neighbour (twice the rows) stands in for this shape too.
    with _target():
        evidence = measured(H200, {PallasMosaicGpuRaggedDot(): 1.0, RaggedDot(): 4.0},
                            *_shapes("forward", m=2 * M))
    with evidence:
        assert "mosaic_gpu_v2" in _export_text(f, *_shapes("forward"))


def test_none_backward_runs_mosaic_where_its_gradient_calls_were_measured_faster():
    """The ragged-dot VJP makes two nested ragged dots; their measurements decide it."""
    def loss(x, w, s):
        return ragged_dot(x, w, s).astype(jnp.float32).sum()

    f = jax.value_and_grad(loss, argnums=(0, 1))
    assert "mosaic_gpu_v2" not in _export_text(f, *_shapes("forward"))
    times = {}
    with _target():
        for variant in ("forward", "dlhs", "drhs"):
            # The gradients ask for their operand's dtype; the forward call, for nothing.
            kw = dict(variant=variant) if variant == "forward" else dict(
                variant=variant, preferred_element_type=jnp.bfloat16)
            evidence = measured(H200, {PallasMosaicGpuRaggedDot(): 1.0, RaggedDot(): 4.0},
                                *_shapes(variant), **kw)
            times = evidence if not times else times | evidence
    with times:
        text = _export_text(f, *_shapes("forward"))
    assert text.count("mosaic_gpu_v2") == 3  # forward, dlhs, drhs
    # A gradient measured slower than XLA keeps the whole backward on XLA.
    with _target():
        slow = measured(H200, {PallasMosaicGpuRaggedDot(): 9.0, RaggedDot(): 4.0},
                        *_shapes("drhs"), variant="drhs", preferred_element_type=jnp.bfloat16)
    with times | slow:
        assert _export_text(f, *_shapes("forward")).count("mosaic_gpu_v2") == 1


@pytest.mark.parametrize("variant, shapes, why", [
    ("forward", _shapes("forward", dtype=jnp.float32), "bf16 or f16"),
    ("forward", _shapes("forward", n=192), "multiple of 128"),
    ("dlhs", _shapes("dlhs", k=192), "multiple of 128"),
    ("forward", _shapes("forward", k=96), "multiple of 64"),
    ("forward", _shapes("forward", m=32), "at least 64"),
    ("forward", _shapes("forward", m=300), "multiple of 8"),
    ("drhs", _shapes("drhs", m=300), "multiple of 8"),
    ("drhs", _shapes("drhs", k=96), "multiple of 64"),
    # Empty operands (a K of 0 failed in Pallas's lowering: no pipeline barriers).
    ("forward", _shapes("forward", k=0), "non-empty"),
    ("dlhs", _shapes("dlhs", k=0), "non-empty"),
    ("drhs", _shapes("drhs", k=0), "non-empty"),
    ("forward", _shapes("forward", n=0), "non-empty"),
])
def test_unsupported_inputs_raise_not_implemented(variant, shapes, why):
    op = PallasMosaicGpuRaggedDot()
    with _target(), pytest.raises(NotImplementedError, match=why):
        jax.eval_shape(lambda a, b, s: op(a, b, s, variant=variant), *shapes)


def test_f32_output_and_old_gpus_raise_not_implemented():
    op = PallasMosaicGpuRaggedDot()
    args = _shapes("forward")
    with _target(), pytest.raises(NotImplementedError, match="preferred_element_type"):
        jax.eval_shape(lambda a, b, s: op(a, b, s, preferred_element_type=jnp.float32), *args)
    with _target("NVIDIA A100-SXM4-40GB"), pytest.raises(NotImplementedError, match="Hopper"):
        jax.eval_shape(lambda a, b, s: op(a, b, s), *args)


def test_pinned_config_that_does_not_fit_raises():
    op = PallasMosaicGpuRaggedDot(config=Config(tile_n=256))  # CTA 512 wide, N is 256
    with _target(), pytest.raises(NotImplementedError, match="does not fit"):
        jax.eval_shape(lambda a, b, s: op(a, b, s), *_shapes("forward"))


def test_on_cpu_mosaic_raises_and_none_falls_back_to_xla():
    x = random_normal(0, (M, K), jnp.bfloat16)
    w = random_normal(1, (len(SIZES), K, N), jnp.bfloat16)
    sizes = jnp.asarray(SIZES, jnp.int32)
    with pytest.raises(NotImplementedError, match="cuda"):
        jax.jit(lambda a, b, s: ragged_dot(a, b, s, implementation="mosaic"))(x, w, sizes)
    out = jax.jit(lambda a, b, s: ragged_dot(a, b, s))(x, w, sizes)
    with reference_precision():
        ref = RaggedDot()(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    assert_close(out, ref, jnp.bfloat16)


@pytest.mark.parametrize("kwargs", [dict(tile_m=96), dict(tile_n=32), dict(tile_k=24),
                                    dict(epi_n=48), dict(num_stages=1), dict(grid_minor_dim=2),
                                    dict(grid_tile_width=0)])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        Config(**kwargs)


@pytest.mark.parametrize("variant", ["forward", "dlhs", "drhs"])
def test_heuristics_and_search_space_fit_smem(variant):
    op = PallasMosaicGpuRaggedDot()
    lhs, rhs, sizes = _shapes(variant, **BENCH)
    ba = op.bind(lhs, rhs, sizes, variant=variant)
    config = op._get_heuristics_config(ba)
    assert (config.tile_m, config.cta_n, config.tile_k, config.num_stages) == (128, 256, 64, 4)
    assert config.smem_bytes(2) <= SMEM_BUDGET_BYTES
    space = op._get_autotuning_configs(ba)
    assert len(space) > 20 and config in space
    assert all(c.smem_bytes(2) <= SMEM_BUDGET_BYTES and 4096 % c.cta_n == 0 for c in space)
    small = op.bind(*_shapes(variant, m=96, k=128, n=128, g=3), variant=variant)
    small_config = op._get_heuristics_config(small)
    assert small_config.cta_n == 128
    assert small_config.tile_m == (128 if variant == "drhs" else 64)


@pytest.mark.parametrize("sizes, m, tile_m", [
    ((24, 23, 30, 17, 26, 0, 24), 160, 64),  # decode-like: few rows a group, a tail of 16
    ((100, 0, 37, 119), 296, 64),  # the suite's sizes: a group spanning two tiles
    ((1, 130, 5, 300), 440, 128),
    (tuple(range(1, 33)), 528, 64),  # more groups than rows a tile
    ((100, 100, 100), 160, 64),  # sizes past M (traced sizes are not checked): rows < M
])
def test_row_tiles_start_at_their_group_and_cover_every_row_once(sizes, m, tile_m):
    """The rows kernel's work list (`_row_tile`, walked by the persistent grid): every row
    in exactly one tile of its group (the tail past the groups as group G), tiles starting
    at their group's first row rounded down to 8 rows, a group of at most tile_m - 7 rows
    in one tile (its weights read once a column tile), and nothing past the list."""
    g = len(sizes)
    sizes_array = np.asarray(sizes, np.int32)
    owner = np.full(m + tile_m, -1)  # rows past M: a tile's stores there must be empty
    tiles_of = np.zeros(g + 1, int)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    count = rows_kernel.row_tile_count(m, g, tile_m)
    for index in range(count + 3):
        group, row0, lo, hi = (int(v) for v in rows_kernel._row_tile(
            sizes_array, g, m, tile_m, jnp.int32(index)))
        if hi <= lo:
            continue
        assert index < count, "a tile past the persistent grid's row items"
        assert row0 % rows_kernel.ROW_ALIGN == 0 and 0 <= lo < hi <= tile_m
        assert row0 <= starts[group] < row0 + tile_m or lo == 0
        assert (owner[row0 + lo:row0 + hi] == -1).all()
        owner[row0 + lo:row0 + hi] = group
        tiles_of[group] += 1
    clipped = np.diff(np.minimum(starts, m))
    tail = m - clipped.sum()
    expected = np.repeat(np.arange(g + 1), [*clipped, tail])
    np.testing.assert_array_equal(owner[:m], expected)
    if sum(sizes) <= m:
        assert (owner[m:] == -1).all()
    for group, size in enumerate([*sizes, tail]):
        if 0 < size <= tile_m - (rows_kernel.ROW_ALIGN - 1):
            assert tiles_of[group] == 1, (group, size)


@pytest.mark.exhaustive
@pytest.mark.parametrize("sizes", [(24, 23, 30, 17, 26, 0, 24), (5, 100, 23)])
@pytest.mark.parametrize("variant", ["forward", "dlhs"])
def test_interpreted_rows_kernel_matches_reference_at_few_rows_a_group(variant, sizes):
    """The rows kernel in GPU interpret mode: decode-like groups of 17-30 rows starting
    off the 8-row grid (tiles start before them and hold their neighbours' rows), an
    empty group, a group of two tiles starting off the grid, and a tail past the groups
    (zeros)."""
    m, k, n = 160, 128, 128  # dlhs contracts over n, and its output columns are k
    lhs, rhs = (random_normal(seed, shape).astype(jnp.bfloat16) for seed, shape in (
        (51, (m, k if variant == "forward" else n)), (52, (len(sizes), k, n))))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    with interpret_mode():
        got, _ = PallasMosaicGpuRaggedDot()._fwd(
            lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
            variant=variant, return_residuals=False,
            config=Config(tile_m=64, tile_n=64, tile_k=64, num_stages=2))
    with reference_precision():
        want = RaggedDot()(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes,
                           variant=variant)
    assert_close(got, want, jnp.bfloat16)
    assert not np.any(np.asarray(got[sum(sizes):], np.float32))


@pytest.mark.parametrize("variant", ["forward", "dlhs"])
def test_few_rows_a_group_takes_64_row_tiles_and_deeper_pipelines(variant):
    op = PallasMosaicGpuRaggedDot()
    decode = op.bind(*_shapes(variant, m=1536, k=2048, n=1408, g=64), variant=variant)
    config = op._get_heuristics_config(decode)
    assert config.tile_m == 64 and config.num_stages >= 5
    assert config.smem_bytes(2) <= SMEM_BUDGET_BYTES
    assert config in op._get_autotuning_configs(decode)
    text = _export_text(lambda a, b, s: op(a, b, s, variant=variant),
                        *_shapes(variant, m=1536, k=2048, n=1408, g=64))
    assert text.count("mosaic_gpu_v2") == 1


def test_default_vjp_reuses_the_kernel_without_config():
    op = PallasMosaicGpuRaggedDot(config=Config(num_stages=3))
    vjp = op.vjp_op()
    assert type(vjp.inner) is PallasMosaicGpuRaggedDot and vjp.inner.config is None
