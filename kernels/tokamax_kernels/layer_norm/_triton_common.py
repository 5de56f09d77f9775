"""Checks and block helpers that the Triton layer-norm kernel and its VJP share."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tokamax_kernels import _triton
from tokamax_pass.core import BoundArguments

# Largest row chunk (elements) kept in registers by one program.
MAX_BLOCK_ELEMENTS = 16384


def check_multiple(config: Any) -> None:
    if config.rows_per_program < config.block_rows or config.rows_per_program % config.block_rows:
        raise ValueError(
            f"{type(config).__name__}.rows_per_program ({config.rows_per_program}) must be a "
            f"multiple of block_rows ({config.block_rows})"
        )


def check_powers_of_2(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{type(config).__name__}.{name} must be a power of 2, got {value}")


def check_triton_norm_inputs(ba: BoundArguments) -> None:
    """What the Triton norm kernels cannot do (raised as `NotImplementedError`)."""
    args = ba.arguments
    x = args["x"]
    if args["axis"] != x.ndim - 1:
        raise NotImplementedError(
            f"the Triton layer norm normalizes the last axis only, got axis={args['axis']}"
        )
    if math.prod(x.shape) == 0:
        raise NotImplementedError("the Triton layer norm needs a non-empty x")
    for name in ("x", "scale", "offset"):
        _triton.require_triton_dtype(name, args[name])


def row_chunk(n: int) -> int:
    """Columns one program holds at once: the whole row when it fits, else a chunk."""
    return min(_triton.next_power_of_2(n), MAX_BLOCK_ELEMENTS)


def block_rows_choices(block_n: int) -> tuple[int, ...]:
    """Rows per block for a search space: blocks of 1K-16K elements, one row at least
    (a 64-wide row needs 16-256 rows per block to keep the memory system busy)."""
    return tuple(sorted({max(1, e // block_n) for e in (1024, 2048, 4096, 8192, 16384)
                         if max(1, e // block_n) * block_n <= MAX_BLOCK_ELEMENTS}))


def row_mask_of(r0: Any, *, rows: int, block_rows: int, exact: bool) -> jax.Array | None:
    """Which of rows `[r0, r0 + block_rows)` exist (`None`: all of them, no mask needed)."""
    return None if exact else r0 + jnp.arange(block_rows) < rows


def is_exact(rows: int, n: int, rows_per_program: int, block_n: int) -> bool:
    """Whether the blocks tile `(rows, n)` exactly: loads and stores then need no masks,
    which lets Triton issue full-width vector accesses."""
    return rows % rows_per_program == 0 and n % block_n == 0


def masked(mask: jax.Array | None, x: jax.Array) -> jax.Array:
    """`x` with zeros where `mask` is False (`None` masks nothing)."""
    return x if mask is None else jnp.where(mask, x, 0.0)


def masked_load(ref: Any, mask: jax.Array | None) -> jax.Array:
    """A masked load (zeros outside the mask), or a plain one when `mask` is None."""
    return plgpu.load(ref, mask=mask, other=None if mask is None else 0.0)


def load_rows(ref: Any, r0: Any, c: Any, row_mask: jax.Array | None, *, n: int,
               block_n: int, block_rows: int) -> tuple[jax.Array, Any, Any]:
    """Chunk `c` of rows `[r0, r0 + block_rows)` as float32 (zeros outside the array).

    `row_mask` None means the blocks tile the array exactly: no masks at all.
    """
    start = c * block_n
    if row_mask is None:
        mask = col_mask = None
    else:
        col_mask = start + jnp.arange(block_n) < n
        mask = row_mask[:, None] & col_mask[None, :]
    block = masked_load(ref.at[pl.ds(r0, block_rows), pl.ds(start, block_n)], mask)
    return block.astype(jnp.float32), mask, col_mask


def load_vector(ref: Any, c: Any, col_mask: jax.Array | None, block_n: int) -> jax.Array:
    return masked_load(ref.at[pl.ds(c * block_n, block_n)], col_mask).astype(jnp.float32)
