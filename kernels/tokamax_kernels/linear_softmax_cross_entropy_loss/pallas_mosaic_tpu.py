"""`PallasMosaicTpuLinearSoftmaxCrossEntropyLoss` and its VJP: the LM-head loss on TPUs.

The kernels are in `_mosaic_tpu_kernels.py` (forward, dx, dweights: tiles of logits
built over H blocks in VMEM, never the (tokens, V) logits). This module flattens the
call to (T, H) tokens, checks what the kernels take, picks their tiles per TPU
generation (`tokamax_kernels._mosaic_tpu`), and leaves the per-token loss and the
reduction to XLA, as the family's other implementations do (`base.py`).

Under `jax.vmap` the kernels are batched by Pallas (one more, parallel, grid axis).
Nothing here has been timed on a TPU: the heuristics follow the generations' public
VMEM sizes and roofline figures, and `implementation=None` runs these kernels only
where a measurement on a TPU shows them faster than the XLA paths.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_kernels import _mosaic_tpu
from tokamax_kernels._mosaic_tpu import MosaicTpuKernel, TpuGeneration, lane_block
from tokamax_kernels.linear_softmax_cross_entropy_loss._mosaic_tpu_kernels import (
    Tiling,
    lce_dweights,
    lce_dx,
    lce_forward,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.base import (
    LinearSoftmaxCrossEntropyLoss,
    LinearSoftmaxCrossEntropyLossVjp,
    reduce_losses,
    token_cotangent,
    token_losses,
)
from tokamax_pass.core import BoundArguments, Op, Target

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_LANES = 128
_ROW_ALIGN = 16  # token blocks: 8 sublanes, 16 for bf16 (two rows per 32-bit word)
_TOKEN_BLOCKS = (128, 256, 512, 1024)
_VOCAB_BLOCKS = (128, 256, 512, 1024, 2048, 4096)
_H_BLOCKS = (256, 512, 1024)
_HEURISTIC_H_BLOCK = 512


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTpuLossConfig:
    """Tiles of the TPU kernels: `block_tokens` x `block_vocab` logits per tile, built over
    H in `block_h` steps. Clamped to the shape (a block larger than its axis covers it).

    Keyword-only: upstream Tokamax's config of this TPU kernel (`ops.tpu`'s
    `LinearSoftmaxCrossEntropyLossConfig`) orders its blocks tokens, H, vocab, so a
    positional call would swap the H and vocab blocks."""

    block_tokens: int
    block_vocab: int
    block_h: int

    def __post_init__(self) -> None:
        alignments = {"block_tokens": _ROW_ALIGN, "block_vocab": _LANES, "block_h": _LANES}
        for name, align in alignments.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or (
                    value % align):
                raise ValueError(f"MosaicTpuLossConfig: {name} must be a positive multiple of "
                                 f"{align}, got {value!r}")


def _sizes(ba: BoundArguments) -> tuple[int, int, int, Any]:
    """(tokens, H, V, dtype) of a bound call (forward or VJP)."""
    hidden, vocab = ba.arguments["weights"].shape
    return math.prod(ba.arguments["labels"].shape), hidden, vocab, ba.arguments["x"].dtype


def tiling(config: MosaicTpuLossConfig, tokens: int, hidden: int, vocab: int, dtype: Any,
           cap: float | None = None) -> Tiling:
    """The kernels' static sizes: token and vocabulary blocks clamped to the aligned axis
    (a partial last block is masked), an H block of the whole H when it covers it."""
    return Tiling(tokens=tokens, hidden=hidden, vocab=vocab,
                  block_t=min(config.block_tokens, _round_up(tokens, _ROW_ALIGN)),
                  block_h=lane_block(config.block_h, hidden),
                  block_v=min(config.block_vocab, _round_up(vocab, _LANES)),
                  cap=cap, dtype=jnp.dtype(dtype))


def _vmem(tl: Tiling, backward: bool) -> int:
    return max(tl.dx_vmem(), tl.dw_vmem()) if backward else tl.forward_vmem()


def _fits(tl: Tiling, backward: bool, gen: TpuGeneration) -> bool:
    return _vmem(tl, backward) <= gen.vmem_budget()


def _model_seconds(tl: Tiling, backward: bool, gen: TpuGeneration) -> float:
    """A roofline estimate: the padded tiles' FLOPs at the MXU peak or their HBM traffic
    (x read once per vocabulary block, w once per token block) at the HBM bandwidth,
    whichever is longer, plus a fixed cost per grid step. The backward is two kernels
    (dx, dweights), each with twice the forward's FLOPs and grid steps."""
    padded_t, padded_v = tl.nt * tl.block_t, tl.nv * tl.block_v
    flops = 2 * padded_t * tl.hidden * padded_v * (2 if backward else 1)
    traffic = (tl.nv * tl.tokens + tl.nt * tl.vocab) * tl.hidden * tl.itemsize
    peak = gen.bf16_tflops * 1e12 / (1 if tl.itemsize == 2 else 6)  # f32 HIGHEST: 6 passes
    steps = tl.nt * tl.nv * tl.nh * (2 if backward else 1)
    seconds = (max(flops / peak, traffic / (gen.hbm_gb_per_s * 1e9))
               + steps * _mosaic_tpu.STEP_SECONDS)
    return seconds * (2 if backward else 1)


