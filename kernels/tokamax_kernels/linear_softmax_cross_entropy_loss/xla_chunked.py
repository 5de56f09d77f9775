"""The LM-head loss in plain XLA loops over (token block, vocabulary block) tiles.

The forward maps over token blocks and scans over vocabulary blocks with the running
max / sum of an online log-sum-exp and the label's logit, so the largest temporary is
one (block_tokens, block_vocab) tile of logits: the (tokens, V) logits never exist.
The backward (`XlaChunkedLinearSoftmaxCrossEntropyLossVjp`) recomputes each tile from
the `(lse,)` residual, scanning vocabulary blocks outside and token blocks inside:
`dweights` for a vocabulary block is accumulated in float32 over the token blocks and
written once, `dx` is one float32 (tokens, H) accumulator. Memory beyond the inputs
and gradients: that accumulator and a few tiles.

Sizes the blocks do not divide are not padded (padding the (H, V) weights would copy
them): the last block starts early, at `size - block`, and the rows or columns it
shares with the block before it are masked out (`_fresh`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_kernels.linear_softmax_cross_entropy_loss.base import (
    LinearSoftmaxCrossEntropyLoss,
    LinearSoftmaxCrossEntropyLossVjp,
    float32_logits,
    reduce_losses,
    token_cotangent,
    token_losses,
)
from tokamax_pass.core import BoundArguments, Op


@dataclasses.dataclass(frozen=True)
class XlaChunkedLossConfig:
    """Tokens and vocabulary entries per tile (any positive sizes; clamped to the shape)."""

    block_tokens: int
    block_vocab: int

    def __post_init__(self) -> None:
        for name in ("block_tokens", "block_vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"XlaChunkedLossConfig: {name} must be a positive int, got {value!r}")


# One float32 tile of logits at most 256 MiB (a few live at once per loop step): tiles
# that large keep every GEMM of a step big enough to run at cuBLAS's full rate. On the
# H200 (`benchmarks/results/nvidia_h200/lce_chunk_sweep.jsonl`) 16384-token tiles ran
# 1.3x faster than 1024-token ones at 16384 x 4096 x 128256.
_MAX_TILE_ELEMENTS = 1 << 26
_TOKEN_BLOCKS = (4096, 8192, 16384, 32768)
_VOCAB_BLOCKS = (2048, 4096)


def _sizes(ba: BoundArguments) -> tuple[int, int]:
    """(tokens, V) of a bound call."""
    return math.prod(ba.arguments["labels"].shape), ba.arguments["weights"].shape[1]


def heuristic_config(tokens: int, vocab: int) -> XlaChunkedLossConfig:
    """Vocabulary blocks of 2048 and up to 16384 tokens per tile (clamped to the shape):
    the fastest or within 1% of it in the H200 sweep at 16384 x 4096 x 128256 and
    16384 x 2048 x 32000, with the least memory (a 128 MiB float32 tile)."""
    return XlaChunkedLossConfig(min(16384, tokens), min(2048, vocab))


def search_space(tokens: int, vocab: int) -> set[XlaChunkedLossConfig]:
    """Every tile of the block lists (clamped to the shape) within the tile-size cap."""
    return {XlaChunkedLossConfig(min(bt, tokens), min(bv, vocab))
            for bt in _TOKEN_BLOCKS for bv in _VOCAB_BLOCKS
            if min(bt, tokens) * min(bv, vocab) <= _MAX_TILE_ELEMENTS}


def _start(i: Any, block: int, size: int) -> Any:
    """Where block `i` starts: `i * block`, or `size - block` for a last block past the end."""
    return jnp.minimum(i * block, size - block)


def _fresh(i: Any, block: int, size: int) -> jax.Array:
    """(block,) bool: the positions of block `i` that no earlier block covered."""
    return _start(i, block, size) + jnp.arange(block) >= i * block


def _unblock(blocks: jax.Array, size: int) -> jax.Array:
    """(n, block, ...) per-block results -> (size, ...), dropping the last block's repeats."""
    n, block = blocks.shape[:2]
    flat = blocks[:-1].reshape((n - 1) * block, *blocks.shape[2:])
    return jnp.concatenate([flat, blocks[-1, n * block - size:]])


