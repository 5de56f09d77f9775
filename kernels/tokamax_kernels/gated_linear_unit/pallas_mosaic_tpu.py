"""`PallasMosaicTpuGatedLinearUnit`: the gated linear unit, dense and grouped, as Pallas
Mosaic TPU kernels, `activation(x @ w_gate) * (x @ w_up)` with the activation fused into
the GEMMs.

The dense kernel is in `_mosaic_tpu_kernel.py`, the grouped one (`group_sizes`, MoE
expert GEMMs) in `_mosaic_tpu_grouped_kernel.py`; this module merges x's leading axes
into rows, checks what the kernels take, and picks their tiles per TPU generation from
the generation's VMEM budget, MXU width, peak rate and HBM bandwidth
(`tokamax_kernels._mosaic_tpu`); one `Config` and one roofline serve both.

Under `jax.vmap`: Pallas batches the dense kernel itself (one more, parallel, grid axis;
it has no scalar-prefetch operand, and mapped weights are read per entry in place); the
grouped kernel's mapped axes fold into its entries (`entry_folded`, as the TPU ragged
dot's), one launch whose work list covers every entry's groups.

The gradient is the family's XLA `GatedLinearUnitVjp` (the base class's default). For a
dense call it recomputes the two products from x and the weights: like every dense
implementation of the family this forward keeps no residuals, so any forward pairs with
any gradient. (The Triton GLU's gradient recomputes them too, in a kernel; a TPU one is
left for when a TPU measurement shows the XLA gradient is what is slow.) Because that
gradient reruns the products, which XLA merges with its own forward's inside a program,
`None` wants a dense forward twice as fast as XLA's (`GatedLinearUnit.kernel_margin_for`).
A grouped call, differentiated, writes the pre-activations as residuals in the family's
form (`_grouped.py`), which every grouped gradient of the family reads: the XLA one runs
its ragged dots from them and recomputes no GEMM, and `None` wants the usual margin.

Nothing here has run on a TPU: it is tested in Pallas's interpreter on a CPU and lowered
for TPUs by `jax.export`; `implementation=None` runs it only where a measurement on a
TPU shows it faster than the XLA path.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_kernels import _mosaic_tpu
from tokamax_kernels._mosaic_tpu import MosaicTpuKernel, TpuGeneration, lane_block
from tokamax_kernels.gated_linear_unit._grouped import gate_up_weights
from tokamax_kernels.gated_linear_unit._mosaic_tpu_grouped_kernel import (
    grouped_glu_forward,
    grouped_vmem_bytes,
)
from tokamax_kernels.gated_linear_unit._mosaic_tpu_kernel import (
    check_activation,
    glu_forward,
    vmem_bytes,
)
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.ragged_dot._mosaic_tpu_kernels import entry_folded
from tokamax_pass.core import BoundArguments, Target

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_LANES = 128  # a vector register is 8 x 128 32-bit words: lane blocks are multiples of 128
_ROW_ALIGN = 16  # row blocks: 8 sublanes, 16 for bf16 (two rows per 32-bit word)
_BLOCKS = (128, 256, 512)  # the search space of each tile side
# Float32 products at HIGHEST precision take six bf16 MXU passes.
_F32_PASSES = 6


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of the TPU GLU: `block_m` rows of x, `block_n` output columns (of each of
    the gate and up weights), `block_k` contraction step. A block at least as large as
    its axis covers the whole axis."""

    block_m: int
    block_n: int
    block_k: int

    def __post_init__(self) -> None:
        for name, align in (("block_m", _ROW_ALIGN), ("block_n", _LANES), ("block_k", _LANES)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or (
                    value % align):
                raise ValueError(f"Config.{name} must be a positive multiple of {align}, "
                                 f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class _Problem:
    """A call's GEMM sizes: rows M (x's leading axes merged), K, N, and for a grouped call
    its G groups (0: dense)."""

    m: int
    k: int
    n: int
    itemsize: int
    groups: int = 0

    @classmethod
    def of(cls, ba: BoundArguments) -> _Problem:
        x, weights = ba.arguments["x"], ba.arguments["weights"]
        n = (weights[0] if isinstance(weights, tuple) else weights).shape[-1]
        groups = ba.arguments["group_sizes"].shape[0] if "group_sizes" in ba.arguments else 0
        return cls(math.prod(x.shape[:-1]), x.shape[-1], n, jnp.dtype(x.dtype).itemsize,
                   groups)

    def vmem(self, config: Config) -> int:
        """VMEM of one grid step; a grouped call counts the residual tiles a
        differentiated call writes (the config is picked before that is known)."""
        if self.groups:
            return grouped_vmem_bytes(*self.blocks(config), self.itemsize, residuals=True)
        return vmem_bytes(*self.blocks(config), self.itemsize)

    def blocks(self, config: Config) -> tuple[int, int, int]:
        """`(block_m, block_n, block_k)` of the config on this call (whole axes where a
        block covers them)."""
        block_m = self.m if config.block_m >= self.m else config.block_m
        return block_m, lane_block(config.block_n, self.n), lane_block(config.block_k, self.k)

    def fits(self, config: Config, gen: TpuGeneration) -> bool:
        """Whether the config runs this call: its column block divides N, its
        contraction step divides K, and its blocks fit the generation's VMEM budget."""
        block_m, block_n, block_k = self.blocks(config)
        return (self.n % block_n == 0 and self.k % block_k == 0
                and self.vmem(config) <= gen.vmem_budget())

    def seconds(self, config: Config, gen: TpuGeneration) -> float:
        """A roofline estimate: each grid step takes the longer of its MXU work and its
        tiles' HBM traffic, plus the fixed cost of a step, and the first step's loads
        are exposed (no step before them hides them). MXU work is counted in whole
        `mxu` x `mxu` passes (a 128-wide tile half-fills v6e's 256-wide MXU), and row
        blocks that overhang M compute their padding too. A grouped call counts a row
        block per group on top of M's (a block straddling a group boundary is computed
        once per group it holds: the worst case), so taller blocks waste more."""
        block_m, block_n, block_k = self.blocks(config)
        row_tiles = -(-self.m // block_m) + self.groups
        steps = row_tiles * (self.n // block_n) * (self.k // block_k)
        rate = gen.bf16_tflops * 1e12 / (_F32_PASSES if self.itemsize == 4 else 1)
        mxu_n, mxu_k = (-(-b // gen.mxu) * gen.mxu for b in (block_n, block_k))
        compute = 2 * 2 * block_m * mxu_n * mxu_k / rate
        traffic = (block_m * block_k + 2 * block_k * block_n) * self.itemsize / (
            gen.hbm_gb_per_s * 1e9)
        return steps * (max(compute, traffic) + _mosaic_tpu.STEP_SECONDS) + traffic


def _fitting(ba: BoundArguments) -> dict[tuple[int, int, int], Config]:
    """The distinct tilings of the search space that run this call on the current
    generation, each with the smallest config that gives it."""
    problem = _Problem.of(ba)
    gen = _mosaic_tpu.current_generation()
    found: dict[tuple[int, int, int], Config] = {}
    for block_m, block_n, block_k in itertools.product(_BLOCKS, repeat=3):
        config = Config(block_m, block_n, block_k)
        if problem.fits(config, gen):
            found.setdefault(problem.blocks(config), config)
    return found


def _weights_form(weights: Any) -> tuple[jax.Array, jax.Array, int]:
    """`(gate matrix, up matrix, column offset of up)`: fused (K, 2, N) weights as one
    free (K, 2N) view, gate at column j and up at N + j."""
    if isinstance(weights, tuple):
        return weights[0], weights[1], 0
    k, _, n = weights.shape
    both = weights.reshape(k, 2 * n)
    return both, both, n


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicTpuGatedLinearUnit(MosaicTpuKernel, GatedLinearUnit):
    """The gated linear unit on TPUs, dense and grouped (bf16/f32, float32 accumulation
    and activation).

    `interpret=True` runs the kernel in the Pallas interpreter (any platform; tests).
    """

    config_cls: ClassVar[type] = Config
    grouped: ClassVar[bool] = True
    grouped_under_vmap: ClassVar[bool] = True

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        x, weights = ba.arguments["x"], ba.arguments["weights"]
        parts = weights if isinstance(weights, tuple) else (weights,)
        dtype = jnp.dtype(x.dtype)
        if dtype not in _DTYPES or any(jnp.dtype(w.dtype) != dtype for w in parts):
            raise NotImplementedError(
                f"the Mosaic TPU GLU needs bf16 or f32 x and weights of one dtype, got x of "
                f"{x.dtype} and weights of {', '.join(str(w.dtype) for w in parts)}")
        problem = _Problem.of(ba)
        if 0 in (problem.m, problem.k, problem.n) or (
                "group_sizes" in ba.arguments and problem.groups == 0):
            raise NotImplementedError("the Mosaic TPU GLU needs non-empty operands")
        if problem.k % _LANES or problem.n % _LANES:
            raise NotImplementedError(
                f"the Mosaic TPU GLU needs K ({problem.k}) and N ({problem.n}) multiples of "
                f"{_LANES} lanes")
        check_activation(ba.arguments["activation"])
        gen = _mosaic_tpu.current_generation()
        if self.config is not None and not problem.fits(self.config, gen):
            raise NotImplementedError(
                f"{self.config} does not fit the GLU {problem.m}x{problem.k}x{problem.n} on "
                f"{gen.name}: block_n must divide N, block_k must divide K, and the blocks "
                f"must fit the VMEM budget of {gen.vmem_budget()} bytes")

    def _fwd(self, x: jax.Array, weights: Any, *, activation: Callable[[Any], Any],
             precision: Any, config: Config, return_residuals: bool,
             group_sizes: jax.Array | None = None) -> tuple[jax.Array, Any]:
        del precision  # f32 runs at full precision
        if group_sizes is not None:
            return self._grouped(x, weights, group_sizes, activation=activation,
                                 config=config, residuals=return_residuals)
        *lead, k = x.shape
        w_gate, w_up, up_offset = _weights_form(weights)
        problem = _Problem(math.prod(lead), k, w_gate.shape[1] - up_offset,
                           jnp.dtype(x.dtype).itemsize)
        block_m, block_n, block_k = problem.blocks(config)
        out = glu_forward(x.reshape(problem.m, k), w_gate, w_up, up_offset=up_offset,
                          activation=activation, block_m=block_m, block_n=block_n,
                          block_k=block_k, interpret=self.pallas_interpret())
        return out.reshape(*lead, problem.n), None  # dense calls keep no residuals

    def _grouped(self, x: jax.Array, weights: Any, group_sizes: jax.Array, *,
                 activation: Callable[[Any], Any], config: Config,
                 residuals: bool) -> tuple[jax.Array, Any]:
        """A grouped call: `(out, residuals)` in the family's form (`_grouped.py`), the
        pre-activations `(gate, up)` for a pair of weights and one (M, 2N) `[gate | up]`
        for fused ones, which XLA concatenates from the kernel's two (M, N) arrays (the
        gradient slices it apart again; in one program XLA folds the two away)."""
        w_gate, up_offset, w_up = gate_up_weights(weights)
        m, k = x.shape
        problem = _Problem(m, k, w_gate.shape[2] - up_offset, jnp.dtype(x.dtype).itemsize,
                           group_sizes.shape[0])
        block_m, block_n, block_k = problem.blocks(config)

        def entries(x: jax.Array, sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array
                    ) -> tuple[jax.Array, ...]:
            rows = block_m
            if sizes.shape[0] > 1 and block_m == m and m % _ROW_ALIGN:
                # A block of one entry's M rows is no legal block of E * M rows: whole
                # sublane groups instead (as the ragged dot's row blocks always are).
                rows = -(-m // _ROW_ALIGN) * _ROW_ALIGN
            outs = grouped_glu_forward(
                x.reshape(-1, k), w_gate.reshape(-1, *w_gate.shape[2:]),
                w_up.reshape(-1, *w_up.shape[2:]),
                sizes, up_offset=up_offset, activation=activation, residuals=residuals,
                block_m=rows, block_n=block_n, block_k=block_k,
                interpret=self.pallas_interpret())
            return tuple(o.reshape(sizes.shape[0], m, -1) for o in outs)

        out, *pre = (o[0] for o in entry_folded(entries, 2)(
            x[None], group_sizes.astype(jnp.int32)[None], w_gate[None], w_up[None]))
        if not residuals:
            return out, None
        return out, tuple(pre) if isinstance(weights, tuple) else jnp.concatenate(pre, 1)

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        """The tiling the roofline model (`_Problem.seconds`) finds fastest on this
        generation among those that fit half its VMEM; ties go to the least VMEM."""
        problem = _Problem.of(ba)
        gen = _mosaic_tpu.current_generation()
        candidates = _fitting(ba)
        if not candidates:
            raise NotImplementedError(
                f"no Mosaic TPU GLU tiling fits {problem.m}x{problem.k}x{problem.n} on "
                f"{gen.name}: K and N must be multiples of {_LANES}")
        best = min(candidates, key=lambda blocks: (
            problem.seconds(candidates[blocks], gen), problem.vmem(candidates[blocks])))
        return candidates[best]

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        return set(_fitting(ba).values())
