"""What the Mosaic GPU loss and its VJP share: the config, the input checks, the tiling
of a call, and `jax.vmap` support for the kernels.

The kernels (`_mosaic_gpu_kernels.py`) take (T, H) tokens with T >= block_tokens and
a vocabulary of at least block_vocab; `padded_rows` pads the few-token case (cheap: the
tokens are fewer than one block) and the heuristics clamp block_vocab to V.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tokamax_kernels._gpu import sm_count
from tokamax_kernels.linear_softmax_cross_entropy_loss._mosaic_gpu_kernels import (
    NUM_COMPUTE_WGS,
    Tiles,
)
from tokamax_pass.core import BoundArguments, Target

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Usable shared memory per block on Hopper (227 KiB), less room for barriers, the small
# per-row buffers and the 1 KiB alignment of swizzled tiles.
SMEM_BYTES = 227 * 1024 - 6144
# float32 accumulator elements per compute warpgroup that stay in registers with room for
# the epilogue's temporaries (128 registers a thread of 128).
MAX_ACC_ELEMENTS = 128 * 128
ROWS_PER_WG = 64  # wgmma tiles rows by 64
# The weights' (H, V) TMA tiles are swizzled 128-byte rows (64 16-bit entries): Mosaic GPU
# tiles the whole array so, and V must be a multiple of them. x's rows tile by 8.
VOCAB_ALIGN = 64
MIN_BLOCK_VOCAB = 64
ROW_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class MosaicGpuLossConfig:
    """Tiles of the Mosaic GPU LM-head loss.

    Attributes:
      block_tokens: tokens per block, split between two compute warpgroups (a multiple of
        128).
      block_vocab: vocabulary entries per logits tile (a multiple of 64, at most 256).
      block_h: H per pipeline step (a multiple of 64): the K-loop's step.
      num_stages: SMEM slots in the x / weights ring (>= 2): how far the TMA runs ahead.
      chunk_vocab: the backward's vocabulary chunk (a multiple of block_vocab): its
        dlogits (tokens, chunk_vocab) is the largest temporary of the backward.
      dx_token_chunk: 0 (default): dx is accumulated in float32 over the vocabulary chunks
        (a tokens x H float32 temporary, one logits recompute). N > 0 (a multiple of
        block_tokens): the vocabulary pass computes dweights only and a second pass over
        chunks of N tokens computes dx from (N, V) dlogits slabs: no float32 accumulator,
        one more logits recompute (slower: for the least memory).
    """

    block_tokens: int = 128
    block_vocab: int = 256
    block_h: int = 64
    num_stages: int = 3
    chunk_vocab: int = 2048
    dx_token_chunk: int = 0

    def __post_init__(self) -> None:
        for name in dataclasses.fields(self):
            value = getattr(self, name.name)
            lowest = 0 if name.name == "dx_token_chunk" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ValueError(f"MosaicGpuLossConfig: {name.name} must be an int >= "
                                 f"{lowest}, got {value!r}")
        rows = NUM_COMPUTE_WGS * ROWS_PER_WG
        if self.block_tokens % rows:
            raise ValueError(f"MosaicGpuLossConfig: block_tokens={self.block_tokens} must be "
                             f"a multiple of {rows}")
        if self.block_vocab % MIN_BLOCK_VOCAB or self.block_vocab > 256:
            raise ValueError(f"MosaicGpuLossConfig: block_vocab={self.block_vocab} must be a "
                             f"multiple of {MIN_BLOCK_VOCAB} and at most 256 (wgmma N)")
        if self.block_h % 64:
            raise ValueError(f"MosaicGpuLossConfig: block_h={self.block_h} must be a "
                             f"multiple of 64")
        if self.num_stages < 2:
            raise ValueError(f"MosaicGpuLossConfig: num_stages={self.num_stages} must be >= 2")
        if self.chunk_vocab % self.block_vocab:
            raise ValueError(f"MosaicGpuLossConfig: chunk_vocab={self.chunk_vocab} must be a "
                             f"multiple of block_vocab={self.block_vocab}")
        if self.dx_token_chunk % self.block_tokens:
            raise ValueError(f"MosaicGpuLossConfig: dx_token_chunk={self.dx_token_chunk} must "
                             f"be a multiple of block_tokens={self.block_tokens}")

    @property
    def tiles(self) -> Tiles:
        return Tiles(self.block_tokens, self.block_vocab, self.block_h, self.num_stages)

    def smem_bytes(self, itemsize: int, *, backward: bool) -> int:
        """The ring's SMEM, plus the backward's output tile."""
        ring = self.num_stages * (self.block_tokens + self.block_vocab) * self.block_h
        out = self.block_tokens * self.block_vocab if backward else 0
        return (ring + out) * itemsize


def fits(config: MosaicGpuLossConfig, hidden: int, vocab: int, *, backward: bool) -> bool:
    """Whether `config` tiles H and V and fits in SMEM and registers."""
    rows = config.block_tokens // NUM_COMPUTE_WGS
    return (hidden % config.block_h == 0 and config.block_vocab <= vocab
            and rows * config.block_vocab <= MAX_ACC_ELEMENTS
            and config.smem_bytes(2, backward=backward) <= SMEM_BYTES)


def check_inputs(ba: BoundArguments, target: Target | None, config: Any, what: str, *,
                 backward: bool) -> None:
    """`NotImplementedError` for what the Mosaic GPU kernels do not cover."""
    if target is not None:
        if target.platform != "cuda":
            raise NotImplementedError(f"{what} runs on CUDA GPUs only, not on {target.platform};"
                                      f" use implementation='xla_chunked'")
        if not target.is_hopper:  # a target of no known device kind may be any GPU
            raise NotImplementedError(
                f"{what} needs a Hopper GPU (sm_90: wgmma, TMA), got "
                f"{target.device_kind or 'a CUDA target of no known device kind'!r}; use "
                f"implementation='xla_chunked'")
    args = ba.arguments
    x, weights = args["x"], args["weights"]
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise NotImplementedError(f"{what} supports bf16/f16 inputs, got {x.dtype}; use "
                                  f"implementation='xla_chunked' for {x.dtype}")
    if args["precision"] not in (None, jax.lax.Precision.DEFAULT,
                                 (jax.lax.Precision.DEFAULT, jax.lax.Precision.DEFAULT)):
        raise NotImplementedError(f"{what} supports the default precision only (bf16/f16 "
                                  f"products, float32 accumulation), got {args['precision']}")
    hidden, vocab = weights.shape
    if hidden % 64:
        raise NotImplementedError(f"{what}: H={hidden} must be a multiple of 64 (block_h)")
    if vocab % VOCAB_ALIGN:
        raise NotImplementedError(
            f"{what}: V={vocab} must be a multiple of {VOCAB_ALIGN} (the weights' swizzled TMA "
            f"tiles); pad the weights' columns (labels never name the padding) or use "
            f"implementation='xla_chunked'")
    if config is not None and not fits(config, hidden, vocab, backward=backward):
        raise NotImplementedError(f"{what}: {config} does not fit H={hidden}, V={vocab} "
                                  f"(H must be a multiple of block_h, block_vocab <= V)")


def heuristic_config(hidden: int, vocab: int) -> MosaicGpuLossConfig:
    """128 x 256 logits tiles (two warpgroups of 64 rows), 64-deep steps, 3 stages, 2048-wide
    backward chunks: the fastest of the search space on the H200 at 16384 x 4096 x 128256
    (`benchmarks/probes/lce_probe.py sweep`), forward and forward + backward, where
    1024-wide chunks trailed 2048 and 4096 (a (16384, 2048) bf16 dlogits slab is 64 MiB).
    One config for both directions: it fits the backward's SMEM (the ring and an output
    tile)."""
    for block_vocab in (256, 128, 64):
        for stages in (3, 2):
            config = MosaicGpuLossConfig(block_tokens=128, block_vocab=block_vocab, block_h=64,
                                         num_stages=stages, chunk_vocab=2048)
            if fits(config, hidden, vocab, backward=True):
                return config
    raise NotImplementedError(f"no Mosaic GPU loss config fits H={hidden}, V={vocab}")


def search_space(hidden: int, vocab: int, *, backward: bool) -> set[MosaicGpuLossConfig]:
    """A small space: tile shapes, step depth, stages and (backward) chunk width."""
    configs = set()
    for bt, bv, bh, stages in ((128, 256, 64, 3), (128, 256, 64, 4), (256, 128, 64, 4),
                               (128, 128, 64, 4), (128, 128, 128, 3), (128, 256, 128, 2),
                               (128, 64, 64, 4)):
        for chunk in ((1024, 2048, 4096) if backward else (2048,)):
            config = MosaicGpuLossConfig(block_tokens=bt, block_vocab=bv, block_h=bh,
                                         num_stages=stages, chunk_vocab=max(bv, chunk))
            if fits(config, hidden, vocab, backward=backward):
                configs.add(config)
    return configs


def vocab_splits(tokens: int, vocab_blocks: int, block_tokens: int) -> int:
    """Vocabulary splits that give every SM a block when the tokens alone do not."""
    token_blocks = math.ceil(tokens / block_tokens)
    splits = max(1, min(vocab_blocks, math.ceil(sm_count() / token_blocks)))
    return math.ceil(vocab_blocks / math.ceil(vocab_blocks / splits))  # none left empty


def padded_rows(block_tokens: int, *arrays: jax.Array, fill: tuple[Any, ...]) -> list[jax.Array]:
    """Per-token arrays (T, ...) padded to at least `block_tokens` rows and a multiple of 8
    (the TMA tiling of x's rows); no copy when T already is both."""
    tokens = arrays[0].shape[0]
    padded = max(block_tokens, -(-tokens // ROW_ALIGN) * ROW_ALIGN)
    if padded == tokens:
        return list(arrays)
    return [jnp.concatenate([a, jnp.full((padded - tokens, *a.shape[1:]), f, a.dtype)])
            for a, f in zip(arrays, fill, strict=True)]


def map_batch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` of arrays, under `jax.vmap` run once per batch entry (`lax.map`): a Pallas
    Mosaic GPU kernel has no batching rule of its own."""
    mapped = jax.custom_batching.custom_vmap(fn)

    @mapped.def_vmap
    def _rule(axis_size: int, in_batched: Any, *args: Any) -> tuple[Any, Any]:
        del axis_size
        batched = [a for a, b in zip(args, in_batched, strict=True) if b]

        def one(entries: list[Any]) -> Any:
            it = iter(entries)
            return mapped(*(next(it) if b else a for a, b in zip(args, in_batched, strict=True)))

        outs = lax.map(one, batched)
        return outs, jax.tree.map(lambda _: True, outs)

    return mapped


def fold_tokens(fn: Callable[..., Any], per_token: int) -> Callable[..., Any]:
    """`fn` whose first `per_token` arguments and every output are per-token arrays (tokens
    on the leading axis), the rest shared: under a `jax.vmap` that maps only per-token
    arguments, the batch folds into the tokens (one kernel launch); otherwise `map_batch`."""
    mapped = jax.custom_batching.custom_vmap(fn)
    fallback = map_batch(fn)

    @mapped.def_vmap
    def _rule(axis_size: int, in_batched: Any, *args: Any) -> tuple[Any, Any]:
        if any(in_batched[per_token:]):
            outs = jax.vmap(fallback, in_axes=[0 if b else None for b in in_batched])(*args)
            return outs, jax.tree.map(lambda _: True, outs)
        tokens = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
                  for a, b in zip(args[:per_token], in_batched, strict=False)]
        flat = [a.reshape(-1, *a.shape[2:]) for a in tokens]
        outs = mapped(*flat, *args[per_token:])
        outs = jax.tree.map(lambda o: o.reshape(axis_size, -1, *o.shape[1:]), outs)
        return outs, jax.tree.map(lambda _: True, outs)

    return mapped
