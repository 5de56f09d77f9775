"""`PallasMosaicGpuFlashAttentionVjp`: the Hopper flash-attention backward (dq, dk, dv).

Uses the family residual `lse` (any forward's; an lse output's cotangent enters `delta`),
recomputes the probabilities, and runs two Mosaic GPU kernels
(`_mosaic_gpu_bwd_kernels.py`): one for dq, one for dk/dv per
query head (GQA/MQA shares summed after it), or with `group_in_block` per K/V head, the
group's query heads walked in the block and dk/dv summed in registers: chosen where its
blocks still fill the GPU (`fills_gpu_by_kv_head`). Self-attention on one array
(`attention(x, x, x)`, non-causal, no lengths, below d256) runs one kernel for `dq + dk + dv`
instead (`_mosaic_gpu_self_attention_bwd_kernel.py`). No atomics: reruns are bitwise identical.
Logits soft cap and local windows run in the general kernels (tiles outside a window are
never loaded).

Head dim 256 (Gemma-2 style, with soft cap and windows) splits the head dim in halves
(`_mosaic_gpu_head_dim_split.py`), from the register budget: `wgmma` gives each compute
warpgroup at least 64 rows, and dk and dv for them whole would be 2 x 64 x 256 float32
over 128 threads = 256 registers a thread before the two 64 x 64 score tiles (+64), over
the 255-register hardware limit (the compute warpgroups get 232). Split, the dk/dv kernel
holds 2 x 64 x 128 (+64 = 192 registers) and recomputes the full-width scores per half.
Of the three splits (halves of the head dim per warpgroup, per block, or dk and dv in
separate passes) two warpgroups sharing one block's 64 key rows load K, V and each Q/dO
tile once for both halves (SMEM: K, V 64 KiB + a 2-slot Q/dO ring 128 KiB = 192 KiB of the
227); a block per half or a pass each for dk and dv would load everything twice and
recompute the scores as often. At d256 `compute_wgs` picks the dq kernel's form (the
dk/dv kernel always runs the two halves): 1 holds its 64 x 256 whole in one warpgroup
(192 registers, 192 KiB SMEM), 2 splits the head dim of shared rows as dk/dv does (rows
of their own would need 256 KiB), ping-ponging at 5/3 the `wgmma` work. Every d256
config is 64 x 64 tiles with 2 stages (larger ones overflow registers or SMEM); none is
measured on the device yet (`None` ranks a kernel on measurements only).

A one-pass backward (`dq_accumulation` "ordered" or "atomic",
`mosaic_attention_fused_bwd`) runs only the dk/dv kernel, which also multiplies each
tile's dS by K and hands the float32 dq share to a warp of the memory warpgroup that
TMA-adds it into global memory: five `wgmma`s a tile pair instead of seven. "ordered"
fixes the adds' order with a semaphore per query tile (bitwise reruns); "atomic" does
not, and runs only when named (under `--xla_gpu_deterministic_ops` it runs "ordered").
On the H200 (`benchmarks/probes/fused_dq_probe.py`, forward+backward) "ordered" is slower
than the two kernels at every shape measured (non-causal and causal d128, GQA, d64) and
"atomic" no faster, so neither the heuristics nor the search space hold them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_kernels._gpu import sm_count
from tokamax_kernels.attention import _mosaic_gpu_common as common
from tokamax_kernels.attention import _window
from tokamax_kernels.attention._delta import attention_delta
from tokamax_kernels.attention._mosaic_gpu_bwd_kernels import (
    computes_delta,
    fused_fits,
    mosaic_attention_dkv,
    mosaic_attention_dq,
    mosaic_attention_dq_and_delta,
    mosaic_attention_fused_bwd,
)
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionVjpConfig,
    check_inputs,
    check_unsupported_features,
)
from tokamax_kernels.attention._mosaic_gpu_self_attention_bwd_kernel import mosaic_self_attention_dx
from tokamax_kernels.attention.base import DotProductAttentionVjp
from tokamax_pass.core import BoundArguments, Target

_WHAT = "PallasMosaicGpuFlashAttentionVjp"


# `group_in_block` needs this many dk/dv blocks (batch x K/V heads x key blocks) per SM.
# H200, forward+backward (`benchmarks/probes/gqa_dkv_probe.py`): with 512-1024 blocks (4-8
# per SM) it beats the per-query-head kernel at GQA d64, d128 and d256 (Gemma-2's soft
# cap and window included); with MQA's 128 (under one per SM, each block 16 heads long)
# it loses clearly.
GROUP_IN_BLOCK_BLOCKS_PER_SM = 3


def fills_gpu_by_kv_head(config: MosaicAttentionVjpConfig, batch: int, heads: int,
                         kv_heads: int, seq_kv: int, head_dim: int) -> bool:
    """Whether the dk/dv kernel with a block per K/V head (GQA/MQA only) keeps every SM
    busy: `GROUP_IN_BLOCK_BLOCKS_PER_SM` blocks each, at least."""
    if heads == kv_heads or config.fused:
        return False
    block_rows = config.block_kv_dkv * _row_tiles(config, head_dim)
    blocks = batch * kv_heads * (seq_kv // block_rows)
    return blocks >= GROUP_IN_BLOCK_BLOCKS_PER_SM * sm_count()


def _with_measured_rules(config: MosaicAttentionVjpConfig, arguments: Mapping[str, Any]
                         ) -> MosaicAttentionVjpConfig:
    """`config` with `group_in_block` and `longest_first` set where they were measured
    to win."""
    q, k = arguments["query"], arguments["key"]
    batch, _, heads, head_dim = q.shape
    rule = fills_gpu_by_kv_head(config, batch, heads, k.shape[2], k.shape[1], head_dim)
    return dataclasses.replace(config, group_in_block=rule,
                               longest_first=common.longest_first_measured(arguments))


def _row_tiles(config: MosaicAttentionVjpConfig, head_dim: int) -> int:
    """Row tiles a block holds in SMEM: one per compute warpgroup, or at d256 one (shared
    by the warpgroups that split the head dim, or the dq kernel's single warpgroup's)."""
    return 1 if common.splits_head_dim(head_dim) else config.compute_wgs


def backward_smem_bytes(config: MosaicAttentionVjpConfig, head_dim: int) -> int:
    """The larger of the two kernels' SMEM (2-byte tiles, f32 lse/delta vectors); fused,
    the dk/dv kernel's plus two steps of dS tiles and the float32 dq slices."""
    own, stages = _row_tiles(config, head_dim), config.num_stages
    dkv = 2 * head_dim * 2 * (own * config.block_kv_dkv + stages * config.block_q_dkv)
    if config.fused:
        by_rows = config.dq_split == "rows" or config.compute_wgs == 1
        ds = (1 if by_rows else 2) * own * config.block_kv_dkv * config.block_q_dkv * 2
        dq = 4 * config.block_q_dkv * head_dim * (own if by_rows else 1)
        return dkv + ds + dq + 8 * stages * config.block_q_dkv
    # Q and dO row tiles (and out's, where the dq kernel computes delta), the K/V ring.
    row_tiles = 3 if computes_delta(head_dim) else 2
    dq = head_dim * 2 * (row_tiles * own * config.block_q_dq + 2 * stages * config.block_kv_dq)
    return max(dq, dkv) + 8 * max(own * config.block_q_dq, stages * config.block_q_dkv)


