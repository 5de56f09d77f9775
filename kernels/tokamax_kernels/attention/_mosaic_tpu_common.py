"""Shared pieces of the Pallas Mosaic TPU flash-attention kernels (forward, dK/dV, dQ).

The math helpers (base-2 logits, the soft cap's derivative, which key blocks a query
block can see) are the Triton kernels' (`_triton_common`): they are plain
`jax.numpy` on scalars and tiles. What is TPU-specific lives here: the (batch, heads,
seq, head_dim) layout the kernels read (a (block, head_dim) tile per head is a legal
TPU block; a head axis of 1 next to head_dim is not), padding to whole blocks, the
per-row lengths passed as scalar-prefetch operands, 2-D positional masks, and the fold
of `jax.vmap`s into the kernels' batch axis (`batch_folded`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tokamax_kernels import _mosaic_tpu
from tokamax_kernels.attention._flash_tiles import KernelSpec, round_up

# Blocks are multiples of 16 rows (bf16 packs two rows per 32-bit sublane).
ROW_ALIGN = 16
MAX_HEAD_DIM = 256
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """`block_q` query rows x `block_k` keys per grid step (multiples of 16)."""

    block_q: int = 128
    block_k: int = 128

    def __post_init__(self) -> None:
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value <= 0 or value % ROW_ALIGN:
                raise ValueError(f"{type(self).__name__}.{name} must be a positive multiple of "
                                 f"{ROW_ALIGN}, got {value}")

    def clamped(self, seq_q: int, seq_k: int) -> BlockConfig:
        """No block longer than its (16-row padded) sequence."""
        return BlockConfig(min(self.block_q, round_up(seq_q, ROW_ALIGN)),
                           min(self.block_k, round_up(seq_k, ROW_ALIGN)))


def heuristics_config(ba: Any) -> BlockConfig:
    """Query blocks two MXUs tall and key blocks one MXU wide per step (256 x 128 on
    v4/v5, 512 x 256 on v6e), halved past head_dim 128 so the f32 accumulator and the
    logits tile stay within VMEM; clamped to the sequences."""
    q, k = ba.arguments["query"], ba.arguments["key"]
    mxu = _mosaic_tpu.current_generation().mxu
    shrink = 2 if q.shape[-1] > 128 else 1
    return BlockConfig(2 * mxu // shrink, mxu // shrink).clamped(q.shape[1], k.shape[1])


def search_space(ba: Any) -> set[BlockConfig]:
    q, k = ba.arguments["query"], ba.arguments["key"]
    return {BlockConfig(bq, bk).clamped(q.shape[1], k.shape[1])
            for bq, bk in itertools.product((128, 256, 512), (128, 256, 512))}


def check_inputs(ba: Any, what: str) -> None:
    """`NotImplementedError` for what the TPU kernels do not take (so `None` falls back)."""
    args = ba.arguments
    query = args["query"]
    if jnp.dtype(query.dtype) not in DTYPES:
        raise NotImplementedError(f"{what} supports bf16 and f32, not {query.dtype}")
    if query.shape[-1] > MAX_HEAD_DIM:
        raise NotImplementedError(f"{what} supports head_dim <= {MAX_HEAD_DIM}, "
                                  f"got {query.shape[-1]}")
    for name in ("bias", "mask"):
        if args[name] is not None:
            raise NotImplementedError(f"{what} takes no {name} (use lengths, causal or a "
                                      "local window, or another implementation)")
    if 0 in query.shape or 0 in args["key"].shape:
        raise NotImplementedError(f"{what} needs non-empty inputs")


def batch_folded(kernel: Callable[..., Any]) -> Callable[..., tuple[jax.Array, ...]]:
    """`kernel` (arrays that share a leading batch axis in, a tuple of such arrays out,
    batch rows independent) with every `jax.vmap` around it folded into that axis.

    Pallas would batch a call itself by one more grid axis, but only while the
    scalar-prefetch lengths are not mapped; mapped ones (per-example lengths) make it
    run one kernel per entry in a serial loop. The batch is already a parallel grid
    axis: a (V, B, ...) operand is read as (V * B, ...), one launch for any vmap, and
    the reshape is free (the layout transposition copies the operands anyway). An
    operand the vmap does not map (shared keys, default lengths) is broadcast.
    """
    folded = jax.custom_batching.custom_vmap(lambda *args: tuple(kernel(*args)))

    @folded.def_vmap
    def _fold(axis_size: int, in_batched: list[bool], *args: jax.Array
              ) -> tuple[tuple[jax.Array, ...], tuple[bool, ...]]:
        args = tuple(x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                     for x, batched in zip(args, in_batched, strict=True))
        outs = folded(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in args))
        return (tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs),
                (True,) * len(outs))

    return folded


def kernel_spec(arguments: dict[str, Any], seq_q: int, seq_k: int) -> KernelSpec:
    """The kernels' static view of the family's arguments (causal = a right window of 0)."""
    window = arguments["local_window_size"]
    left, right = window if window is not None else (None, None)
    if arguments["is_causal"]:
        right = 0 if right is None else min(right, 0)
    return KernelSpec(
        scale=arguments["scale"], left=left, right=right, offset=0,
        soft_cap=arguments["logits_soft_cap"], seq_q=seq_q, seq_k=seq_k, has_bias=False,
        has_mask=False, has_q_lengths=arguments["query_seq_lengths"] is not None,
        has_kv_lengths=arguments["key_value_seq_lengths"] is not None,
        precision=arguments["precision"])


def to_kernel_layout(x: jax.Array, seq: int) -> jax.Array:
    """(B, S, H, D) -> (B, H, seq, D), the sequence zero-padded to `seq`."""
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, seq - x.shape[2]), (0, 0)))


def from_kernel_layout(x: jax.Array, seq: int) -> jax.Array:
    """(B, H, S_padded, D) -> (B, seq, H, D)."""
    return jnp.swapaxes(x[:, :, :seq], 1, 2)


def lengths(x: jax.Array | None, batch: int, seq: int) -> jax.Array:
    """Per-row valid lengths, int32, clipped to `seq` (`seq` when not given)."""
    if x is None:
        return jnp.full((batch,), seq, jnp.int32)
    return jnp.clip(x.astype(jnp.int32), 0, seq)


def visible(spec: KernelSpec, r0: Any, c0: Any, shape: tuple[int, ...], kv_len: Any,
            q_len: Any) -> jax.Array:
    """Which of the (rows from `r0`) x (keys from `c0`) tile is seen: window, causal, the
    key length, and the query length (rows past it see nothing)."""
    rows = r0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = c0 + lax.broadcasted_iota(jnp.int32, shape, 1)
    ok = (cols < kv_len) & (rows < q_len)
    diff = cols - rows
    if spec.right is not None:
        ok = ok & (diff <= spec.right)
    if spec.left is not None:
        ok = ok & (diff >= -spec.left)
    return ok


def dot(spec: KernelSpec, a: jax.Array, b: jax.Array, contracting: tuple[int, int]
        ) -> jax.Array:
    """`a . b` over the given axes, accumulated in float32."""
    dims = (((contracting[0],), (contracting[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=spec.precision,
                           preferred_element_type=jnp.float32)


def clamp_block(index: Any, lo: Any, hi: Any) -> Any:
    """A block index moved into `[lo, hi)` (`lo` when empty): steps outside the visible
    range map to a block already in VMEM, so skipping them costs no copy."""
    return jnp.maximum(jnp.minimum(index, hi - 1), lo)