_SEARCH_SPACE = frozenset(MosaicTpuLossConfig(block_tokens=bt, block_vocab=bv, block_h=bh)
                          for bt, bv, bh in
                          itertools.product(_TOKEN_BLOCKS, _VOCAB_BLOCKS, _H_BLOCKS))


def _fitting(ba: BoundArguments, backward: bool,
             configs: Iterable[MosaicTpuLossConfig]) -> dict[MosaicTpuLossConfig, Tiling]:
    """The configs whose tiles (clamped to the call, one config per distinct tiling)
    fit the generation's VMEM budget."""
    gen = _mosaic_tpu.current_generation()
    tokens, hidden, vocab, dtype = _sizes(ba)
    found: dict[Tiling, MosaicTpuLossConfig] = {}
    for config in sorted(configs, key=dataclasses.astuple):
        tl = tiling(config, tokens, hidden, vocab, dtype)
        if _fits(tl, backward, gen):
            found.setdefault(tl, MosaicTpuLossConfig(
                block_tokens=tl.block_t, block_vocab=tl.block_v,
                block_h=_round_up(tl.block_h, _LANES)))
    return {config: tl for tl, config in found.items()}


def heuristics_config(ba: BoundArguments, backward: bool) -> MosaicTpuLossConfig:
    """H in 512-deep steps (the whole H when smaller), and the token x vocabulary tile
    the roofline model (`_model_seconds`) finds fastest on this generation among those
    whose blocks fit half its VMEM (for the VJP: the dx and dweights kernels, with their
    (block, H) accumulators); ties go to the smaller tile."""
    gen = _mosaic_tpu.current_generation()
    configs = {MosaicTpuLossConfig(block_tokens=bt, block_vocab=bv, block_h=_HEURISTIC_H_BLOCK)
               for bt, bv in itertools.product(_TOKEN_BLOCKS, _VOCAB_BLOCKS)}
    candidates = _fitting(ba, backward, configs) or _fitting(ba, backward, _SEARCH_SPACE)
    if not candidates:
        tokens, hidden, vocab, _ = _sizes(ba)
        raise NotImplementedError(
            f"no TPU tiling of the loss over (T, H, V) = ({tokens}, {hidden}, {vocab}) fits "
            f"the {gen.name} VMEM budget of {gen.vmem_budget()} bytes")
    return min(candidates, key=lambda c: (
        _model_seconds(candidates[c], backward, gen), c.block_tokens * c.block_vocab,
        dataclasses.astuple(c)))


def _check(op: Op, ba: BoundArguments, backward: bool) -> None:
    """`NotImplementedError` for calls the kernels do not take (so `None` falls back)."""
    x = ba.arguments["x"]
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise NotImplementedError(
            f"{type(op).__name__} supports bf16 and f32 x and weights, not {x.dtype}")
    if x.shape[-1] == 0:
        # No H block fits (the config's blocks are positive multiples of 128).
        raise NotImplementedError(f"{type(op).__name__} needs x with a hidden axis, got H = 0")
    config = op.config
    if config is not None:
        tl = tiling(config, *_sizes(ba))
        gen = _mosaic_tpu.current_generation()
        if not _fits(tl, backward, gen):
            raise NotImplementedError(
                f"{config} needs {_vmem(tl, backward)} bytes of VMEM, more than the "
                f"{gen.name} budget of {gen.vmem_budget()}: use smaller blocks")


