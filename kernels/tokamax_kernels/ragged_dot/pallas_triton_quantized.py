"""Row-grouped ragged dots (forward, dlhs) as a Pallas Triton kernel, of 16/32-bit operands
(`pallas_triton.py` runs it with no scales) or 8-bit ones.

The work tiles start at their group's first row (`group_tiles`). Each program loads its
tiles as stored (int8, float8 or 16/32-bit floats: 8-bit weights are read at one byte an
element), converts them in registers to the dot's dtype (`kernel_dot_dtype`: float8
pairs stay float8, anything else meets in bf16/f16/f32, exactly), accumulates in float32,
and in the epilogue multiplies its rows by `lhs_scale[r]` and its columns by
`rhs_scale[g]` before the one store. Scales per block of K (one per 128 values of a row,
say) multiply each step's product instead, `block_k` dividing their blocks.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tokamax_kernels import _triton
from tokamax_kernels._triton import MatmulConfig
from tokamax_kernels._triton_float8_dot import set_float8_imprecise_accumulation
from tokamax_kernels.ragged_dot import quantization as q
from tokamax_kernels.ragged_dot import xla_tiled

FLOAT8 = tuple(jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2))
_STORED = (*FLOAT8, *(jnp.dtype(d) for d in (
    jnp.int8, jnp.uint8, jnp.bfloat16, jnp.float16, jnp.float32)))
# Products of this many contraction values summed in the tensor cores before each float32
# addition of a float8 dot (one 128-deep step): on the H200 as fast as Triton's Hopper
# default (the whole contraction) and with the same measured error as Pallas's 0 (which
# stalls `wgmma`), `quantized_ragged_dot_variants.jsonl`.
FLOAT8_IMPRECISE_ACCUMULATION = 128


def kernel_dot_dtype(lhs_dtype: Any, rhs_dtype: Any) -> Any:
    """The dtype both tiles meet in: float8 for two float8 tiles, else the wider float
    of the two (bf16 for two integer tiles: their products and sums stay exact in the
    float32 accumulator up to 2**24)."""
    a, b = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)
    if a in FLOAT8 and b in FLOAT8:
        return a if a == b else jnp.dtype(jnp.bfloat16)
    floats = [d for d in (a, b) if jnp.issubdtype(d, jnp.floating) and d not in FLOAT8]
    return jnp.dtype(jnp.result_type(*floats)) if floats else jnp.dtype(jnp.bfloat16)


def check_supported(lhs: Any, rhs: Any) -> None:
    """`NotImplementedError` for operands the kernel cannot read (after `post_scale`:
    scales along K or zero points are dequantized first, so those always fit)."""
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        stored = x.qvalue.dtype if q.is_quantized(x) else x.dtype
        if jnp.dtype(stored) not in _STORED:
            raise NotImplementedError(f"the Triton quantized ragged dot does not read {name} "
                                      f"of {stored}")
        if 0 in x.shape:
            raise NotImplementedError("the Triton ragged dot needs non-empty operands")


def heuristics_config(*, m: int, k: int, n: int, groups: int, dot_dtype: Any) -> MatmulConfig:
    """Tiles by the dot's element size, as measured on the H200
    (`benchmarks/probes/quantized_ragged_dot_variants.py`): float8 takes 128 x 256 tiles
    and 128-deep steps (a float8 `wgmma` step is 32 deep) over 3 stages, both tiles
    contraction-major (`TritonBackend` stores the weights so); few rows a group (64 or
    fewer) take 64 x 64 tiles and 128-deep steps over 4 stages (many programs, each
    reading a narrow strip of weights); others `pallas_triton`'s choices."""
    itemsize = jnp.dtype(dot_dtype).itemsize

    def fit(size: int, most: int) -> int:
        return max(16, min(most, _triton.next_power_of_2(size)))

    if groups and m / groups <= 64:
        return MatmulConfig(block_m=fit(m, 64), block_n=fit(n, 64), block_k=fit(k, 128),
                            num_warps=4, num_stages=4)
    depth = {1: 128, 2: 64}.get(itemsize, 32)
    return MatmulConfig(block_m=fit(m, 128), block_n=fit(n, 256 if itemsize <= 2 else 128),
                        block_k=fit(k, depth), num_warps=8, num_stages=3 if itemsize <= 2 else 2)


def _zero(ref: Any) -> int | float:
    """The fill of masked loads from `ref`, of its kind (Triton casts no integer to
    float8)."""
    return 0.0 if jnp.issubdtype(ref.dtype, jnp.floating) else 0


