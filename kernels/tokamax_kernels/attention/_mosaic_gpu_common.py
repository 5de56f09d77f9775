"""Shared pieces of the Mosaic GPU (Hopper) attention kernels: configs, limits, SMEM
layouts, input checks.

The forward kernel and the two backward kernels share one structure: a few compute
warpgroups (128 threads each, one `wgmma` tile of rows each) and one memory warpgroup
that streams the other operand's tiles through a ring of SMEM slots with TMA copies.
Each slot has a "ready" barrier (the TMA completes it) and a "consumed" barrier (every
compute warpgroup arrives once it is done with the slot).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from tokamax_kernels._gpu import sm_count
from tokamax_kernels.attention import _window
from tokamax_pass.core import Target

# Register budget of the memory warpgroup; the compute warpgroups take the rest.
MEMORY_REGISTERS = 40
COMPUTE_REGISTERS = 232
# Usable shared memory per block on Hopper (227 KiB), minus room for barriers and the
# 1 KiB alignment of swizzled tiles (Mosaic GPU adds about 2.7 KiB to the tiles' sum).
SMEM_BYTES = 227 * 1024 - 4096
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
HEAD_DIMS = (64, 128, 256)
# The widest head dim a backward warpgroup accumulates whole; wider ones are split in
# halves (`splits_head_dim`).
WHOLE_HEAD_DIM = 128


def splits_head_dim(head_dim: int) -> bool:
    """Whether the backward kernels split this head dim in two halves of columns (d256):
    dk and dv of 64 key rows at d256 would take 256 float32 registers a thread, over the
    hardware's 255, so each of two warpgroups accumulates one half
    (`_mosaic_gpu_head_dim_split.py`)."""
    return head_dim > WHOLE_HEAD_DIM


def compute_wg_choices(batch_heads: int, *seq_lens: int) -> tuple[int, ...]:
    """Compute warpgroups worth tuning for a grid over `batch_heads` x each length.

    On the H200 one warpgroup ran 1.3-1.6x slower than two ping-ponging ones in every
    config of the seed `f_grad` autotune, whose grids fill every SM many times over; one
    is a candidate only when two, at the smallest tiles (2 x 64 rows), leave SMs idle.
    """
    blocks_with_two = batch_heads * min(seq_lens) // 128
    return (2,) if blocks_with_two >= sm_count() else (1, 2)


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
    """Tiles of the forward kernel.

    Attributes:
      block_q: query rows per compute warpgroup (multiple of 64).
      block_kv: key/value rows per pipeline step (multiple of 64).
      num_stages: SMEM slots in the K/V ring (>= 2): how far the TMA runs ahead.
      compute_wgs: compute warpgroups per block (1 or 2); with 2 they ping-pong
        (one runs its softmax while the other's `wgmma` runs).
      softmax_overlap: FlashAttention-3's intra-warpgroup overlap: each step issues the
        next tile's Q K^T with the previous tile's P V before its softmax, so a
        warpgroup's softmax also overlaps its own matmuls (one more score tile of
        registers). Not with a local window or key lengths (`OVERLAP_LIMITS`).
      longest_first: causal calls launch the query blocks last to first
        (`query_block`), so the blocks with the most K/V tiles start first and the
        short ones fill the tail (FlashAttention-3's order); a no-op without a causal
        mask.
      persistent: one block per SM, each walking a sequence of (batch, head, query
        block) tiles (`_mosaic_gpu_tile_order`: L2 sections of heads, longest first with
        `longest_first`, tiles of differing lengths handed out by a balanced schedule)
        with its K/V ring carried from tile to tile, so the next
        tile's K/V loads overlap this tile's last steps and output store, and no block
        launch or pipeline fill sits between tiles (FlashAttention-3's and cuDNN's
        forwards are persistent).
      prefetch_query: persistent only: each compute warpgroup keeps two SMEM buffers
        for its Q tile (and the output that replaces it) and loads the next tile's Q
        into the other one during this tile's first K/V step, so a tile starts without
        waiting for the last tile's output store and its own Q load.
      group_in_block: GQA/MQA: the compute warpgroups of a block run `compute_wgs` query
        heads of one K/V head on the same `block_q` query rows (`query_heads_per_block`),
        so each K/V tile is loaded once for all of them and, under a causal mask, every
        warpgroup of the block walks the same K/V tiles (in a block of `compute_wgs` row
        tiles of one head, the warpgroups on the earlier rows drain the diagonal's last
        K/V tiles unused where those tiles are narrower than the block's rows). Needs query heads
        per K/V head divisible by `compute_wgs`.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    compute_wgs: int = 2
    softmax_overlap: bool = False
    longest_first: bool = False
    persistent: bool = False
    group_in_block: bool = False
    prefetch_query: bool = False

    def __post_init__(self) -> None:
        _check_tiles(self.block_q, self.block_kv, self.num_stages, self.compute_wgs)
        if not isinstance(self.softmax_overlap, bool):
            raise ValueError(f"softmax_overlap must be a bool, got {self.softmax_overlap!r}")
        _check_bool("longest_first", self.longest_first)
        _check_bool("persistent", self.persistent)
        _check_bool("group_in_block", self.group_in_block)
        _check_bool("prefetch_query", self.prefetch_query)
        if self.prefetch_query and not self.persistent:
            raise ValueError("prefetch_query loads the next tile's Q of a persistent block: "
                             "set persistent=True, or prefetch_query=False")

    @property
    def query_heads_per_block(self) -> int:
        """Query heads a block runs: one per compute warpgroup with `group_in_block`."""
        return self.compute_wgs if self.group_in_block else 1

    @property
    def query_buffers(self) -> int:
        """SMEM buffers of each compute warpgroup's Q tile: two with `prefetch_query`."""
        return 2 if self.prefetch_query else 1

    @property
    def rows_per_block(self) -> int:
        """Query rows of each head a block runs: `block_q` with `group_in_block` (every
        warpgroup its own head), else one `block_q` tile per compute warpgroup."""
        return self.block_q if self.group_in_block else self.compute_wgs * self.block_q


OVERLAP_LIMITS = ("the Mosaic attention forward's softmax_overlap takes no local window and "
                  "no key lengths: use a config with softmax_overlap=False")

# How the backward computes dq (`MosaicAttentionVjpConfig.dq_accumulation`):
# "separate": a dq kernel of its own recomputes the scores (seven `wgmma`s a tile pair in
#   all, no atomics); "ordered": the dk/dv kernel also multiplies each tile's dS by K and
#   adds the float32 share into dq with TMA reduce-adds, key blocks taking turns per
#   query tile (five `wgmma`s; a semaphore per query tile fixes the order, so reruns are
#   bitwise equal); "atomic": the same adds in whatever order they land (not
#   reproducible: only when the user names it).
DQ_ACCUMULATIONS = ("separate", "ordered", "atomic")
REPRODUCIBLE_DQ_ACCUMULATIONS = ("separate", "ordered")


@dataclasses.dataclass(frozen=True)
class MosaicAttentionVjpConfig:
    """Tiles of the backward kernels (dq: rows of q per warpgroup, K/V streamed;
    dk/dv: rows of k/v per warpgroup, Q/dO streamed). At head dim 256 two warpgroups
    share their rows and split the head dim (`splits_head_dim`): always in the dk/dv
    kernel, and in the dq kernel with `compute_wgs=2` (1: one warpgroup, whole width).
    `dq_accumulation` (`DQ_ACCUMULATIONS`) picks a dq kernel or dq added up by the dk/dv
    kernel (then the `_dq` fields are unused). `group_in_block` (GQA/MQA, with the
    separate dq kernel): the dk/dv grid runs over K/V heads, each block walking the query
    tiles of every query head of its group and writing (B, Sk, Hkv, D) directly, instead
    of a block per query head and a float32 sum of the group's shares after the kernel
    (a no-op when every K/V head has one query head). `longest_first` (causal calls,
    the separate dq kernel): the dq kernel launches its query blocks last to first
    (`query_block`), the longest first; the dk/dv kernel already does (key block `ki`
    walks the query tiles from `ki` on, so ascending `ki` is longest first), and with a
    fused `dq_accumulation` there is no dq kernel: a no-op there and without a causal
    mask."""

    block_q_dq: int = 64
    block_kv_dq: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    num_stages: int = 2
    compute_wgs: int = 2
    dq_accumulation: str = "separate"
    dq_split: str = "columns"
    group_in_block: bool = False
    longest_first: bool = False

    def __post_init__(self) -> None:
        _check_tiles(self.block_q_dq, self.block_kv_dq, self.num_stages, self.compute_wgs)
        _check_tiles(self.block_kv_dkv, self.block_q_dkv, self.num_stages, self.compute_wgs)
        if self.dq_split not in ("columns", "rows"):
            raise ValueError(f"dq_split must be 'columns' or 'rows', got {self.dq_split!r}")
        if self.dq_split != "columns" and self.dq_accumulation == "separate":
            raise ValueError("dq_split applies to the one-pass backward only: set "
                             "dq_accumulation='ordered' or 'atomic'")
        if self.dq_accumulation not in DQ_ACCUMULATIONS:
            raise ValueError(f"dq_accumulation must be one of {DQ_ACCUMULATIONS}, got "
                             f"{self.dq_accumulation!r}")
        if not isinstance(self.group_in_block, bool):
            raise ValueError(f"group_in_block must be a bool, got {self.group_in_block!r}")
        if self.group_in_block and self.fused:
            raise ValueError(
                f"group_in_block runs with the separate dq kernel only, not with "
                f"dq_accumulation={self.dq_accumulation!r} (its dq adds are per query "
                f"head): set dq_accumulation='separate' or group_in_block=False")
        _check_bool("longest_first", self.longest_first)

    @property
    def fused(self) -> bool:
        """dq accumulated by the dk/dv kernel (one pass) rather than a kernel of its own."""
        return self.dq_accumulation != "separate"


def deterministic_ops_forced() -> bool:
    """Whether `XLA_FLAGS` holds `--xla_gpu_deterministic_ops` (bare, or `=true`/`=1`):
    then an "atomic" `dq_accumulation` runs "ordered", as XLA's own ops turn
    reproducible under that flag."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == "--xla_gpu_deterministic_ops":
            return value.lower() in ("", "true", "1")
    return False


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def query_block(num_q_blocks: int, longest_first: bool) -> Any:
    """The query block a kernel block owns: the grid's "q" index, or with `longest_first`
    (the caller passes it only for causal calls) that index reversed.

    Under a causal mask query block `i` sees `i`-proportional K/V tiles (a causal
    window's tiles grow with `i` until the window is full, never shrink; key lengths
    cap them alike), so ascending order launches the shortest blocks first and the
    longest may run alone at the end. The hardware hands out blocks roughly in linear
    block-id order, x fastest: the grids are (heads, q, batch), so reversing the index
    runs every batch element's blocks longest first and the whole grid ends on the
    shortest blocks of the last one. The grid keeps its shape rather than putting the
    q axis outermost (one global longest-first order): that would scatter the blocks
    running together over every (batch, head), where now they share a head's K/V in
    L2, and only the tail's order matters to a greedy scheduler. Without a causal
    mask every block walks the same tiles (a non-causal window's blocks grow and then
    shrink), so the order stays as it is and the traced program is unchanged."""
    qi = lax.axis_index("q")
    return num_q_blocks - 1 - qi if longest_first else qi


def longest_first_measured(arguments: Mapping[str, Any]) -> bool:
    """Whether the heuristics launch causal query blocks longest first for this call:
    causal, no local window, head dim <= 128, where it was measured on the H200
    (`longest_first.jsonl`, four causal workloads at d64/d128, MHA and GQA: forward
    1.02-1.07x grid order, forward+backward 1.01-1.04x, bitwise equal to it). Windowed
    and d256 calls were not timed, so they keep the grid order."""
    return (bool(arguments["is_causal"]) and arguments["local_window_size"] is None
            and arguments["query"].shape[-1] <= 128)


def _check_tiles(rows: int, streamed: int, stages: int, wgs: int) -> None:
    if rows % 64 or streamed % 64 or rows <= 0 or streamed <= 0:
        raise ValueError(
            f"attention blocks must be positive multiples of 64, got {rows}, {streamed}")
    if stages < 2:
        raise ValueError(f"num_stages must be >= 2, got {stages}")
    if wgs not in (1, 2):
        raise ValueError(f"compute_wgs must be 1 or 2, got {wgs}")


def tile_transforms(dtype: Any) -> tuple[Any, ...]:
    """SMEM tiling + 128-byte swizzle that `wgmma` and TMA expect for 16-bit tiles."""
    swizzle = 128
    # JAX declares both transforms abstract (`transform_array`), yet builds them itself.
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),  # type: ignore[abstract]
            plgpu.SwizzleTransform(swizzle))  # type: ignore[abstract]


def mask_scores(s: Any, row0: Any, col0: Any, *, causal: bool, kv_len: Any,
                q_on_rows: bool = True, window: tuple[int, int] | None = None) -> Any:
    """Scores tile `s` (WGMMA layout, first row `row0`, first column `col0`) with -inf
    where the key is hidden: after its query (causal, top-left aligned), outside the
    local `window` `(left, right)` (when not None), or at or after `kv_len` (when not
    None). `q_on_rows=False` for transposed tiles (keys on rows)."""
    def positions(axis: int, start: Any) -> Any:
        return plgpu.broadcasted_iota(jnp.int32, s.shape, axis, layout=plgpu.Layout.WGMMA) + start

    q_axis, k_axis = (0, 1) if q_on_rows else (1, 0)
    q0, k0 = (row0, col0) if q_on_rows else (col0, row0)
    keys = positions(k_axis, k0)
    keep = positions(q_axis, q0) >= keys if causal else None
    if window is not None:
        offsets = keys - positions(q_axis, q0)
        in_window = (offsets >= -window[0]) & (offsets <= window[1])
        keep = in_window if keep is None else keep & in_window
    if kv_len is not None:
        keep = keys < kv_len if keep is None else keep & (keys < kv_len)
    return s if keep is None else jnp.where(keep, s, -jnp.inf)


def kernel_lengths(key_value_seq_lengths: Any, seq_kv: int) -> Any:
    """Key lengths as the kernels take them: (B,) int32 clipped to [0, Sk], or None."""
    if key_value_seq_lengths is None:
        return None
    # int32 first: clipped in an int8 dtype, seq_kv = 300 wrapped to 44 (lengths cut).
    return jnp.clip(key_value_seq_lengths.astype(jnp.int32), 0, seq_kv)


def visible_rows(query_seq_lengths: Any, key_value_seq_lengths: Any, seq_q: int,
                 window: tuple[int, int] | None = None, seq_kv: int = 0) -> Any:
    """(B, Sq), (B, 1) or (1, Sq) bool: the query rows that see at least one key (None:
    all).

    The kernels leave the other rows undefined (forward) or need them to contribute
    nothing (backward); causal attention alone never empties a row (key 0 is visible).
    A local `window` (`_window.bounds`, over `seq_kv` keys) empties the rows at and after
    `kv_len + left`."""
    visible = None
    if query_seq_lengths is not None:
        visible = jnp.arange(seq_q)[None, :] < query_seq_lengths[:, None]
    if key_value_seq_lengths is not None:
        has_keys = (key_value_seq_lengths > 0)[:, None]
        visible = has_keys if visible is None else visible & has_keys
    if window is not None:
        kv_len = seq_kv if key_value_seq_lengths is None else key_value_seq_lengths[:, None]
        below = _window.visible_below(window, kv_len)
        if key_value_seq_lengths is not None or seq_q > below:
            seen = jnp.arange(seq_q)[None, :] < below
            visible = seen if visible is None else visible & seen
    return visible


def check_target(target: Target | None, what: str) -> None:
    """Hopper only: `wgmma` and the Mosaic GPU pipeline need sm_90. A CUDA target of no
    known device kind (an export for `platforms=["cuda"]` without `device_kind`) may be
    any GPU, so the kernel is not chosen for it either."""
    if target is None:
        return
    if target.platform != "cuda":
        raise NotImplementedError(f"{what} runs on CUDA GPUs only, not on {target.platform}")
    if not target.is_hopper:
        raise NotImplementedError(
            f"{what} needs a Hopper GPU (sm_90: wgmma, TMA), got "
            f"{target.device_kind or 'a CUDA target of no known device kind'!r}"
        )


def check_common(q: Any, k: Any, v: Any, *, head_dims: tuple[int, ...], what: str) -> None:
    """Input limits shared by the forward and backward kernels."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise NotImplementedError(f"{what} supports bf16/f16 only, {name} is {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise NotImplementedError(f"{what} needs q, k, v of one dtype, got {q.dtype}, {k.dtype}, "
                                  f"{v.dtype}")
    head_dim = q.shape[-1]
    if head_dim not in head_dims or k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise NotImplementedError(
            f"{what} supports head dims {head_dims} (equal for q, k, v), got q {q.shape[-1]}, "
            f"k {k.shape[-1]}, v {v.shape[-1]}"
        )


def check_lengths(seq_q: int, seq_kv: int, q_tile: int, kv_tile: int, what: str) -> None:
    if seq_q % q_tile:
        raise NotImplementedError(f"{what}: query length {seq_q} must be a multiple of {q_tile}")
    if seq_kv % kv_tile:
        raise NotImplementedError(f"{what}: key length {seq_kv} must be a multiple of {kv_tile}")


def check_unsupported_features(arguments: Mapping[str, Any], what: str) -> None:
    """The family features the Mosaic kernels do not implement."""
    for name in ("bias", "mask"):
        if arguments.get(name) is not None:
            raise NotImplementedError(f"{what} does not support {name} (use 'triton' or 'xla')")


def check_inputs(arguments: Mapping[str, Any], target: Target | None, *,
                 head_dims: tuple[int, ...], q_multiple: int, kv_multiple: int,
                 what: str) -> None:
    """The checks the forward and backward kernels share (`NotImplementedError`)."""
    check_target(target, what)
    check_unsupported_features(arguments, what)
    q, k, v = arguments["query"], arguments["key"], arguments["value"]
    check_common(q, k, v, head_dims=head_dims, what=what)
    check_lengths(q.shape[1], k.shape[1], q_multiple, kv_multiple, what)
