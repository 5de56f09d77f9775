"""`PallasMosaicTpuFlashAttention`: flash attention (forward) as a Pallas Mosaic TPU kernel.

Causal or not, GQA/MQA, cross attention, query and key/value sequence lengths, local
windows and soft cap; bf16 and f32; head dims up to 256. No bias or mask (those
calls fall back). Under `jax.vmap` the mapped axes fold into the kernel's batch axis
(`_mosaic_tpu_common.batch_folded`). The kernel is `_mosaic_tpu_fwd_kernel.py`, the gradient
`pallas_mosaic_tpu_vjp.py`. `PallasMosaicTpuAttention` is the same class under the
name the Tokamax documents use. Nothing here has been timed on a TPU: the block
sizes follow the generation's MXU width, and `implementation=None` runs this kernel
only where a measurement on a TPU shows it faster than the XLA path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax

from tokamax_kernels._mosaic_tpu import MosaicTpuKernel
from tokamax_kernels.attention import _mosaic_tpu_common as tpu
from tokamax_kernels.attention._flash_tiles import round_up
from tokamax_kernels.attention._mosaic_tpu_fwd_kernel import flash_attention_forward
from tokamax_kernels.attention.base import DotProductAttention
from tokamax_pass.core import BoundArguments, Op, Target

_WHAT = "PallasMosaicTpuFlashAttention"
Config = tpu.BlockConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicTpuFlashAttention(MosaicTpuKernel, DotProductAttention):
    """Flash attention forward on TPUs in Pallas Mosaic TPU; `interpret=True` on any platform."""

    config_cls: ClassVar[type] = Config

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        tpu.check_inputs(ba, _WHAT)

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        return tpu.heuristics_config(ba)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        return tpu.search_space(ba)

    def _fwd(self, query: jax.Array, key: jax.Array, value: jax.Array, bias: Any, mask: Any, *,
             scale: float, is_causal: bool, query_seq_lengths: Any, key_value_seq_lengths: Any,
             local_window_size: Any, logits_soft_cap: Any, precision: Any, config: Config,
             return_residuals: bool) -> tuple[jax.Array, Any]:
        del bias, mask  # None: `check_inputs`
        batch, seq_q, _, _ = query.shape
        seq_k = key.shape[1]
        arguments = dict(scale=scale, is_causal=is_causal, local_window_size=local_window_size,
                         logits_soft_cap=logits_soft_cap, precision=precision,
                         query_seq_lengths=query_seq_lengths,
                         key_value_seq_lengths=key_value_seq_lengths)
        blocks = config.clamped(seq_q, seq_k)
        pad_q, pad_k = round_up(seq_q, blocks.block_q), round_up(seq_k, blocks.block_k)
        kernel = functools.partial(
            flash_attention_forward, spec=tpu.kernel_spec(arguments, seq_q, seq_k),
            block_q=blocks.block_q, block_k=blocks.block_k, interpret=self.pallas_interpret())
        out, lse = tpu.batch_folded(kernel)(
            tpu.to_kernel_layout(query, pad_q), tpu.to_kernel_layout(key, pad_k),
            tpu.to_kernel_layout(value, pad_k),
            tpu.lengths(query_seq_lengths, batch, seq_q),
            tpu.lengths(key_value_seq_lengths, batch, seq_k))
        out = tpu.from_kernel_layout(out, seq_q)
        return out, ((lse[:, :, :seq_q, 0],) if return_residuals else None)

    def _default_vjp(self) -> Op:
        from tokamax_kernels.attention.pallas_mosaic_tpu_vjp import (
            PallasMosaicTpuFlashAttentionVjp,
        )

        return PallasMosaicTpuFlashAttentionVjp(interpret=self.interpret)


# The name the Tokamax documents bind (`tokamax.PallasMosaicTpuAttention.bind(q, k, v)`).
PallasMosaicTpuAttention = PallasMosaicTpuFlashAttention