def _kernel(tiles_ref, lhs_ref, rhs_ref, *refs, m: int, c: int, n: int, g: int,
            config: MatmulConfig, transpose_rhs: bool, dot_dtype: Any,
            lhs_blocks: int | None, rhs_blocks: int | None) -> None:
    """`*_blocks`: `None` for no scales, 1 for scales constant along the contraction
    (applied in the epilogue), more for scales per block of `c // blocks` (applied to
    each step's product; `block_k` divides a block)."""
    scale_refs, out_ref = refs[:-1], refs[-1]
    # Refs exactly where their operand is quantized by blocks (only then read).
    lhs_scale_ref: Any = scale_refs[0] if lhs_blocks else None
    rhs_scale_ref: Any = scale_refs[-1] if rhs_blocks else None
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    j, t = pl.program_id(0), pl.program_id(1)
    group, r0, count = tiles_ref[0, t], tiles_ref[1, t], tiles_ref[2, t]
    rows = jnp.arange(bm)
    cols = j * bn + jnp.arange(bn)
    in_rows = rows < count
    rhs_g = jnp.minimum(group, g - 1)

    def row_scale(kb: Any) -> jax.Array:
        return plgpu.load(lhs_scale_ref.at[pl.ds(r0, bm), kb], mask=in_rows,
                          other=0).astype(jnp.float32)[:, None]

    def col_scale(kb: Any) -> jax.Array:
        return plgpu.load(rhs_scale_ref.at[rhs_g, kb, pl.ds(j * bn, bn)], mask=cols < n,
                          other=0).astype(jnp.float32)[None, :]

    def step(kk: Any, acc: jax.Array) -> jax.Array:
        ks = kk * bk + jnp.arange(bk)
        a = plgpu.load(lhs_ref.at[pl.ds(r0, bm), pl.ds(kk * bk, bk)],
                       mask=in_rows[:, None] & (ks < c)[None, :], other=_zero(lhs_ref))
        if transpose_rhs:
            b = plgpu.load(rhs_ref.at[rhs_g, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)],
                           mask=(cols < n)[:, None] & (ks < c)[None, :], other=_zero(rhs_ref))
        else:
            b = plgpu.load(rhs_ref.at[rhs_g, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)],
                           mask=(ks < c)[:, None] & (cols < n)[None, :], other=_zero(rhs_ref))
        exact = jnp.dtype(dot_dtype) == jnp.float32
        product = plgpu.dot(a.astype(dot_dtype), b.astype(dot_dtype), trans_b=transpose_rhs,
                            allow_tf32=not exact)
        if lhs_blocks and lhs_blocks > 1:
            product = product * row_scale(kk * bk // (c // lhs_blocks))
        if rhs_blocks and rhs_blocks > 1:
            product = product * col_scale(kk * bk // (c // rhs_blocks))
        return acc + product

    active = (count > 0) & (group < g)
    steps = active.astype(jnp.int32) * _triton.cdiv(c, bk)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), jnp.float32))
    if lhs_blocks == 1:
        acc = acc * row_scale(jnp.int32(0))
    if rhs_blocks == 1:
        acc = acc * col_scale(jnp.int32(0))
    plgpu.store(out_ref.at[pl.ds(r0, bm), pl.ds(j * bn, bn)], acc.astype(out_ref.dtype),
                mask=in_rows[:, None] & (cols < n)[None, :])


def group_tiles(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """(3, T) int32 work list: group, first row and row count of each tile, the tiles
    starting at their group's first row, so a group of at most `block_m` rows is one
    tile and its weights are read once for each column block (tiles aligned to multiples
    of `block_m` split most groups of few rows in two and read their weights twice).
    Group G holds the rows past `sum(group_sizes)` (their outputs are zeros); unused
    entries have no rows."""
    total = jnp.minimum(jnp.sum(group_sizes.astype(jnp.int32)), m)
    with_tail = jnp.append(group_sizes.astype(jnp.int32), m - total)
    return jnp.stack(xla_tiled.row_tiles(with_tail, m, block_m)).astype(jnp.int32)


def block_k_for_scales(block_k: int, c: int, *blocks: int) -> int | None:
    """The largest power of two at most `block_k` (and at least 16) that divides every
    scale block (`c // blocks`), or `None` where none does."""
    sizes = [c // b for b in blocks if b > 1]
    while block_k >= 16:
        if all(size % block_k == 0 for size in sizes):
            return block_k
        block_k //= 2
    return None


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
               lhs_scale: jax.Array | None, rhs_scale: jax.Array | None, transpose_rhs: bool,
               out_dtype: Any, config: MatmulConfig, variant: str = "forward",
               interpret: bool = False) -> jax.Array:
    """`out[r] = sum over K blocks b of (lhs[r, b] @ rhs[g, b]) * lhs_scale[r, b] *
    rhs_scale[g, b]`: `lhs (M, C)`, `rhs (G, C, N)` (`(G, N, C)`, contraction-major, with
    `transpose_rhs`), `lhs_scale (M, Bl)`, `rhs_scale (G, Br, N)` (one block: scales
    applied in the epilogue; one per output column either way), each optional;
    `config.block_k` must divide every block. Rows past `sum(group_sizes)` are zeros.
    `variant` ("forward" or "dlhs") names the kernel."""
    m, c = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    lhs_blocks = None if lhs_scale is None else lhs_scale.shape[1]
    rhs_blocks = None if rhs_scale is None else rhs_scale.shape[1]
    if block_k_for_scales(config.block_k, c, lhs_blocks or 1,
                          rhs_blocks or 1) != config.block_k:
        raise ValueError(f"block_k={config.block_k} does not divide the scale blocks of "
                         f"lhs_scale {lhs_blocks} and rhs_scale {rhs_blocks} over {c}")
    dot_dtype = kernel_dot_dtype(lhs.dtype, rhs.dtype)
    if dot_dtype in FLOAT8:
        set_float8_imprecise_accumulation(FLOAT8_IMPRECISE_ACCUMULATION)
    tiles = group_tiles(group_sizes, m, config.block_m)
    scales = [s for s in (lhs_scale, rhs_scale) if s is not None]
    quantized = bool(scales) or 1 in (jnp.dtype(lhs.dtype).itemsize, jnp.dtype(rhs.dtype).itemsize)
    kernel = functools.partial(
        _kernel, m=m, c=c, n=n, g=g, config=config, transpose_rhs=transpose_rhs,
        dot_dtype=dot_dtype, lhs_blocks=lhs_blocks, rhs_blocks=rhs_blocks)
    return pl.pallas_call(
        kernel,
        grid=(_triton.cdiv(n, config.block_n), tiles.shape[1]),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=_triton.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name=f"tokamax_{'quantized_' if quantized else ''}ragged_dot_{variant}",
    )(tiles, lhs, rhs, *scales)