@dataclasses.dataclass(frozen=True)
class _Problem:
    """The call flattened to (T, H) tokens, with its tiles and static options."""

    x: jax.Array  # (T, H)
    labels: jax.Array  # (T,)
    weights: jax.Array  # (H, V)
    cap: float | None
    precision: Any
    block_tokens: int
    block_vocab: int

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    @property
    def vocab(self) -> int:
        return self.weights.shape[1]

    def rows(self, a: jax.Array, it: Any) -> jax.Array:
        """Token block `it` of `a` (T, ...)."""
        start = _start(it, self.block_tokens, self.tokens)
        return jax.lax.dynamic_slice_in_dim(a, start, self.block_tokens, axis=0)

    def columns(self, iv: Any) -> tuple[jax.Array, jax.Array]:
        """Vocabulary block `iv`: weights (H, block) and the columns' class ids (block,)."""
        start = _start(iv, self.block_vocab, self.vocab)
        w_blk = jax.lax.dynamic_slice_in_dim(self.weights, start, self.block_vocab, axis=1)
        return w_blk, start + jnp.arange(self.block_vocab)

    def logits(self, x_blk: jax.Array, w_blk: jax.Array) -> jax.Array:
        return float32_logits(x_blk, w_blk, self.precision, self.cap)


def _problem(x: jax.Array, labels: jax.Array, weights: jax.Array, cap: float | None,
             precision: Any, config: XlaChunkedLossConfig) -> _Problem:
    tokens = math.prod(labels.shape)
    return _Problem(
        x=x.reshape(tokens, x.shape[-1]), labels=labels.reshape(tokens), weights=weights,
        cap=cap, precision=precision, block_tokens=min(config.block_tokens, tokens),
        block_vocab=min(config.block_vocab, weights.shape[1]))


def chunked_forward(pb: _Problem) -> tuple[jax.Array, jax.Array]:
    """`(losses (T,), lse (T,))` in float32, one (block_tokens, block_vocab) tile at a time."""
    bt, bv = pb.block_tokens, pb.block_vocab
    n_vocab = math.ceil(pb.vocab / bv)

    def token_block(it: jax.Array) -> tuple[jax.Array, jax.Array]:
        x_blk, labels = pb.rows(pb.x, it), pb.rows(pb.labels, it)

        def vocab_block(carry: Any, iv: jax.Array) -> tuple[Any, None]:
            row_max, row_sum, label_logit = carry
            w_blk, classes = pb.columns(iv)
            logits = pb.logits(x_blk, w_blk)
            fresh = _fresh(iv, bv, pb.vocab)
            masked = jnp.where(fresh, logits, -jnp.inf)
            new_max = jnp.maximum(row_max, jnp.max(masked, axis=-1))
            row_sum = row_sum * jnp.exp(row_max - new_max) + jnp.sum(
                jnp.exp(masked - new_max[:, None]), axis=-1)
            hit = fresh & (classes == labels[:, None])
            label_logit = label_logit + jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
            return (new_max, row_sum, label_logit), None

        # float32 as the logits are (a bare `jnp.zeros` is float64 under `jax_enable_x64`).
        init = (jnp.full((bt,), -jnp.inf, jnp.float32), jnp.zeros((bt,), jnp.float32),
                jnp.zeros((bt,), jnp.float32))
        (row_max, row_sum, label_logit), _ = jax.lax.scan(vocab_block, init, jnp.arange(n_vocab))
        lse = row_max + jnp.log(row_sum)
        return token_losses(lse, label_logit, labels, pb.vocab), lse

    n_tokens = math.ceil(pb.tokens / bt)
    losses, lse = jax.lax.map(token_block, jnp.arange(n_tokens))
    return _unblock(losses, pb.tokens), _unblock(lse, pb.tokens)


