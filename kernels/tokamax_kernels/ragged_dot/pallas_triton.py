"""`PallasTritonRaggedDot`: the ragged dot (forward, dlhs, drhs) as Pallas Triton kernels.

forward / dlhs group their output rows: they run the row-grouped kernel of
`pallas_triton_quantized.py` with no scales. Its work tiles start at their group's
first row, so a group of at most `block_m` rows is one tile and its weights are read
once for each column tile; rows past `sum(group_sizes)` form a zero "tail" group.

drhs contracts over the grouped rows: one program per (column tile, K tile,
group) walks that group's rows in `block_m` steps (rows of neighbours masked to
zero) and stores `x_g^T @ dy_g`; an empty group stores zeros. Each output tile
has one owner and a fixed summation order, so results are deterministic.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tokamax_kernels import _triton
from tokamax_kernels._triton import MatmulConfig, TritonKernel
from tokamax_kernels.ragged_dot import pallas_triton_quantized
from tokamax_kernels.ragged_dot.base import RaggedDot, RaggedDotVjp, few_rows_per_group
from tokamax_pass.core import BoundArguments, Op, Target

# Shared memory one H200 program may use (227 KiB, less a margin for Triton's own).
_SMEM_BYTES = 220 * 1024


# forward/dlhs: `block_m` output rows, `block_n` output columns, `block_k` contraction
# step. drhs: `block_m` grouped rows per step (the contraction), `block_k` rows of the
# (K, N) output tile, `block_n` its columns.
Config = MatmulConfig


def _group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Start and end rows of each group (clipped to the M rows)."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


def _drhs_kernel(bounds_ref, lhs_ref, dout_ref, out_ref, *, k: int, n: int, config: Config,
                 exact: bool) -> None:
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    j, i, gi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = bounds_ref[0, gi], bounds_ref[1, gi]
    first = (start // bm) * bm
    ks = i * bk + jnp.arange(bk)
    cols = j * bn + jnp.arange(bn)

    def step(s: Any, acc: jax.Array) -> jax.Array:
        r0 = pl.multiple_of(first + s * bm, bm)
        r = r0 + jnp.arange(bm)
        mine = ((r >= start) & (r < end))[:, None]
        a = plgpu.load(lhs_ref.at[pl.ds(r0, bm), pl.ds(i * bk, bk)],
                       mask=mine & (ks < k)[None, :], other=0.0)
        b = plgpu.load(dout_ref.at[pl.ds(r0, bm), pl.ds(j * bn, bn)],
                       mask=mine & (cols < n)[None, :], other=0.0)
        return acc + plgpu.dot(a, b, trans_a=True, allow_tf32=not exact)

    steps = jnp.where(end > start, (end - first + bm - 1) // bm, 0)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bk, bn), jnp.float32))
    plgpu.store(out_ref.at[gi, pl.ds(i * bk, bk), pl.ds(j * bn, bn)], acc.astype(out_ref.dtype),
                mask=(ks < k)[:, None] & (cols < n)[None, :])


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, variant: str,
               out_dtype: Any, config: Config, interpret: bool = False) -> jax.Array:
    """The `variant` ragged dot (shapes as in `ragged_dot/base.py`)."""
    if variant != "drhs":
        return pallas_triton_quantized.ragged_dot(
            lhs, rhs, group_sizes, lhs_scale=None, rhs_scale=None,
            transpose_rhs=variant == "dlhs", out_dtype=out_dtype, config=config,
            variant=variant, interpret=interpret)
    m, k = lhs.shape
    n, g = rhs.shape[1], group_sizes.shape[0]
    kernel = functools.partial(_drhs_kernel, k=k, n=n, config=config,
                               exact=jnp.dtype(lhs.dtype) == jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(_triton.cdiv(n, config.block_n), _triton.cdiv(k, config.block_k), g),
        out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        compiler_params=_triton.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="tokamax_ragged_dot_drhs",
    )(jnp.stack(_group_bounds(group_sizes, m)), lhs, rhs)


def _output_columns(ba: BoundArguments) -> tuple[int, int, int]:
    """`(rows, contraction, columns)` of the variant's problem (see `Config`)."""
    lhs, rhs, variant = (ba.arguments[name] for name in ("lhs", "rhs", "variant"))
    if variant == "forward":
        return lhs.shape[0], lhs.shape[1], rhs.shape[2]
    if variant == "dlhs":
        return lhs.shape[0], lhs.shape[1], rhs.shape[1]
    return lhs.shape[1], lhs.shape[0], rhs.shape[1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasTritonRaggedDot(TritonKernel, RaggedDot):
    """Ragged dot by Pallas Triton kernels (f16/bf16/f32, float32 accumulation; CUDA).

    `interpret=True` runs the kernels in the Pallas interpreter (any platform; tests).
    """

    config_cls: ClassVar[type] = Config

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        args = ba.arguments
        lhs, rhs = args["lhs"], args["rhs"]
        if ba.vmap:
            raise NotImplementedError("the Triton ragged dot does not support jax.vmap")
        for name in ("lhs", "rhs"):
            _triton.require_triton_dtype(name, args[name])
        if jnp.dtype(lhs.dtype) != jnp.dtype(rhs.dtype):
            raise NotImplementedError(
                f"the Triton ragged dot needs lhs and rhs of one dtype, got {lhs.dtype} and "
                f"{rhs.dtype}")
        out = args["preferred_element_type"]
        if out is not None and jnp.dtype(out) not in _triton.TRITON_DTYPES:
            raise NotImplementedError(f"preferred_element_type={out} is not f16/bf16/f32")
        if 0 in lhs.shape or 0 in rhs.shape or args["group_sizes"].shape[0] == 0:
            raise NotImplementedError("the Triton ragged dot needs non-empty operands")

    def _fwd(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, precision: Any,
             preferred_element_type: Any, variant: str, config: Config,
             return_residuals: bool) -> tuple[jax.Array, None]:
        del precision  # f16/bf16 products are exact in f32; f32 inputs run at full precision
        out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
        return ragged_dot(lhs, rhs, group_sizes, variant=variant, out_dtype=out_dtype,
                          config=config, interpret=self.interpret), None

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        """H200, measured at m16384 k4096 n4096 bf16: forward/dlhs 128 x 256 tiles, 64-deep
        steps, 3 stages; drhs 128 x 128 output tiles over 64-row steps, 4 stages. f32
        halves the step depth and the stages.

        Few rows a group (`few_rows_per_group`, a decode step): 64-row tiles (less padding
        where a group fills a fraction of a tile), 128-column tiles (more programs stream
        the weights at once), 128-deep steps over 4 stages (longer weight reads in flight)
        and 4 warps; `benchmarks/probes/ragged_dot_small_rows.py` times it against the
        other candidates."""
        rows, contraction, columns = _output_columns(ba)
        itemsize = jnp.dtype(ba.arguments["lhs"].dtype).itemsize
        half = itemsize == 2

        def fit(size: int, most: int) -> int:
            return max(16, min(most, _triton.next_power_of_2(size)))

        if few_rows_per_group(ba):
            return Config(block_m=fit(rows, 64), block_n=fit(columns, 128),
                          block_k=fit(contraction, 128 if half else 64), num_warps=4,
                          num_stages=4 if half else 3)
        if ba.arguments["variant"] == "drhs":
            return Config(block_m=fit(contraction, 64 if half else 32),
                          block_n=fit(columns, 128), block_k=fit(rows, 128),
                          num_warps=8, num_stages=4 if half else 2)
        return Config(block_m=fit(rows, 128), block_n=fit(columns, 256 if half else 128),
                      block_k=fit(contraction, 64 if half else 32), num_warps=8,
                      num_stages=3 if half else 2)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        itemsize = jnp.dtype(ba.arguments["lhs"].dtype).itemsize
        drhs = ba.arguments["variant"] == "drhs"
        space = itertools.product((64, 128), (64, 128, 256), (32, 64, 128), (4, 8), (3, 4, 5))
        configs = set()
        for bm, bn, bk, w, s in space:
            # Shared memory per stage: the two input tiles (drhs contracts over block_m).
            tile_elems = bm * (bk + bn) if drhs else bk * (bm + bn)
            if bm * bn <= 128 * 256 and tile_elems * s * itemsize <= _SMEM_BYTES:
                configs.add(Config(block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                                   num_stages=s))
        return configs

    def _default_vjp(self) -> Op:
        return RaggedDotVjp(inner=self.replace(config=None, vjp=None))
