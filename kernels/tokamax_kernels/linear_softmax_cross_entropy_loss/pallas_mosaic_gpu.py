"""`PallasMosaicGpuLinearSoftmaxCrossEntropyLoss`: the LM-head loss as a Hopper Mosaic GPU
kernel that keeps its logits tiles in registers.

The kernel (`_mosaic_gpu_kernels.forward_stats`) gives each token's logsumexp and its
label's logit; the loss and its reduction are a few XLA element-wise ops on those
(tokens,) vectors. No (tokens, V) array exists. The gradient is
`PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp` (vocabulary chunks of dlogits from a
kernel, then cuBLAS GEMMs). bf16/f16 inputs, the default precision, H a multiple of 64,
V >= 64 and a multiple of 8; any token count, any V tail, soft cap, every reduction,
ignored labels and `jax.vmap` (the forward folds a batch of tokens into one launch when
the weights are shared; the backward launches once per batch entry).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_kernels.linear_softmax_cross_entropy_loss import _mosaic_gpu_common as common
from tokamax_kernels.linear_softmax_cross_entropy_loss._mosaic_gpu_common import (
    MosaicGpuLossConfig,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss._mosaic_gpu_kernels import forward_stats
from tokamax_kernels.linear_softmax_cross_entropy_loss.base import (
    LinearSoftmaxCrossEntropyLoss,
    reduce_losses,
    token_losses,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.pallas_mosaic_gpu_vjp import (
    PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp,
)
from tokamax_pass.core import BoundArguments, Op, Target

_WHAT = "PallasMosaicGpuLinearSoftmaxCrossEntropyLoss"


def mosaic_lse_and_label_logits(x: jax.Array, labels: jax.Array, weights: jax.Array, *,
                                cap: float | None, config: MosaicGpuLossConfig
                                ) -> tuple[jax.Array, jax.Array]:
    """`(lse, label_logit)` (T,) float32 of x (T, H), labels (T,) and weights (H, V)."""

    def run(x: jax.Array, labels: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
        tokens = x.shape[0]
        x, labels = common.padded_rows(config.block_tokens, x, labels.astype(jnp.int32),
                                       fill=(0, -1))
        blocks = math.ceil(weights.shape[1] / config.block_vocab)
        splits = common.vocab_splits(x.shape[0], blocks, config.block_tokens)
        lse, label_logit = forward_stats(x, labels, weights, cap=cap, tiles=config.tiles,
                                         vocab_splits=splits)
        # Merge the splits' partial statistics (a label lies in one split: the others add 0).
        lse = jax.nn.logsumexp(lse, axis=0) if splits > 1 else lse[0]
        return lse[:tokens], jnp.sum(label_logit, axis=0)[:tokens]

    return common.fold_tokens(run, per_token=2)(x, labels, weights)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicGpuLinearSoftmaxCrossEntropyLoss(LinearSoftmaxCrossEntropyLoss):
    """LM-head loss on Hopper GPUs: TMA ring + wgmma, online log-sum-exp in registers."""

    config_cls: ClassVar[type] = MosaicGpuLossConfig
    implementation: ClassVar[str] = "mosaic"
    platforms: ClassVar[frozenset[str] | None] = frozenset({"cuda"})
    slow_lowering: ClassVar[bool] = True

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        common.check_inputs(ba, target, self.config, _WHAT, backward=False)

    def _fwd(self, x: jax.Array, labels: jax.Array, weights: jax.Array, *, reduction: str,
             logits_soft_cap: float | None, precision: Any, config: MosaicGpuLossConfig,
             return_residuals: bool) -> tuple[jax.Array, Any]:
        del precision  # the default only (check_inputs): bf16/f16 products, f32 sums
        tokens = math.prod(labels.shape)
        lse, label_logits = mosaic_lse_and_label_logits(
            x.reshape(tokens, x.shape[-1]), labels.reshape(tokens), weights,
            cap=logits_soft_cap, config=config)
        lse, label_logits = lse.reshape(labels.shape), label_logits.reshape(labels.shape)
        losses = token_losses(lse, label_logits, labels, weights.shape[1])
        return reduce_losses(losses, labels, reduction), (lse,) if return_residuals else None

    def _get_heuristics_config(self, ba: BoundArguments) -> MosaicGpuLossConfig:
        return common.heuristic_config(*ba.arguments["weights"].shape)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[MosaicGpuLossConfig]:
        return common.search_space(*ba.arguments["weights"].shape, backward=False)

    def _default_vjp(self) -> Op:
        return PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp()
