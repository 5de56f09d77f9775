"""`PallasMosaicGpuFlashAttention`: the Hopper flash-attention forward in Pallas Mosaic GPU.

Supports bf16/f16, head dims 64/128/256, causal or not, GQA/MQA, per-batch query and
key/value sequence lengths, query lengths that are multiples of 128 and key lengths that
are multiples of 64, logits soft cap, local windows (K/V tiles outside a block's window
are never loaded). Bias and masks raise `NotImplementedError` (so `implementation=None`
moves on to the next implementation). Kernels: `_mosaic_gpu_*.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_kernels.attention import _mosaic_gpu_common as common
from tokamax_kernels.attention import _window
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionConfig,
    check_inputs,
    check_unsupported_features,
)
from tokamax_kernels.attention._mosaic_gpu_fwd_kernel import mosaic_attention_forward
from tokamax_kernels.attention.base import DotProductAttention
from tokamax_kernels.attention.pallas_mosaic_gpu_vjp import PallasMosaicGpuFlashAttentionVjp
from tokamax_pass.core import BoundArguments, Op, Target

_WHAT = "PallasMosaicGpuFlashAttention"
# The smallest tiles the kernel runs with: 2 warpgroups x 64 query rows, 64 key rows.
MIN_Q_MULTIPLE = 128
MIN_KV_MULTIPLE = 64


def forward_smem_bytes(config: MosaicAttentionConfig, head_dim: int, itemsize: int) -> int:
    # Each warpgroup's Q tile (its output on the way out) and lse, twice with prefetch_query.
    q = config.query_buffers * config.compute_wgs * config.block_q * (head_dim * itemsize + 4)
    kv = 2 * config.num_stages * config.block_kv * head_dim * itemsize
    # Overlapped, each warpgroup keeps its last P tile for the next step's P V.
    p = config.compute_wgs * config.block_q * config.block_kv * itemsize
    return q + kv + (p if config.softmax_overlap else 0)


def fits(config: MosaicAttentionConfig, seq_q: int, seq_kv: int, head_dim: int) -> bool:
    """Whether `config` tiles these lengths and fits in SMEM and registers."""
    rows = config.rows_per_block
    # Per-thread f32 registers of the accumulator (block_q x head_dim) and the scores.
    registers = (config.block_q * head_dim + config.block_q * config.block_kv) // 128
    return (seq_q % rows == 0 and seq_kv % config.block_kv == 0
            and forward_smem_bytes(config, head_dim, 2) <= common.SMEM_BYTES
            and registers <= 192)


def groups_fit(config: MosaicAttentionConfig, heads: int, kv_heads: int) -> bool:
    """Whether a block's `query_heads_per_block` heads share one K/V head.

    `group_in_block` is a tuning choice, never the heuristics': on the H200
    (`benchmarks/probes/attention_limits_probe.py`, forward, the heuristics' tiles, grid and
    persistent) it ties a block per query head at causal and non-causal GQA d128 and
    Gemma-2's windowed d256 layer, and wins only a little at its global (soft-capped) d256
    layer."""
    return (heads // kv_heads) % config.query_heads_per_block == 0


def one_block_per_sm(config: MosaicAttentionConfig, head_dim: int) -> bool:
    """Whether a block of `config` takes more than half the SMEM, so a grid launch runs
    one block per SM anyway and a persistent launch (`MosaicAttentionConfig.persistent`)
    costs no occupancy."""
    return 2 * forward_smem_bytes(config, head_dim, 2) > common.SMEM_BYTES


def persistent_twin(config: MosaicAttentionConfig, head_dim: int) -> MosaicAttentionConfig:
    """The persistent launch of `config`, prefetching each next tile's Q
    (`MosaicAttentionConfig.prefetch_query`) where the second Q buffer fits in SMEM.

    On the H200 (`benchmarks/probes/attention_limits_probe.py prefetch`, forward, 64 x 128
    tiles) the prefetch is at least as fast as the persistent launch without it at every
    shape measured (d128 and d64, MHA and GQA, causal, windowed and not), and gains the
    most where tiles are short."""
    twin = dataclasses.replace(config, persistent=True, prefetch_query=True)
    if forward_smem_bytes(twin, head_dim, 2) <= common.SMEM_BYTES:
        return twin
    return dataclasses.replace(config, persistent=True)


def persistent_offered(config: MosaicAttentionConfig, head_dim: int, *, uneven: bool
                       ) -> bool:
    """Whether the search space offers `config`'s persistent twin: where a block of it
    fills an SM anyway (a grid launch runs one block per SM too), or where the tiles
    differ in length (`uneven`: a causal mask or a window) at head dim <= 128, where the
    balanced, prefetching persistent launch beat the grid also with two blocks an SM."""
    return one_block_per_sm(config, head_dim) or (uneven and head_dim <= 128)


def persistent_measured(config: MosaicAttentionConfig, heads: int, kv_heads: int,
                        head_dim: int, *, uneven: bool) -> bool:
    """Whether the heuristics launch `config` persistent (`persistent_twin`): at head dim
    <= 128 where the tiles differ in length (`uneven`: a causal mask or a window, so the
    balanced schedule of `_mosaic_gpu_tile_order` applies), or share K/V (GQA/MQA) with a
    block that fills an SM.

    On the H200 (forward, the heuristics' tiles; `benchmarks/probes/attention_limits_probe.py
    prefetch` and `persistent`) the balanced persistent launch with the Q prefetch beats
    the grid at causal d128 shapes (MHA and GQA, 1024-8192 rows), at causal d64 shapes
    (though two grid blocks fit an SM there) and at the d128 soft cap + window. Without a
    mask (every tile alike, round robin) it ties the grid at GQA d128 (the L2 sections
    keep a group's shared K/V hot) and at MHA d128. Not chosen at d256 (the prefetch does
    not fit beside 64 x 64 tiles, and without it the grid wins), nor without a mask where
    two blocks fit an SM (the grid wins clearly there)."""
    if head_dim > 128:
        return False
    return uneven or (heads > kv_heads and one_block_per_sm(config, head_dim))


def _narrow_for_window(preferred: list[MosaicAttentionConfig], window: Any
                       ) -> list[MosaicAttentionConfig]:
    """With a local window of at most 64 keys a row, 64-key tiles first: a row's keys then
    span at most two tiles, and a 128-key tile would be mostly masked (not measured)."""
    if window is None or sum(window) + 1 > 64:
        return preferred
    narrow = [dataclasses.replace(c, block_kv=64) for c in preferred]
    return list(dict.fromkeys(narrow + preferred))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicGpuFlashAttention(DotProductAttention):
    """Flash attention forward for Hopper GPUs (TMA ring, wgmma, warp specialization)."""

    config_cls: ClassVar[type] = MosaicAttentionConfig
    implementation: ClassVar[str] = "mosaic"
    platforms: ClassVar[frozenset[str] | None] = frozenset({"cuda"})
    slow_lowering: ClassVar[bool] = True

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        args = ba.arguments
        check_inputs(args, target, head_dims=common.HEAD_DIMS,
                     q_multiple=MIN_Q_MULTIPLE, kv_multiple=MIN_KV_MULTIPLE, what=_WHAT)
        q, k = args["query"], args["key"]
        if self.config is not None and not fits(self.config, q.shape[1], k.shape[1], q.shape[3]):
            raise NotImplementedError(f"{_WHAT}: config {self.config} does not fit these shapes")
        if self.config is not None and not groups_fit(self.config, q.shape[2], k.shape[2]):
            raise NotImplementedError(
                f"{_WHAT}: group_in_block runs compute_wgs={self.config.compute_wgs} query "
                f"heads of one K/V head in a block, and these {q.shape[2]} query heads over "
                f"{k.shape[2]} K/V heads do not divide so: set group_in_block=False")
        if (self.config is not None and self.config.softmax_overlap
                and (args["local_window_size"] is not None
                     or args["key_value_seq_lengths"] is not None)):
            raise NotImplementedError(common.OVERLAP_LIMITS)

    def _fwd(self, query: jax.Array, key: jax.Array, value: jax.Array, bias: Any, mask: Any, *,
             scale: float, is_causal: bool, query_seq_lengths: Any, key_value_seq_lengths: Any,
             local_window_size: Any, logits_soft_cap: Any, precision: Any,
             config: MosaicAttentionConfig, return_residuals: bool) -> tuple[jax.Array, Any]:
        del precision  # bf16/f16 operands, f32 accumulation: what every precision gives here
        check_unsupported_features(dict(bias=bias, mask=mask), _WHAT)
        lengths = common.kernel_lengths(key_value_seq_lengths, key.shape[1])
        window = _window.bounds(local_window_size, is_causal)
        out, lse = mosaic_attention_forward(query, key, value, lengths, scale=scale,
                                            causal=is_causal, config=config, window=window,
                                            soft_cap=logits_soft_cap)
        # The family contract for rows that see no key: zero output, lse -inf.
        visible = common.visible_rows(query_seq_lengths, key_value_seq_lengths, query.shape[1],
                                      window, key.shape[1])
        if visible is not None:
            out = jnp.where(visible[:, :, None, None], out, jnp.zeros((), out.dtype))
            lse = jnp.where(visible[:, None, :], lse, -jnp.inf)
        return out, ((lse,) if return_residuals else None)

    def _get_heuristics_config(self, ba: BoundArguments) -> MosaicAttentionConfig:
        q, k = ba.arguments["query"], ba.arguments["key"]
        seq_q, seq_kv, head_dim = q.shape[1], k.shape[1], q.shape[3]
        causal = ba.arguments["is_causal"]
        # Measured on the H200 (an A/B of the tile shapes): at d64 128 x 128 tiles lead
        # 64 x 128; 64-row query tiles with 128-row K/V tiles lead at d128; d256 fits only
        # 64 x 64 (registers).
        if head_dim <= 64 and not causal:
            preferred = [MosaicAttentionConfig(block_q=128, block_kv=128, num_stages=2)]
        elif head_dim <= 128:
            preferred = [MosaicAttentionConfig(block_q=64, block_kv=128,
                                               num_stages=2 if causal or head_dim <= 64 else 3)]
        else:
            preferred = [MosaicAttentionConfig(block_q=64, block_kv=64, num_stages=2)]
        preferred += [MosaicAttentionConfig(block_q=64, block_kv=128, num_stages=2),
                      MosaicAttentionConfig(block_q=64, block_kv=64, num_stages=2)]
        preferred = _narrow_for_window(preferred, ba.arguments["local_window_size"])
        config = next((c for c in preferred if fits(c, seq_q, seq_kv, head_dim)),
                      MosaicAttentionConfig(block_q=64, block_kv=64, num_stages=2))
        config = dataclasses.replace(
            config, longest_first=common.longest_first_measured(ba.arguments))
        if persistent_measured(config, q.shape[2], k.shape[2], head_dim,
                               uneven=causal or ba.arguments["local_window_size"] is not None):
            return persistent_twin(config, head_dim)
        return config

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[MosaicAttentionConfig]:
        q, k = ba.arguments["query"], ba.arguments["key"]
        seq_q, seq_kv, head_dim = q.shape[1], k.shape[1], q.shape[3]
        wg_choices = common.compute_wg_choices(q.shape[0] * q.shape[2], seq_q)
        longest_first = common.longest_first_measured(ba.arguments)
        heads, kv_heads = q.shape[2], k.shape[2]
        uneven = ba.arguments["is_causal"] or ba.arguments["local_window_size"] is not None
        configs = set()
        for bq, bkv, stages, wgs in itertools.product((64, 128), (64, 128), (2, 3, 4),
                                                      wg_choices):
            config = MosaicAttentionConfig(block_q=bq, block_kv=bkv, num_stages=stages,
                                           compute_wgs=wgs, longest_first=longest_first)
            variants = [config]
            if wgs > 1 and heads > kv_heads:
                variants.append(dataclasses.replace(config, group_in_block=True))
            for variant in variants:
                if (fits(variant, seq_q, seq_kv, head_dim)
                        and groups_fit(variant, heads, kv_heads)):
                    configs.add(variant)
                    if persistent_offered(variant, head_dim, uneven=uneven):
                        configs.add(persistent_twin(variant, head_dim))
        return configs

    def _default_vjp(self) -> Op:
        return PallasMosaicGpuFlashAttentionVjp()