_QKV = frozenset({"query", "key", "value"})
# f32 registers a thread the one-pass backward may hold after its score tiles (dk, dv,
# the dq slice, dS): one warpgroup at d128 holds 208 (of the 232 it gets).
FUSED_REGISTERS = 208


def runs_shared_kernel(arguments: Mapping[str, Any]) -> bool:
    """True when query, key and value are one array (`shared_inputs`) and nothing else
    (causal, lengths, a local window, a soft cap, head dim 256: its accumulator and four
    score tiles would take 256 registers a thread) needs the general kernels: then one
    kernel computes their summed gradient."""
    return (any(set(group) >= _QKV for group in arguments.get("shared_inputs", ()))
            and not common.splits_head_dim(arguments["query"].shape[-1])
            and not arguments["is_causal"] and arguments["query_seq_lengths"] is None
            and arguments["key_value_seq_lengths"] is None
            and arguments.get("local_window_size") is None
            and arguments.get("logits_soft_cap") is None)


def shared_fits(config: MosaicAttentionVjpConfig, seq: int, head_dim: int) -> bool:
    """The shared kernel's limits: its own rows and streamed rows are the dk/dv fields."""
    wgs, stages = config.compute_wgs, config.num_stages
    smem = 2 * head_dim * 2 * (wgs * config.block_kv_dkv + stages * config.block_q_dkv)
    # f32 registers per thread: the accumulator and four (rows x streamed) tiles.
    registers = (config.block_kv_dkv * head_dim
                 + 4 * config.block_kv_dkv * config.block_q_dkv) // 128
    return (seq % (wgs * config.block_kv_dkv) == 0 and seq % config.block_q_dkv == 0
            and smem + 12 * (wgs * config.block_kv_dkv + stages * config.block_q_dkv)
            <= common.SMEM_BYTES and registers <= 192)


