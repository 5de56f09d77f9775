"""`PallasMosaicTpuFlashAttentionVjp`: the flash-attention gradient as Pallas Mosaic TPU kernels.

It takes the family's residuals `(lse,)` with the forward's `out` and the cotangent
`dout` (and, where lse was an output, its cotangent in `delta`) and returns dq, dk and
dv from two kernels (`_mosaic_tpu_bwd_kernels.py`): dK/dV over key blocks (summing a
GQA group's query heads) and dQ over query blocks.
Same inputs as the forward kernel (no bias or mask), `jax.vmap` folded into the kernels'
batch axis as there; any forward's residuals work.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_kernels._mosaic_tpu import MosaicTpuKernel
from tokamax_kernels.attention import _mosaic_tpu_common as tpu
from tokamax_kernels.attention._delta import attention_delta
from tokamax_kernels.attention._flash_tiles import LOG2E, round_up
from tokamax_kernels.attention._mosaic_tpu_bwd_kernels import flash_attention_backward
from tokamax_kernels.attention.base import DotProductAttentionVjp
from tokamax_pass.core import BoundArguments, Target

_WHAT = "PallasMosaicTpuFlashAttentionVjp"
Config = tpu.BlockConfig


def _pad_rows(x: jax.Array, seq: int, value: float) -> jax.Array:
    """(B, H, Sq) -> (B, H, seq, 1), padded with `value`."""
    return jnp.pad(x, ((0, 0), (0, 0), (0, seq - x.shape[2])), constant_values=value)[..., None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicTpuFlashAttentionVjp(MosaicTpuKernel, DotProductAttentionVjp):
    """dq, dk, dv of flash attention on TPUs in Pallas Mosaic TPU; `interpret=True` anywhere."""

    config_cls: ClassVar[type] = Config

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        tpu.check_inputs(ba, _WHAT)

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        """The forward's blocks, with query blocks no taller than key blocks are wide:
        the dK/dV kernel keeps three (block_q, block_k) float32 tiles live."""
        forward = tpu.heuristics_config(ba)
        q, k = ba.arguments["query"], ba.arguments["key"]
        return Config(forward.block_k, forward.block_k).clamped(q.shape[1], k.shape[1])

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        return tpu.search_space(ba)

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Any, return_residuals: bool,
             query: jax.Array, key: jax.Array, value: jax.Array, bias: Any, mask: Any,
             dresiduals: Any = None, **statics: Any) -> tuple[dict[str, Any], None]:
        del return_residuals, bias, mask  # None: `check_inputs`
        (lse,) = residuals
        batch, seq_q, _, _ = query.shape
        seq_k = key.shape[1]
        blocks = config.clamped(seq_q, seq_k)
        pad_q, pad_k = round_up(seq_q, blocks.block_q), round_up(seq_k, blocks.block_k)
        q_len = tpu.lengths(statics["query_seq_lengths"], batch, seq_q)
        delta = attention_delta(out, dout, None if dresiduals is None else dresiduals[0])
        # Rows that see nothing (lse = -inf) or lie past their query length get
        # lse2 = +inf, so the kernels' p = exp2(s - lse2) is exactly 0 there.
        empty = ~jnp.isfinite(lse) | (jnp.arange(seq_q)[None, None, :] >= q_len[:, None, None])
        lse2 = _pad_rows(jnp.where(empty, jnp.inf, lse * LOG2E), pad_q, jnp.inf)
        delta = _pad_rows(jnp.where(empty, 0.0, delta), pad_q, 0.0)
        kernels = functools.partial(
            flash_attention_backward, spec=tpu.kernel_spec(statics, seq_q, seq_k),
            block_q=blocks.block_q, block_k=blocks.block_k, interpret=self.pallas_interpret())
        dq, dk, dv = tpu.batch_folded(kernels)(
            tpu.to_kernel_layout(query, pad_q), tpu.to_kernel_layout(key, pad_k),
            tpu.to_kernel_layout(value, pad_k),
            tpu.to_kernel_layout(dout.astype(query.dtype), pad_q), lse2, delta, q_len,
            tpu.lengths(statics["key_value_seq_lengths"], batch, seq_k))
        return {"query": tpu.from_kernel_layout(dq, seq_q),
                "key": tpu.from_kernel_layout(dk, seq_k),
                "value": tpu.from_kernel_layout(dv, seq_k)}, None
