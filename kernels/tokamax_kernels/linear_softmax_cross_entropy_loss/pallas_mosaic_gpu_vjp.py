"""`PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp`: the LM-head loss's gradient with the
logits recomputed one vocabulary chunk at a time.

For each chunk of `chunk_vocab` classes a Mosaic GPU kernel (`dlogits_chunk`) recomputes
the logits tiles from x and the chunk's weights and writes
`dlogits = (exp(logits - lse) - onehot) * g` (soft-cap derivative included) in the
inputs' dtype; two cuBLAS GEMMs then give `dweights[:, chunk] = x^T @ dlogits` and
`dx += dlogits @ weights[:, chunk]^T` (dx accumulated in float32). Memory beyond the
inputs and gradients: the (tokens, chunk) dlogits slab and the float32 dx accumulator
(at 16384 x 4096 x 128256 bf16 on the H200: 320 MiB, 1/25 of `xla`'s 8016 MiB).
With `dx_token_chunk` set, dx comes from a second pass over token chunks instead (one
more recompute, no float32 accumulator: the slabs alone). A last chunk past the end
starts early (`size - chunk`); what an earlier chunk covered keeps its value (its
dlogits columns come out zero, so dx takes each column once).
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


@dataclasses.dataclass(frozen=True)
class _Rows:
    """The backward's per-token operands, padded as the kernels need (`padded_rows`)."""

    x: jax.Array  # (T', H)
    labels: jax.Array  # (T',) int32
    lse: jax.Array  # (T',) float32
    g: jax.Array  # (T',) float32, 0 on padding rows

    def at(self, start: Any, size: int) -> _Rows:
        """Rows `start ... start + size - 1`."""
        return _Rows(*(lax.dynamic_slice_in_dim(a, start, size) for a in dataclasses.astuple(
            self)))


def _last_chunk_start(i: Any, chunk: int, size: int) -> tuple[Any, Any]:
    """`(start, first_fresh)` of chunk `i`: a last chunk past the end starts early, at
    `size - chunk`; its entries before `first_fresh` belong to the chunk before it."""
    start = jnp.minimum(i * chunk, size - chunk)
    return start, i * chunk - start


def _vocab_pass(rows: _Rows, weights: jax.Array, *, with_dx: bool, cap: float | None,
                config: MosaicGpuLossConfig) -> tuple[jax.Array | None, jax.Array]:
    """`(dx float32 or None, dweights)` over vocabulary chunks of `config.chunk_vocab`."""
    tokens, hidden = rows.x.shape
    vocab = weights.shape[1]
    chunk = min(config.chunk_vocab, vocab // config.block_vocab * config.block_vocab)
    splits = common.vocab_splits(tokens, chunk // config.block_vocab, config.block_tokens)

    def chunk_step(i: jax.Array, carry: Any) -> Any:
        dx, dweights = carry
        start, first_fresh = _last_chunk_start(i, chunk, vocab)
        w_chunk = lax.dynamic_slice_in_dim(weights, start, chunk, axis=1)
        # Columns before first_fresh come out zero: dx takes each column once.
        dlogits = dlogits_chunk(rows.x, rows.labels, rows.lse, rows.g, w_chunk, start,
                                first_fresh, cap=cap, tiles=config.tiles, vocab_splits=splits)
        if with_dx:
            dx = dx + jnp.matmul(dlogits, w_chunk.T, preferred_element_type=jnp.float32)
        dw_chunk = jnp.matmul(rows.x.T, dlogits).astype(weights.dtype)
        kept = lax.dynamic_slice_in_dim(dweights, start, chunk, axis=1)
        dw_chunk = jnp.where(jnp.arange(chunk) >= first_fresh, dw_chunk, kept)
        return dx, lax.dynamic_update_slice_in_dim(dweights, dw_chunk, start, axis=1)

    dx = jnp.zeros((tokens, hidden), jnp.float32) if with_dx else None
    return lax.fori_loop(0, math.ceil(vocab / chunk), chunk_step, (dx, jnp.zeros_like(weights)))


def _token_pass(rows: _Rows, weights: jax.Array, *, cap: float | None,
                config: MosaicGpuLossConfig) -> jax.Array:
    """dx (T', H) in x's dtype over token chunks of `config.dx_token_chunk`, each from its
    (chunk, V) dlogits: no float32 accumulator over the vocabulary."""
    tokens = rows.x.shape[0]
    chunk = min(config.dx_token_chunk, tokens // config.block_tokens * config.block_tokens)
    blocks = math.ceil(weights.shape[1] / config.block_vocab)
    splits = common.vocab_splits(chunk, blocks, config.block_tokens)
    zero = jnp.zeros((), jnp.int32)

    def chunk_step(i: jax.Array, dx: jax.Array) -> jax.Array:
        start, first_fresh = _last_chunk_start(i, chunk, tokens)
        part = rows.at(start, chunk)
        dlogits = dlogits_chunk(part.x, part.labels, part.lse, part.g, weights, zero, zero,
                                cap=cap, tiles=config.tiles, vocab_splits=splits)
        dx_chunk = jnp.matmul(dlogits, weights.T, preferred_element_type=jnp.float32)
        kept = lax.dynamic_slice_in_dim(dx, start, chunk)
        dx_chunk = jnp.where((jnp.arange(chunk) >= first_fresh)[:, None],
                             dx_chunk.astype(dx.dtype), kept)
        return lax.dynamic_update_slice_in_dim(dx, dx_chunk, start, axis=0)

    return lax.fori_loop(0, math.ceil(tokens / chunk), chunk_step, jnp.zeros_like(rows.x))


def mosaic_backward(x: jax.Array, labels: jax.Array, weights: jax.Array, lse: jax.Array,
                    g: jax.Array, *, cap: float | None, config: MosaicGpuLossConfig
                    ) -> tuple[jax.Array, jax.Array]:
    """`(dx (T, H), dweights (H, V))` from the lse residual and the per-token cotangent g."""

    def run(x: jax.Array, labels: jax.Array, weights: jax.Array, lse: jax.Array,
            g: jax.Array) -> tuple[jax.Array, jax.Array]:
        tokens = x.shape[0]
        rows = _Rows(*common.padded_rows(
            config.block_tokens, x, labels.astype(jnp.int32), lse.astype(jnp.float32),
            g.astype(jnp.float32), fill=(0, -1, 0.0, 0.0)))
        two_pass = config.dx_token_chunk > 0
        dx, dweights = _vocab_pass(rows, weights, with_dx=not two_pass, cap=cap, config=config)
        dx = _token_pass(rows, weights, cap=cap, config=config) if dx is None else dx
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
        g = token_cotangent(dout, labels, reduction)
        dx, dweights = mosaic_backward(
            x.reshape(tokens, x.shape[-1]), labels.reshape(tokens), weights,
            lse.reshape(tokens), g.reshape(tokens), cap=logits_soft_cap, config=config)
        return {"x": dx.reshape(x.shape), "weights": dweights}, None

    def _get_heuristics_config(self, ba: BoundArguments) -> MosaicGpuLossConfig:
        return common.heuristic_config(*ba.arguments["weights"].shape)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[MosaicGpuLossConfig]:
        return common.search_space(*ba.arguments["weights"].shape, backward=True)