def fits(config: MosaicAttentionVjpConfig, seq_q: int, seq_kv: int, head_dim: int) -> bool:
    own = _row_tiles(config, head_dim)
    # Accumulated columns: a d256 head dim split in halves (dq: with two warpgroups).
    split = common.splits_head_dim(head_dim)
    dkv_width = head_dim // 2 if split else head_dim
    dq_width = head_dim // 2 if split and config.compute_wgs == 2 else head_dim
    # f32 registers per thread: dk + dv accumulators and the two (kv x q) score tiles.
    dkv_registers = (2 * config.block_kv_dkv * dkv_width
                     + 2 * config.block_kv_dkv * config.block_q_dkv) // 128
    dq_registers = (config.block_q_dq * dq_width
                    + 2 * config.block_q_dq * config.block_kv_dq) // 128
    if config.fused:
        # After the score tiles: dk + dv, this warpgroup's dq slice and its bf16 dS.
        dq_cols = head_dim if config.dq_split == "rows" else head_dim // config.compute_wgs
        dq_registers = (2 * config.block_kv_dkv * dkv_width + config.block_q_dkv * dq_cols
                        + config.block_kv_dkv * config.block_q_dkv // 2) // 128
        return (fused_fits(head_dim, config.compute_wgs, config.dq_split)
                and seq_kv % (own * config.block_kv_dkv) == 0
                and seq_q % config.block_q_dkv == 0
                and backward_smem_bytes(config, head_dim) <= common.SMEM_BYTES
                and dkv_registers <= 192 and dq_registers <= FUSED_REGISTERS)
    return (seq_q % (own * config.block_q_dq) == 0 and seq_kv % config.block_kv_dq == 0
            and seq_kv % (own * config.block_kv_dkv) == 0 and seq_q % config.block_q_dkv == 0
            and backward_smem_bytes(config, head_dim) <= common.SMEM_BYTES
            and max(dkv_registers, dq_registers) <= 192)


def _config_fits(config: MosaicAttentionVjpConfig, arguments: Mapping[str, Any]) -> bool:
    q, k = arguments["query"], arguments["key"]
    if runs_shared_kernel(arguments):
        return shared_fits(config, q.shape[1], q.shape[3])
    return fits(config, q.shape[1], k.shape[1], q.shape[3])


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicGpuFlashAttentionVjp(DotProductAttentionVjp):
    """dq, dk, dv of flash attention on Hopper, from the forward's `lse` residual."""

    config_cls: ClassVar[type] = MosaicAttentionVjpConfig
    accepts_shared_inputs: ClassVar[bool] = True
    implementation: ClassVar[str] = "mosaic"
    platforms: ClassVar[frozenset[str] | None] = frozenset({"cuda"})
    slow_lowering: ClassVar[bool] = True

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        args = ba.arguments
        check_inputs(args, target, head_dims=common.HEAD_DIMS, q_multiple=128,
                     kv_multiple=128, what=_WHAT)
        residuals = args.get("residuals")
        if not (isinstance(residuals, tuple) and len(residuals) == 1):
            raise NotImplementedError(f"{_WHAT} needs the family residuals (lse,)")
        config = self.config
        if config is not None and config.fused and not runs_shared_kernel(args) and not (
                fused_fits(args["query"].shape[3], config.compute_wgs, config.dq_split)):
            raise NotImplementedError(
                f"{_WHAT}: the one-pass backward (dq_accumulation="
                f"{config.dq_accumulation!r}) takes head dims up to 128, and split by "
                f"columns head_dim // compute_wgs >= 64; got head_dim "
                f"{args['query'].shape[3]}, compute_wgs {config.compute_wgs}: use "
                f"dq_accumulation='separate' or dq_split='rows'")
        if config is not None and not _config_fits(config, args):
            raise NotImplementedError(f"{_WHAT}: config {config} does not fit these shapes")

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: MosaicAttentionVjpConfig,
             return_residuals: bool, query: jax.Array, key: jax.Array, value: jax.Array,
             bias: Any, mask: Any, scale: float | None = None, is_causal: bool = False,
             query_seq_lengths: Any = None, key_value_seq_lengths: Any = None,
             local_window_size: Any = None, logits_soft_cap: Any = None,
             shared_inputs: Any = (), dresiduals: Any = None,
             **unsupported: Any) -> tuple[dict[str, Any], None]:
        # The defaults are `bind`'s, which always passes every one of them.
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        del return_residuals, unsupported["precision"]
        check_unsupported_features(dict(bias=bias, mask=mask, **unsupported), _WHAT)
        window = _window.bounds(local_window_size, is_causal)
        (lse,) = residuals
        dout = dout.astype(query.dtype)
        shared = runs_shared_kernel(dict(
            query=query, shared_inputs=shared_inputs, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, logits_soft_cap=logits_soft_cap))
        # The two-kernel backward's dq kernel computes delta itself where it can (one pass
        # over `out` and `dout` fewer); the lse output's cotangent needs the delta pass.
        delta = (None if dresiduals is None and not shared and not config.fused
                 and computes_delta(query.shape[3])
                 else attention_delta(out, dout, None if dresiduals is None
                                       else dresiduals[0]))
        lse = lse.astype(jnp.float32)
        visible = common.visible_rows(query_seq_lengths, key_value_seq_lengths, query.shape[1],
                                      window, key.shape[1])
        if visible is not None:
            # An lse of +inf makes every probability of a row that sees nothing zero.
            lse = jnp.where(visible[:, None, :], lse, jnp.inf)
        if shared:
            assert delta is not None  # the self-attention kernel always takes the delta pass
            dx = mosaic_self_attention_dx(query, dout, lse, delta, scale=scale, config=config)
            return {"query": dx}, None
        lengths = common.kernel_lengths(key_value_seq_lengths, key.shape[1])
        kwargs = dict(scale=scale, causal=is_causal, config=config, window=window,
                      soft_cap=logits_soft_cap)
        if config.fused:
            if config.dq_accumulation == "atomic" and common.deterministic_ops_forced():
                kwargs["config"] = dataclasses.replace(config, dq_accumulation="ordered")
            dq, dk, dv = mosaic_attention_fused_bwd(query, key, value, dout, lse, delta,
                                                    lengths, **kwargs)
            return {"query": dq, "key": dk, "value": dv}, None
        if delta is None:  # the dq kernel sums it on the way (`computes_delta`)
            dq, delta = mosaic_attention_dq_and_delta(query, key, value, dout, out, lse,
                                                      lengths, **kwargs)
        else:
            dq = mosaic_attention_dq(query, key, value, dout, lse, delta, lengths, **kwargs)
        dk, dv = mosaic_attention_dkv(query, key, value, dout, lse, delta, lengths, **kwargs)
        return {"query": dq, "key": dk, "value": dv}, None

    def _get_heuristics_config(self, ba: BoundArguments) -> MosaicAttentionVjpConfig:
        q, k = ba.arguments["query"], ba.arguments["key"]
        seq_q, seq_kv, head_dim = q.shape[1], k.shape[1], q.shape[3]
        if runs_shared_kernel(ba.arguments):
            # 64 x 64 tiles led at d64 and d128 on the H200 (an A/B of the tile configs): larger
            # ones spill registers (1.4-2.3x slower).
            for config in (MosaicAttentionVjpConfig(block_q_dkv=64, block_kv_dkv=64),
                           MosaicAttentionVjpConfig(block_q_dkv=64, block_kv_dkv=64,
                                                    compute_wgs=1)):
                if shared_fits(config, seq_q, head_dim):
                    return config
        preferred = []
        if head_dim <= 64:
            # The seed f_grad's d64 backward on the H200 runs fastest with these blocks
            # (against block_q_dq=64, block_kv_dq=128, over four autotunes).
            preferred.append(MosaicAttentionVjpConfig(block_q_dq=128, block_kv_dq=64,
                                                      block_q_dkv=128, block_kv_dkv=64))
        # Two warpgroups also at d256 (splitting the head dim in both kernels), by analogy
        # with the measured d64/d128 (unmeasured at d256).
        preferred.append(MosaicAttentionVjpConfig())
        for config in preferred:
            if fits(config, seq_q, seq_kv, head_dim):
                return _with_measured_rules(config, ba.arguments)
        return _with_measured_rules(MosaicAttentionVjpConfig(compute_wgs=1), ba.arguments)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[MosaicAttentionVjpConfig]:
        q, k = ba.arguments["query"], ba.arguments["key"]
        seq_q, seq_kv, head_dim = q.shape[1], k.shape[1], q.shape[3]
        wg_choices = common.compute_wg_choices(q.shape[0] * q.shape[2], seq_q, seq_kv)
        if runs_shared_kernel(ba.arguments):
            # The dq fields do not apply: keep them at their defaults.
            return {config for bq, bkv, stages, wgs in itertools.product(
                        (64, 128), (64, 128), (2, 3), wg_choices)
                    if shared_fits(config := MosaicAttentionVjpConfig(
                        block_q_dkv=bq, block_kv_dkv=bkv, num_stages=stages,
                        compute_wgs=wgs), seq_q, head_dim)}
        configs = set()
        for bq, bkv, bq2, bkv2, stages, wgs in itertools.product(
                (64, 128), (64, 128), (64, 128), (64, 128), (2, 3), wg_choices):
            config = MosaicAttentionVjpConfig(block_q_dq=bq, block_kv_dq=bkv, block_q_dkv=bq2,
                                              block_kv_dkv=bkv2, num_stages=stages,
                                              compute_wgs=wgs)
            if fits(config, seq_q, seq_kv, head_dim):
                configs.add(_with_measured_rules(config, ba.arguments))
        return configs
