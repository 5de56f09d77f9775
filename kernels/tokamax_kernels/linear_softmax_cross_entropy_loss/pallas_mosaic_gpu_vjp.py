"""`PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp`: the LM-head loss's gradient with the
logits recomputed one vocabulary chunk at a time.

For each chunk of `chunk_vocab` classes a Mosaic GPU kernel (`dlogits_chunk`) recomputes
the logits tiles from x and the chunk's weights and writes
`dlogits = (exp(logits - lse) - onehot) * g` (soft-cap derivative included) in the
inputs' dtype; two cuBLAS GEMMs then give `dweights[:, chunk] = x^T @ dlogits` and
`dx += dlogits @ weights[:, chunk]^T` (dx accumulated in float32). Memory beyond the
inputs and gradients: the (tokens, chunk) dlogits slab and the float32 dx accumulator.
A last chunk past V starts early (`V - chunk`); its columns an earlier chunk covered
get zero dlogits (dx takes each column once) and keep their dweights.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from tokamax_kernels.linear_softmax_cross_entropy_loss import _mosaic_gpu_common as common
from tokamax_kernels.linear_softmax_cross_entropy_loss._mosaic_gpu_common import (
    MosaicGpuLossConfig,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss._mosaic_gpu_kernels import dlogits_chunk
from tokamax_kernels.linear_softmax_cross_entropy_loss.base import (
    LinearSoftmaxCrossEntropyLossVjp,
    token_cotangent,
)
from tokamax_pass.core import BoundArguments, Target

_WHAT = "PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp"


def mosaic_backward(x: jax.Array, labels: jax.Array, weights: jax.Array, lse: jax.Array,
                    g: jax.Array, *, cap: float | None, config: MosaicGpuLossConfig
                    ) -> tuple[jax.Array, jax.Array]:
    """`(dx (T, H), dweights (H, V))` from the lse residual and the per-token cotangent g."""

    def run(x: jax.Array, labels: jax.Array, weights: jax.Array, lse: jax.Array,
            g: jax.Array) -> tuple[jax.Array, jax.Array]:
        tokens, hidden = x.shape
        vocab = weights.shape[1]
        x_rows, labels, lse, g = common.padded_rows(
            config.block_tokens, x, labels.astype(jnp.int32), lse.astype(jnp.float32),
            g.astype(jnp.float32), fill=(0, -1, 0.0, 0.0))
        chunk = min(config.chunk_vocab, vocab // config.block_vocab * config.block_vocab)
        splits = common.vocab_splits(x_rows.shape[0], chunk // config.block_vocab,
                                     config.block_tokens)
        mm = dict(preferred_element_type=jnp.float32)

        def chunk_step(i: jax.Array, carry: Any) -> Any:
            dx, dweights = carry
            start = jnp.minimum(i * chunk, vocab - chunk)
            first_fresh = i * chunk - start  # columns before it belong to the chunk before
            w_chunk = lax.dynamic_slice_in_dim(weights, start, chunk, axis=1)
            dlogits = dlogits_chunk(x_rows, labels, lse, g, w_chunk, start, first_fresh,
                                    cap=cap, tiles=config.tiles, vocab_splits=splits)
            dx = dx + jnp.matmul(dlogits, w_chunk.T, **mm)
            dw_chunk = jnp.matmul(x_rows.T, dlogits).astype(weights.dtype)
            kept = lax.dynamic_slice_in_dim(dweights, start, chunk, axis=1)
            dw_chunk = jnp.where(jnp.arange(chunk) >= first_fresh, dw_chunk, kept)
            return dx, lax.dynamic_update_slice_in_dim(dweights, dw_chunk, start, axis=1)

        init = (jnp.zeros((x_rows.shape[0], hidden), jnp.float32), jnp.zeros_like(weights))
        dx, dweights = lax.fori_loop(0, math.ceil(vocab / chunk), chunk_step, init)
        return dx[:tokens].astype(x.dtype), dweights

    return common.map_batch(run)(x, labels, weights, lse, g)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp(LinearSoftmaxCrossEntropyLossVjp):
    """dx and dweights on Hopper from the family's `(lse,)` residual (any forward's)."""

    config_cls: ClassVar[type] = MosaicGpuLossConfig
    implementation: ClassVar[str] = "mosaic"
    platforms: ClassVar[frozenset[str] | None] = frozenset({"cuda"})
    slow_lowering: ClassVar[bool] = True

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        common.check_inputs(ba, target, self.config, _WHAT, backward=True)

    def _fwd(self, residuals: Any, out: Any, dout: jax.Array, *, config: MosaicGpuLossConfig,
             return_residuals: bool, x: jax.Array, labels: jax.Array, weights: jax.Array,
             reduction: str, logits_soft_cap: float | None,
             precision: Any) -> tuple[dict[str, Any], None]:
        del out, return_residuals, precision
        (lse,) = residuals
        tokens = math.prod(labels.shape)
        g = token_cotangent(dout, labels, weights.shape[1], reduction)
        dx, dweights = mosaic_backward(
            x.reshape(tokens, x.shape[-1]), labels.reshape(tokens), weights,
            lse.reshape(tokens), g.reshape(tokens), cap=logits_soft_cap, config=config)
        return {"x": dx.reshape(x.shape), "weights": dweights}, None

    def _get_heuristics_config(self, ba: BoundArguments) -> MosaicGpuLossConfig:
        return common.heuristic_config(*ba.arguments["weights"].shape, backward=True)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[MosaicGpuLossConfig]:
        return common.search_space(*ba.arguments["weights"].shape, backward=True)