def chunked_backward(pb: _Problem, lse: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(dx (T, H), dweights (H, V))` from the lse residual and the per-token cotangent `g`."""
    bt, bv = pb.block_tokens, pb.block_vocab
    hidden, dtype = pb.x.shape[1], pb.x.dtype
    n_tokens, n_vocab = math.ceil(pb.tokens / bt), math.ceil(pb.vocab / bv)
    mm = dict(precision=pb.precision, preferred_element_type=jnp.float32)

    def vocab_block(carry: Any, iv: jax.Array) -> tuple[Any, None]:
        dx_acc, dweights = carry
        w_blk, classes = pb.columns(iv)
        fresh_columns = _fresh(iv, bv, pb.vocab)

        def token_block(carry: Any, it: jax.Array) -> tuple[Any, None]:
            dx_acc, dw_blk = carry
            x_blk, labels = pb.rows(pb.x, it), pb.rows(pb.labels, it)
            # Rows an earlier token block covered add nothing (their g is zeroed).
            g_blk = jnp.where(_fresh(it, bt, pb.tokens), pb.rows(g, it), 0.0)
            logits = pb.logits(x_blk, w_blk)
            probs = jnp.exp(logits - pb.rows(lse, it)[:, None])
            dlogits = (probs - (classes == labels[:, None])) * g_blk[:, None]
            if pb.cap is not None:
                dlogits = dlogits * (1.0 - jnp.square(logits / pb.cap))
            # Every column's dweights is recomputed (a repeated column's is overwritten by
            # the same value); dx takes each column once.
            dw_blk = dw_blk + jnp.matmul(x_blk.T, dlogits.astype(dtype), **mm)
            dx_rows = jnp.matmul(
                jnp.where(fresh_columns, dlogits, 0.0).astype(dtype), w_blk.T, **mm)
            start = _start(it, bt, pb.tokens)
            current = jax.lax.dynamic_slice_in_dim(dx_acc, start, bt, axis=0)
            dx_acc = jax.lax.dynamic_update_slice_in_dim(dx_acc, current + dx_rows, start, 0)
            return (dx_acc, dw_blk), None

        init = (dx_acc, jnp.zeros((hidden, bv), jnp.float32))
        (dx_acc, dw_blk), _ = jax.lax.scan(token_block, init, jnp.arange(n_tokens))
        dweights = jax.lax.dynamic_update_slice_in_dim(
            dweights, dw_blk.astype(pb.weights.dtype), _start(iv, bv, pb.vocab), axis=1)
        return (dx_acc, dweights), None

    init = (jnp.zeros((pb.tokens, hidden), jnp.float32), jnp.zeros_like(pb.weights))
    (dx, dweights), _ = jax.lax.scan(vocab_block, init, jnp.arange(n_vocab))
    return dx.astype(dtype), dweights


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaChunkedLinearSoftmaxCrossEntropyLoss(LinearSoftmaxCrossEntropyLoss):
    """Online log-sum-exp over vocabulary tiles in XLA loops; memory O(one tile)."""

    config_cls = XlaChunkedLossConfig
    implementation = "xla_chunked"

    def _fwd(self, x: jax.Array, labels: jax.Array, weights: jax.Array, *, reduction: str,
             logits_soft_cap: float | None, precision: Any, config: XlaChunkedLossConfig,
             return_residuals: bool) -> tuple[jax.Array, Any]:
        pb = _problem(x, labels, weights, logits_soft_cap, precision, config)
        losses, lse = chunked_forward(pb)
        losses, lse = losses.reshape(labels.shape), lse.reshape(labels.shape)
        return reduce_losses(losses, labels, reduction), (lse,) if return_residuals else None

    def _get_heuristics_config(self, ba: BoundArguments) -> XlaChunkedLossConfig:
        return heuristic_config(*_sizes(ba))

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[XlaChunkedLossConfig]:
        return search_space(*_sizes(ba))

    def _default_vjp(self) -> Op:
        return XlaChunkedLinearSoftmaxCrossEntropyLossVjp()


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaChunkedLinearSoftmaxCrossEntropyLossVjp(LinearSoftmaxCrossEntropyLossVjp):
    """Chunked backward from the family's `(lse,)` residual (pairs with any forward)."""

    config_cls = XlaChunkedLossConfig
    implementation = "xla_chunked"

    def _fwd(self, residuals: Any, out: Any, dout: jax.Array, *, config: XlaChunkedLossConfig,
             return_residuals: bool, x: jax.Array, labels: jax.Array, weights: jax.Array,
             reduction: str, logits_soft_cap: float | None,
             precision: Any) -> tuple[dict[str, Any], None]:
        del out, return_residuals
        (lse,) = residuals
        pb = _problem(x, labels, weights, logits_soft_cap, precision, config)
        g = token_cotangent(dout, labels, reduction)
        dx, dweights = chunked_backward(pb, lse.reshape(pb.tokens), g.reshape(pb.tokens))
        return {"x": dx.reshape(x.shape), "weights": dweights}, None

    def _get_heuristics_config(self, ba: BoundArguments) -> XlaChunkedLossConfig:
        return heuristic_config(*_sizes(ba))

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[XlaChunkedLossConfig]:
        return search_space(*_sizes(ba))
