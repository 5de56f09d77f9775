"""`PallasTritonFlashAttentionVjp`: the flash-attention gradient as Pallas Triton kernels.

It consumes the family's residuals `(lse,)` with the forward's `out` and the
cotangent `dout` (and, where lse was an output, its cotangent in `delta`), and
returns dq, dk, dv and (for a float bias) dbias. Two kernels (dK/dV over key blocks,
dQ over query blocks; `_triton_bwd.py`) each own their outputs: no atomics,
so reruns are bitwise identical.
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
from tokamax_kernels.attention._delta import attention_delta
from tokamax_kernels.attention._triton_bwd import flash_attention_backward
from tokamax_kernels.attention.base import DotProductAttentionVjp
from tokamax_kernels.attention.xla_chunked import exact_delta
from tokamax_pass.core import BoundArguments, Target

_WHAT = "PallasTritonFlashAttentionVjp"


@dataclasses.dataclass(frozen=True)
class PallasTritonFlashAttentionVjpConfig:
    """Tiles of the two backward kernels: dK/dV (`*_dkv`) and dQ (`*_dq`)."""

    block_q_dkv: int = 32
    block_k_dkv: int = 128
    num_warps_dkv: int = 4
    num_stages_dkv: int = 3
    block_q_dq: int = 128
    block_k_dq: int = 32
    num_warps_dq: int = 4
    num_stages_dq: int = 3

    def __post_init__(self) -> None:
        for name in ("block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {value}")


def heuristics_config(head_dim: int, seq_q: int, seq_k: int, causal: bool,
                      dtype: Any = jnp.bfloat16, value_head_dim: int | None = None,
                      pair_bytes: int = 0) -> PallasTritonFlashAttentionVjpConfig:
    """H200 choices from `benchmarks/probes/triton_attention_sweep.py` (bf16, benchmark shapes).

    dK/dV: 64x64 tiles, 4 warps at d64 b32 s2048 and d128 b4 s8192 (ahead of 64x128x8
    and 32x128x4). dQ: 128x64, 8 warps, 3 stages, except causal d128 where 64x64x4 won.
    The timings are in `benchmarks/results/nvidia_h200/triton_attention_sweep.json`.
    The streamed blocks (queries for dK/dV, keys for dQ) and their stages then shrink
    until each pipeline fits `common.fit_pipeline`'s budget in `dtype`, with the bias and
    mask tiles (`pair_bytes`) where the call has them.
    """
    if head_dim <= 64:
        config = PallasTritonFlashAttentionVjpConfig(
            block_q_dkv=64, block_k_dkv=64, num_warps_dkv=4, num_stages_dkv=3,
            block_q_dq=128, block_k_dq=64, num_warps_dq=8, num_stages_dq=3)
    elif head_dim <= 128:
        dq = (64, 64, 4, 2) if causal else (128, 64, 8, 3)
        config = PallasTritonFlashAttentionVjpConfig(
            block_q_dkv=64, block_k_dkv=64, num_warps_dkv=4, num_stages_dkv=2,
            block_q_dq=dq[0], block_k_dq=dq[1], num_warps_dq=dq[2], num_stages_dq=dq[3])
    else:
        config = PallasTritonFlashAttentionVjpConfig(
            block_q_dkv=32, block_k_dkv=32, num_warps_dkv=4, num_stages_dkv=1,
            block_q_dq=32, block_k_dq=32, num_warps_dq=4, num_stages_dq=1)
    config = clamp(config, seq_q, seq_k)
    head_dims = (head_dim, head_dim if value_head_dim is None else value_head_dim)
    block_q_dkv, stages_dkv = common.fit_pipeline(
        rows=config.block_q_dkv, stages=config.num_stages_dkv, head_dims=head_dims,
        dtype=dtype, pair_bytes=pair_bytes, across=config.block_k_dkv)
    block_k_dq, stages_dq = common.fit_pipeline(
        rows=config.block_k_dq, stages=config.num_stages_dq, head_dims=head_dims,
        dtype=dtype, pair_bytes=pair_bytes, across=config.block_q_dq)
    config = dataclasses.replace(config, block_q_dkv=block_q_dkv, num_stages_dkv=stages_dkv,
                                 block_k_dq=block_k_dq, num_stages_dq=stages_dq)
    return clamp(config, seq_q, seq_k)


def clamp(config: PallasTritonFlashAttentionVjpConfig, seq_q: int, seq_k: int
          ) -> PallasTritonFlashAttentionVjpConfig:
    """`config` with no block longer than the (power-of-2 padded) sequence."""
    return dataclasses.replace(
        config,
        block_q_dkv=common.clamp_block(config.block_q_dkv, seq_q),
        block_k_dkv=common.clamp_block(config.block_k_dkv, seq_k),
        block_q_dq=common.clamp_block(config.block_q_dq, seq_q),
        block_k_dq=common.clamp_block(config.block_k_dq, seq_k))


def _pipelines(config: PallasTritonFlashAttentionVjpConfig) -> tuple[tuple[str, int, int], ...]:
    """`(fields, rows, stages)` of the two kernels' streamed pipelines: the queries of
    the dK/dV kernel and the keys of the dQ kernel."""
    return (("block_q_dkv and num_stages_dkv", config.block_q_dkv, config.num_stages_dkv),
            ("block_k_dq and num_stages_dq", config.block_k_dq, config.num_stages_dq))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasTritonFlashAttentionVjp(TritonKernel, DotProductAttentionVjp):
    """dq, dk, dv (and dbias) of flash attention in Pallas Triton; `interpret=True` on CPU."""

    config_cls: ClassVar[type] = PallasTritonFlashAttentionVjpConfig

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        common.check_inputs(ba, None if self.interpret else target, _WHAT)

    def _get_heuristics_config(self, ba: BoundArguments) -> PallasTritonFlashAttentionVjpConfig:
        q, k, v = ba.arguments["query"], ba.arguments["key"], ba.arguments["value"]
        return heuristics_config(q.shape[-1], q.shape[1], k.shape[1], ba.arguments["is_causal"],
                                 q.dtype, v.shape[-1],
                                 common.pair_bytes(ba.arguments["bias"], ba.arguments["mask"]))

    def _get_autotuning_configs(self, ba: BoundArguments
                                ) -> set[PallasTritonFlashAttentionVjpConfig]:
        q, k, v = ba.arguments["query"], ba.arguments["key"], ba.arguments["value"]
        head_dims = (q.shape[-1], v.shape[-1])
        configs = set()
        for (bq1, bk1), (bq2, bk2), warps, stages in itertools.product(
                ((32, 128), (64, 128), (64, 64), (32, 64)),
                ((128, 32), (128, 64), (64, 64), (64, 32)), (4, 8), (2, 3)):
            config = clamp(PallasTritonFlashAttentionVjpConfig(
                block_q_dkv=bq1, block_k_dkv=bk1, num_warps_dkv=warps, num_stages_dkv=stages,
                block_q_dq=bq2, block_k_dq=bk2, num_warps_dq=warps, num_stages_dq=stages),
                q.shape[1], k.shape[1])
            if all(common.pipeline_fits(stages=stages, rows=rows, head_dims=head_dims,
                                        dtype=q.dtype)
                   for _, rows, stages in _pipelines(config)):
                configs.add(config)
        return configs

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Any, return_residuals: bool,
             query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
             mask: jax.Array | None, dresiduals: Any = None,
             **statics: Any) -> tuple[dict[str, Any], None]:
        del return_residuals
        config = clamp(config, query.shape[1], key.shape[1])
        if not self.interpret:
            for fields, rows, stages in _pipelines(config):
                common.check_pipeline_fits(_WHAT, fields, stages=stages, rows=rows,
                                           head_dims=(query.shape[-1], value.shape[-1]),
                                           dtype=query.dtype)
        (lse,) = residuals
        batch, seq_q, heads, head_dim = query.shape
        seq_k = key.shape[1]
        q_lengths = common.lengths_i32(statics["query_seq_lengths"])
        kv_lengths = common.lengths_i32(statics["key_value_seq_lengths"])
        pad_q = tiles.round_up(seq_q, max(config.block_q_dkv, config.block_q_dq))
        pad_k = tiles.round_up(seq_k, max(config.block_k_dkv, config.block_k_dq))
        q, k, v = common.prepare_qkv(query, key, value, pad_q, pad_k)
        do = common.pad_axis(common.pad_axis(dout.astype(query.dtype), 1, pad_q), 3,
                             v.shape[-1])
        dlse = None if dresiduals is None else dresiduals[0]
        if bias is None:
            delta = attention_delta(out, dout, dlse)
        else:  # the bias gradient takes the row term's error whole: its exact value
            delta = exact_delta(query, key, value, bias, mask, lse, dout, dlse, **statics)
        # Rows that see nothing (lse = -inf) or lie past their query length get
        # lse2 = +inf, so the kernels' p = exp2(s - lse2) is exactly 0 there.
        empty = ~jnp.isfinite(lse)
        if q_lengths is not None:
            empty = empty | (jnp.arange(seq_q)[None, None, :] >= q_lengths[:, None, None])
        lse2 = jnp.where(empty, jnp.inf, lse * tiles.LOG2E)
        lse2 = common.pad_axis(lse2, 2, pad_q, jnp.inf)
        delta = common.pad_axis(jnp.where(empty, 0.0, delta), 2, pad_q)
        spec = common.kernel_spec(dict(statics, bias=bias, mask=mask), seq_q, seq_k)
        dq, dk, dv, dbias = flash_attention_backward(
            q, k, v, common.prepare_pairwise(bias, seq_q, seq_k, pad_q, pad_k),
            common.prepare_pairwise(mask, seq_q, seq_k, pad_q, pad_k, jnp.int8),
            q_lengths, kv_lengths, do, lse2, delta, spec=spec,
            blocks_dkv=(config.block_q_dkv, config.block_k_dkv),
            blocks_dq=(config.block_q_dq, config.block_k_dq),
            params_dkv=(config.num_warps_dkv, config.num_stages_dkv),
            params_dq=(config.num_warps_dq, config.num_stages_dq),
            interpret=self.interpret)
        grads = {
            "query": dq[:, :seq_q, :, :head_dim],
            "key": dk[:, :seq_k, :, :head_dim],
            "value": dv[:, :seq_k, :, :value.shape[-1]],
        }
        if bias is not None and dbias is not None:  # a bias has a gradient
            dbias = dbias[:, :, :seq_q, :seq_k]
            axes = tuple(i for i, n in enumerate(bias.shape) if n == 1 and dbias.shape[i] != 1)
            grads["bias"] = jnp.sum(dbias, axis=axes, keepdims=True).astype(bias.dtype)
        return grads, None