def _flat(x: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x as (T, H) and labels as int32 (T, 1)."""
    tokens = math.prod(labels.shape)
    return x.reshape(tokens, x.shape[-1]), labels.reshape(tokens, 1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicTpuLinearSoftmaxCrossEntropyLoss(MosaicTpuKernel, LinearSoftmaxCrossEntropyLoss):
    """The LM-head loss on TPUs (bf16/f32, float32 logits and statistics, any T and V);
    memory O(one tile) beyond the inputs. `interpret=True` runs it on any platform."""

    config_cls: ClassVar[type] = MosaicTpuLossConfig

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        _check(self, ba, backward=False)

    def _fwd(self, x: jax.Array, labels: jax.Array, weights: jax.Array, *, reduction: str,
             logits_soft_cap: float | None, precision: Any, config: MosaicTpuLossConfig,
             return_residuals: bool) -> tuple[jax.Array, Any]:
        del precision  # bf16 products are exact in f32; f32 inputs run at full precision
        flat_x, flat_labels = _flat(x, labels)
        tl = tiling(config, flat_x.shape[0], weights.shape[0], weights.shape[1], x.dtype,
                    logits_soft_cap)
        lse, picked = lce_forward(flat_x, flat_labels, weights, tl=tl,
                                  interpret=self.pallas_interpret())
        lse, picked = lse.reshape(labels.shape), picked.reshape(labels.shape)
        losses = token_losses(lse, picked, labels, weights.shape[1])
        return reduce_losses(losses, labels, reduction), (lse,) if return_residuals else None

    def _get_heuristics_config(self, ba: BoundArguments) -> MosaicTpuLossConfig:
        return heuristics_config(ba, backward=False)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[MosaicTpuLossConfig]:
        return set(_fitting(ba, False, _SEARCH_SPACE))

    def _default_vjp(self) -> Op:
        return PallasMosaicTpuLinearSoftmaxCrossEntropyLossVjp(interpret=self.interpret)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicTpuLinearSoftmaxCrossEntropyLossVjp(MosaicTpuKernel,
                                                      LinearSoftmaxCrossEntropyLossVjp):
    """dx and dweights on TPUs from the family's `(lse,)` residual (any forward's): two
    kernels, each recomputing the logits tiles (8 T H V FLOPs in all, the XLA VJP 6)."""

    config_cls: ClassVar[type] = MosaicTpuLossConfig

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        _check(self, ba, backward=True)

    def _fwd(self, residuals: Any, out: Any, dout: jax.Array, *, config: MosaicTpuLossConfig,
             return_residuals: bool, x: jax.Array, labels: jax.Array, weights: jax.Array,
             reduction: str, logits_soft_cap: float | None,
             precision: Any) -> tuple[dict[str, Any], None]:
        del out, return_residuals, precision
        (lse,) = residuals
        flat_x, flat_labels = _flat(x, labels)
        tokens = flat_x.shape[0]
        tl = tiling(config, tokens, weights.shape[0], weights.shape[1], x.dtype, logits_soft_cap)
        g = token_cotangent(dout, labels, reduction).reshape(tokens, 1)
        operands = (flat_x, flat_labels, weights, lse.reshape(tokens, 1).astype(jnp.float32), g)
        interpret = self.pallas_interpret()
        dx = lce_dx(*operands, tl=tl, interpret=interpret)
        dweights = lce_dweights(*operands, tl=tl, interpret=interpret)
        return {"x": dx.reshape(x.shape), "weights": dweights}, None

    def _get_heuristics_config(self, ba: BoundArguments) -> MosaicTpuLossConfig:
        return heuristics_config(ba, backward=True)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[MosaicTpuLossConfig]:
        return set(_fitting(ba, True, _SEARCH_SPACE))
