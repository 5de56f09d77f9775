"""The interpret shim's reduce-adding TMA store (`copy_smem_to_gmem(..., reduction_op="add")`).

On CPU, in `_mosaic_gpu_interpret.interpret_mode()`: blocks of a grid (run one after
another), and the warpgroups of each block (run in concurrent threads), add float32 tiles
from swizzled SMEM into overlapping rows of one GMEM array, checked against numpy. The
array is a `jax.new_ref` the kernel takes as an operand (`plgpu.kernel` has no
`input_output_aliases`: a ref operand is how it aliases), because an output the
interpreter allocates starts as NaN. The same kernel lowers for an H200 with the operand
aliased to its result. The shim's patch is gone after the context exits.
"""

from __future__ import annotations

import time

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import _mosaic_gpu_interpret as shim
import tokamax_pass as tokamax
from _mosaic_gpu_interpret import interpret_mode
from conftest import H200, random_normal

ROWS, COLS = 64, 128
STRIDE = 32  # block b adds rows [b * STRIDE, b * STRIDE + ROWS): neighbours overlap
BLOCKS, WARPGROUPS = 4, 2
OUT_ROWS = STRIDE * (BLOCKS - 1) + ROWS
# What the attention kernels' `tile_transforms` gives 16-bit tiles, for float32.
F32_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def _reduce_add_kernel(out_type=()):
    """Block `b`, warpgroup `w` adds `tiles[b, w]` into rows `b * STRIDE` on of the GMEM
    array it is given (an operand ref, or its output when `out_type` names one)."""

    def body(tiles_ref, out_ref, smem, barriers):
        b, w = jax.lax.axis_index("b"), jax.lax.axis_index("w")
        plgpu.copy_gmem_to_smem(tiles_ref.at[b, w], smem.at[w], barriers.at[w])
        plgpu.barrier_wait(barriers.at[w])
        plgpu.copy_smem_to_gmem(smem.at[w], out_ref.at[pl.ds(b * STRIDE, ROWS)],
                                reduction_op="add")
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        body, out_type=out_type, grid=(BLOCKS,), grid_names=("b",),
        num_threads=WARPGROUPS, thread_name="w",
        scratch_types=[plgpu.SMEM((WARPGROUPS, ROWS, COLS), jnp.float32,
                                  transforms=F32_TRANSFORMS),
                       plgpu.Barrier(num_barriers=WARPGROUPS)])


def _reduce_add_into(init: jax.Array, tiles: jax.Array) -> jax.Array:
    """`init` with every tile reduce-added into it, through an aliased ref."""
    out = jax.new_ref(init)
    _reduce_add_kernel()(tiles, out)
    return jax.freeze(out)


def _expected(init: np.ndarray, tiles: np.ndarray) -> np.ndarray:
    total = init.astype(np.float64)
    for b in range(BLOCKS):
        total[b * STRIDE:b * STRIDE + ROWS] += tiles[b].astype(np.float64).sum(axis=0)
    return total


def test_reduce_add_sums_overlapping_tiles_of_every_block_and_warpgroup():
    tiles = random_normal(0, (BLOCKS, WARPGROUPS, ROWS, COLS))
    init = random_normal(1, (OUT_ROWS, COLS))
    with interpret_mode():
        got = np.asarray(_reduce_add_into(init, tiles))
    np.testing.assert_allclose(got, _expected(np.asarray(init), np.asarray(tiles)),
                               rtol=1e-5, atol=1e-5)


def test_concurrent_warpgroups_reduce_add_atomically(monkeypatch):
    """A block's warpgroups run in concurrent threads: with the read-modify-write slowed
    down, an add that is not atomic loses the other warpgroup's tile."""
    added = shim._added

    def slow_added(current, tile):
        time.sleep(0.05)
        return added(current, tile)

    monkeypatch.setattr(shim, "_added", slow_added)
    tiles = random_normal(4, (BLOCKS, WARPGROUPS, ROWS, COLS))
    init = random_normal(5, (OUT_ROWS, COLS))
    with interpret_mode():
        got = np.asarray(_reduce_add_into(init, tiles))
    np.testing.assert_allclose(got, _expected(np.asarray(init), np.asarray(tiles)),
                               rtol=1e-5, atol=1e-5)


def test_reduce_add_into_zeros_under_jit():
    tiles = random_normal(2, (BLOCKS, WARPGROUPS, ROWS, COLS))
    with interpret_mode():
        got = np.asarray(jax.jit(lambda t: _reduce_add_into(
            jnp.zeros((OUT_ROWS, COLS), jnp.float32), t))(tiles))
    np.testing.assert_allclose(got, _expected(np.zeros((OUT_ROWS, COLS)), np.asarray(tiles)),
                               rtol=1e-5, atol=1e-5)


def test_an_unaliased_output_starts_as_nan():
    """Why the kernel needs an aliased, zeroed operand: reduce-adding into an output the
    interpreter allocates adds into NaN."""
    tiles = random_normal(3, (BLOCKS, WARPGROUPS, ROWS, COLS))
    with interpret_mode():
        got = np.asarray(_reduce_add_kernel(
            jax.ShapeDtypeStruct((OUT_ROWS, COLS), jnp.float32))(tiles))
    assert np.isnan(got).all()


def test_the_patch_is_undone_on_exit():
    original = gpu_callbacks.copy_smem_to_gmem
    with interpret_mode():
        assert gpu_callbacks.copy_smem_to_gmem is not original
    assert gpu_callbacks.copy_smem_to_gmem is original


def test_the_aliased_kernel_lowers_for_an_h200_with_the_ref_aliased():
    mesh = AbstractMesh((1,), ("_target",), axis_types=(AxisType.Auto,),
                        abstract_device=AbstractDevice(H200, None, "cuda"))
    args = (jax.ShapeDtypeStruct((OUT_ROWS, COLS), jnp.float32),
            jax.ShapeDtypeStruct((BLOCKS, WARPGROUPS, ROWS, COLS), jnp.float32))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.export.export(
            jax.jit(_reduce_add_into), platforms=["cuda"],
            disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(*args).mlir_module()
    (call,) = [line for line in text.splitlines()
               if "mosaic_gpu_v2" in line and "custom_call" in line]
    assert "output_operand_aliases" in call
