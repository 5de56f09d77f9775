"""What the Mosaic TPU layer norm and its VJP share: the config, the input checks, and
the row-block choice per TPU generation (VMEM footprint and a roofline model).

Nothing here has been timed on a TPU: the footprints count the kernels' blocks as Mosaic
lays them out in VMEM, and the model uses the generations' public HBM bandwidths
(`tokamax_kernels._mosaic_tpu`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from tokamax_kernels import _mosaic_tpu
from tokamax_kernels._mosaic_tpu import TpuGeneration
from tokamax_pass.core import BoundArguments

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_LANES = 128
_SUBLANES = 8
_ROW_ALIGN = 16  # row blocks: 8 sublanes, 16 for bf16 (two rows per 32-bit word)
BLOCK_ROWS = (16, 32, 64, 128, 256, 512, 1024)


@dataclasses.dataclass(frozen=True)
class Config:
    """Rows per block (a grid step normalizes `block_rows` whole rows); a block at least
    as tall as the call's row count covers it in one step."""

    block_rows: int

    def __post_init__(self) -> None:
        value = self.block_rows
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or (
                value % _ROW_ALIGN):
            raise ValueError(f"Config.block_rows must be a positive multiple of {_ROW_ALIGN}, "
                             f"got {value!r}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Footprint:
    """One kernel call's sizes and what each grid step moves.

    `row_arrays`: `(rows, n)` arrays read or written in x's dtype; `vectors`: `(1, n)`
    float32 rows read or written per step (scale, offset, the backward's partial sums);
    `partial_sums`: those of `vectors` written once per step (HBM traffic that grows
    with the step count); `temporaries`: float32 `(block_rows, n)` values live at once.
    Every kernel also moves two float32 `(rows, 1)` statistics columns.
    """

    rows: int
    features: int
    itemsize: int
    row_arrays: int
    vectors: int
    partial_sums: int
    temporaries: int

    def block_rows(self, config: Config) -> int:
        """The config's row block on this call: the whole row count when it covers it."""
        return self.rows if config.block_rows >= self.rows else config.block_rows

    def vmem_bytes(self, block_rows: int) -> int:
        """Double-buffered blocks as Mosaic pads them ((8, 128) float32 tiles: a `(rows,
        1)` column takes 128 lanes, a `(1, n)` row 8 sublanes) plus the temporaries."""
        lanes = _round_up(self.features, _LANES)
        rows = _round_up(block_rows, _ROW_ALIGN)
        per_row = 2 * self.row_arrays * lanes * self.itemsize + 2 * 2 * _LANES * 4
        return (rows * (per_row + self.temporaries * lanes * 4)
                + 2 * self.vectors * _SUBLANES * lanes * 4)

    def seconds(self, block_rows: int, gen: TpuGeneration) -> float:
        """A roofline estimate: all HBM traffic at the generation's bandwidth, plus one
        step's blocks again (the first loads and last stores, which no other step
        overlaps) and a fixed cost per grid step."""
        steps = -(-self.rows // block_rows)
        row_bytes = self.features * self.itemsize * self.row_arrays + 2 * 4
        traffic = self.rows * row_bytes + steps * self.partial_sums * self.features * 4
        exposed = block_rows * row_bytes
        return (traffic + exposed) / (gen.hbm_gb_per_s * 1e9) + steps * _mosaic_tpu.STEP_SECONDS


def footprint(args: Mapping[str, Any], *, backward: bool) -> Footprint:
    """The forward's (x, y; residual and s with one) or the backward's (x, dy, dx; ds
    with a residual) footprint of a call's arguments (`x`, `scale`, `offset`, and
    `residual` or none)."""
    x = args["x"]
    has_residual = args.get("residual") is not None
    params = sum(args[name] is not None for name in ("scale", "offset"))
    common = dict(rows=math.prod(x.shape[:-1]), features=x.shape[-1],
                  itemsize=jnp.dtype(x.dtype).itemsize)
    if backward:
        # Partial sums: dscale with a scale, doffset with an offset; the scale is read.
        partials = params
        return Footprint(**common, row_arrays=3 + has_residual,
                         vectors=partials + int(args["scale"] is not None),
                         partial_sums=partials, temporaries=5)
    return Footprint(**common, row_arrays=2 + 2 * has_residual, vectors=params,
                     partial_sums=0, temporaries=4)


def fitting(ba: BoundArguments, *, backward: bool) -> dict[int, Config]:
    """The distinct row blocks of `BLOCK_ROWS` on this call that fit the generation's
    VMEM budget, each with the smallest config that gives it."""
    fp = footprint(ba.arguments, backward=backward)
    budget = _mosaic_tpu.current_generation().vmem_budget()
    found: dict[int, Config] = {}
    for block_rows in BLOCK_ROWS:
        config = Config(block_rows)
        block = fp.block_rows(config)
        if fp.vmem_bytes(block) <= budget:
            found.setdefault(block, config)
    return found


def heuristics_config(ba: BoundArguments, *, backward: bool) -> Config:
    """The row block the roofline model (`Footprint.seconds`) finds fastest on this
    generation among those that fit half its VMEM; ties go to the smaller block."""
    fp = footprint(ba.arguments, backward=backward)
    gen = _mosaic_tpu.current_generation()
    candidates = fitting(ba, backward=backward)
    if not candidates:
        smallest = min(_ROW_ALIGN, fp.rows)
        raise NotImplementedError(
            f"a block of {smallest} rows of {fp.features} features needs "
            f"{fp.vmem_bytes(smallest)} bytes of VMEM, more than the {gen.name} budget of "
            f"{gen.vmem_budget()}: the Mosaic TPU layer norm keeps whole rows in VMEM")
    best = min(candidates, key=lambda block: (fp.seconds(block, gen), block))
    return candidates[best]


def check_inputs(ba: BoundArguments, config: Config | None, *, backward: bool) -> None:
    """`NotImplementedError` for calls the kernels do not take (so `None` falls back)."""
    args = ba.arguments
    x = args["x"]
    if args["axis"] != x.ndim - 1:
        raise NotImplementedError(
            f"the Mosaic TPU layer norm normalizes the last axis only, got axis="
            f"{args['axis']} of a rank-{x.ndim} x")
    if math.prod(x.shape) == 0:
        raise NotImplementedError("the Mosaic TPU layer norm needs a non-empty x")
    for name in ("x", "scale", "offset"):
        value = args[name]
        if value is not None and jnp.dtype(value.dtype) not in DTYPES:
            raise NotImplementedError(
                f"the Mosaic TPU layer norm takes bf16 and f32, not {name} of {value.dtype}")
    if config is not None:
        fp = footprint(ba.arguments, backward=backward)
        block = fp.block_rows(config)
        gen = _mosaic_tpu.current_generation()
        if fp.vmem_bytes(block) > gen.vmem_budget():
            raise NotImplementedError(
                f"{config} needs {fp.vmem_bytes(block)} bytes of VMEM on this call, more "
                f"than the {gen.name} budget of {gen.vmem_budget()}: use fewer rows")


def float32_row(param: Any) -> Any:
    """A scale or offset as the float32 `(1, n)` row the kernels read (None stays None)."""
    return None if param is None else param.astype(jnp.float32).reshape(1, -1)
