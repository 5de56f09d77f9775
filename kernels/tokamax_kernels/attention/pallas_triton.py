"""`PallasTritonFlashAttention`: flash attention (forward) as a Pallas Triton kernel.

Supports every option of the family: causal, bool mask, bias, GQA/MQA, cross
attention, query/key sequence lengths, local windows and soft cap, in f16, bf16 and
f32, head dims up to 256. Sequence lengths that the blocks do not divide are padded
(and the padded keys masked); head dims are padded to a power of 2 (at least 16).
The kernel is in `_triton_fwd.py`, its gradient in `pallas_triton_vjp.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_kernels._triton import TritonKernel
from tokamax_kernels.attention import _flash_tiles as tiles
from tokamax_kernels.attention import _triton_common as common
from tokamax_kernels.attention._triton_common import (
    check_inputs,
    kernel_spec,
    lengths_i32,
    prepare_pairwise,
    prepare_qkv,
)
from tokamax_kernels.attention._triton_fwd import flash_attention_forward
from tokamax_kernels.attention.base import DotProductAttention
from tokamax_kernels.attention.pallas_triton_vjp import PallasTritonFlashAttentionVjp
from tokamax_pass.core import BoundArguments, Op, Target

_WHAT = "PallasTritonFlashAttention"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasTritonFlashAttentionConfig:
    """Forward tiles: `block_q` query rows per program, `block_k` keys per loop step.

    Keyword-only: upstream Tokamax's config of this name orders its fields `block_q,
    block_k, num_stages, num_warps`, so a positional call would swap the last two."""

    block_q: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {value}")


def heuristics_config(head_dim: int, seq_q: int, seq_k: int, causal: bool,
                      dtype: Any = jnp.bfloat16, value_head_dim: int | None = None,
                      pair_bytes: int = 0) -> PallasTritonFlashAttentionConfig:
    """H200 choices from `benchmarks/probes/triton_attention_sweep.py` (bf16, benchmark shapes).

    d64 (b32 s2048): 64x64 tiles, 4 warps, 3 stages (ahead of 128x64).
    d128 (b4 s8192): 128x128 tiles, 8 warps, 3 stages, causal or not (ahead of
    128x64x8). Larger head dims get smaller tiles to fit registers. The timings are in
    `benchmarks/results/nvidia_h200/triton_attention_sweep.json`. Key blocks and stages
    then shrink until the pipeline fits `common.fit_pipeline`'s budget in `dtype`, with
    the bias and mask tiles (`pair_bytes`, `common.pair_bytes`) where the call has them
    (float32 at d128: 64-key blocks).
    """
    del causal  # the same tiles won causal and non-causal at d128
    if head_dim <= 64:
        config = PallasTritonFlashAttentionConfig(block_q=64, block_k=64, num_warps=4,
                                                  num_stages=3)
    elif head_dim <= 128:
        config = PallasTritonFlashAttentionConfig(block_q=128, block_k=128, num_warps=8,
                                                  num_stages=3)
    else:
        config = PallasTritonFlashAttentionConfig(block_q=64, block_k=32, num_warps=4,
                                                  num_stages=2)
    head_dims = (head_dim, head_dim if value_head_dim is None else value_head_dim)
    block_q = common.clamp_block(config.block_q, seq_q)
    block_k, stages = common.fit_pipeline(rows=config.block_k, stages=config.num_stages,
                                          head_dims=head_dims, dtype=dtype,
                                          pair_bytes=pair_bytes, across=block_q)
    return dataclasses.replace(
        config, block_q=block_q, block_k=common.clamp_block(block_k, seq_k),
        num_stages=stages)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasTritonFlashAttention(TritonKernel, DotProductAttention):
    """Flash attention forward in Pallas Triton; `interpret=True` runs it on CPU."""

    config_cls: ClassVar[type] = PallasTritonFlashAttentionConfig

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        check_inputs(ba, None if self.interpret else target, _WHAT)

    def _get_heuristics_config(self, ba: BoundArguments) -> PallasTritonFlashAttentionConfig:
        q, k, v = ba.arguments["query"], ba.arguments["key"], ba.arguments["value"]
        return heuristics_config(q.shape[-1], q.shape[1], k.shape[1], ba.arguments["is_causal"],
                                 q.dtype, v.shape[-1],
                                 common.pair_bytes(ba.arguments["bias"], ba.arguments["mask"]))

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[PallasTritonFlashAttentionConfig]:
        q, k, v = ba.arguments["query"], ba.arguments["key"], ba.arguments["value"]
        configs = set()
        for bq, bk, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8),
                                                       (2, 3, 4)):
            if bq * bk > 128 * 128 or (q.shape[-1] > 128 and bq * bk > 64 * 64):
                continue
            if not common.pipeline_fits(stages=stages, rows=common.clamp_block(bk, k.shape[1]),
                                        head_dims=(q.shape[-1], v.shape[-1]), dtype=q.dtype):
                continue
            configs.add(PallasTritonFlashAttentionConfig(
                block_q=common.clamp_block(bq, q.shape[1]),
                block_k=common.clamp_block(bk, k.shape[1]), num_warps=warps,
                num_stages=stages))
        return configs

    def _fwd(self, query: jax.Array, key: jax.Array, value: jax.Array, bias: Any, mask: Any, *,
             scale: float, is_causal: bool, query_seq_lengths: Any, key_value_seq_lengths: Any,
             local_window_size: Any, logits_soft_cap: Any, precision: Any,
             config: PallasTritonFlashAttentionConfig, return_residuals: bool
             ) -> tuple[jax.Array, Any]:
        arguments = dict(
            scale=scale, is_causal=is_causal, local_window_size=local_window_size,
            logits_soft_cap=logits_soft_cap, bias=bias, mask=mask,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            precision=precision)
        batch, seq_q, heads, head_dim = query.shape
        seq_k = key.shape[1]
        block_q = common.clamp_block(config.block_q, seq_q)
        block_k = common.clamp_block(config.block_k, seq_k)
        if not self.interpret:
            common.check_pipeline_fits(_WHAT, "block_k and num_stages",
                                       stages=config.num_stages, rows=block_k,
                                       head_dims=(head_dim, value.shape[-1]),
                                       dtype=query.dtype)
        pad_q, pad_k = tiles.round_up(seq_q, block_q), tiles.round_up(seq_k, block_k)
        q, k, v = prepare_qkv(query, key, value, pad_q, pad_k)
        out, lse = flash_attention_forward(
            q, k, v, prepare_pairwise(bias, seq_q, seq_k, pad_q, pad_k),
            prepare_pairwise(mask, seq_q, seq_k, pad_q, pad_k, jnp.int8),
            lengths_i32(query_seq_lengths), lengths_i32(key_value_seq_lengths),
            spec=kernel_spec(arguments, seq_q, seq_k), block_q=block_q, block_k=block_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
            return_lse=return_residuals, interpret=self.interpret)
        out = out[:, :seq_q, :, :value.shape[-1]]
        if lse is None:  # residuals not asked for
            return out, None
        return out, (lse[:, :, :seq_q],)

    def _default_vjp(self) -> Op:
        return PallasTritonFlashAttentionVjp(interpret=self.interpret)
