"""The LM-head loss in plain XLA loops over (token block, vocabulary block) tiles.

The forward maps over token blocks and scans over vocabulary blocks with the running
max / sum of an online log-sum-exp and the label's logit, so the largest temporary is
one (block_tokens, block_vocab) tile of logits: the (tokens, V) logits never exist.
The backward (`XlaChunkedLinearSoftmaxCrossEntropyLossVjp`) recomputes each tile from
the `(lse,)` residual, scanning vocabulary blocks outside and token blocks inside:
`dweights` for a vocabulary block is accumulated in float32 over the token blocks and
written once, `dx` is one float32 (tokens, H) accumulator. Memory beyond the inputs
and gradients: that accumulator and a few tiles.

With `gradients="forward"` in the config and a scalar reduction ("sum", "mean"), a
differentiated call computes dx and dweights during its forward pass instead, for a
cotangent of 1 (`gradient_in_forward`): one chunk of `chunk_tokens` tokens at a time
against the whole vocabulary (its logits, their softmax, dlogits, then
`dx[chunk] = dlogits @ weights.T` and `dweights += x[chunk].T @ dlogits` in float32), as
Liger-Kernel's fused linear cross entropy does. A scalar's cotangent is one number, so
the backward only scales the two (`XlaChunkedLinearSoftmaxCrossEntropyLossVjp`): three
GEMMs in a training step where the recomputing backward makes four, at the price of a
float32 (H, V) accumulator and (chunk_tokens, V) tiles. Those gradients are the call's
residuals, a form of its own (`keeps_own_residuals`) that only this module's VJP op
reads. A forward that is not differentiated runs the tiled loss alone in either mode.
Only a pinned config computes the gradients in the forward pass (`keeps_own_residuals`):
a config from the heuristics or a cache keeps the family's residuals.

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
from tokamax_pass.core import BoundArguments, Op, Target

GRADIENTS = ("backward", "forward")


@dataclasses.dataclass(frozen=True)
class XlaChunkedLossConfig:
    """Tokens and vocabulary entries per tile (any positive sizes; clamped to the shape),
    and where a differentiated call computes its gradients.

    `gradients="backward"`: the backward recomputes the logits tile by tile from the lse
    residual. `gradients="forward"` (scalar reductions only): the forward computes them
    `chunk_tokens` tokens at a time against the whole vocabulary and the backward scales
    them; `chunk_tokens` counts in that mode only.
    """

    block_tokens: int
    block_vocab: int
    gradients: str = "backward"
    chunk_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("block_tokens", "block_vocab", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"XlaChunkedLossConfig: {name} must be a positive int, got {value!r}")
        if self.gradients not in GRADIENTS:
            raise ValueError(f"XlaChunkedLossConfig: gradients must be one of {GRADIENTS}, "
                             f"got {self.gradients!r}")

    @property
    def in_forward(self) -> bool:
        """Whether a differentiated call computes its gradients in the forward pass."""
        return self.gradients == "forward"


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
    16384 x 2048 x 32000, with the least memory (a 128 MiB float32 tile). The gradients
    are recomputed in the backward: computing them in the forward pass is a pinned
    config's choice (the autotuner times a forward alone, where both modes do the same
    work)."""
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


def gradient_in_forward(pb: _Problem, reduction: str
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(losses (T,), dx (T, H), dweights (H, V))`: the float32 per-token losses and the
    gradients of their `reduction` ("sum" or "mean") for a cotangent of 1, one block of
    `pb.block_tokens` tokens at a time against the whole vocabulary. dweights is summed
    over the blocks in float32; both gradients come out in the inputs' dtype."""
    bt, dtype = pb.block_tokens, pb.x.dtype
    g = token_cotangent(jnp.ones((), jnp.float32), pb.labels, reduction)
    classes = jnp.arange(pb.vocab)
    mm = dict(precision=pb.precision, preferred_element_type=jnp.float32)

    def token_block(dweights: jax.Array, it: jax.Array) -> tuple[jax.Array, Any]:
        x_blk, labels = pb.rows(pb.x, it), pb.rows(pb.labels, it)
        # Rows an earlier block covered add nothing to dweights (their g is zeroed).
        g_blk = jnp.where(_fresh(it, bt, pb.tokens), pb.rows(g, it), 0.0)
        logits = pb.logits(x_blk, pb.weights)
        lse = jax.nn.logsumexp(logits, axis=-1)
        hit = classes == labels[:, None]
        label_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
        dlogits = (jnp.exp(logits - lse[:, None]) - hit) * g_blk[:, None]
        if pb.cap is not None:
            dlogits = dlogits * (1.0 - jnp.square(logits / pb.cap))
        dlogits = dlogits.astype(dtype)
        dx_blk = jnp.matmul(dlogits, pb.weights.T, **mm).astype(dtype)
        dweights = dweights + jnp.matmul(x_blk.T, dlogits, **mm)
        return dweights, (token_losses(lse, label_logit, labels, pb.vocab), dx_blk)

    init = jnp.zeros(pb.weights.shape, jnp.float32)
    dweights, (losses, dx) = jax.lax.scan(token_block, init,
                                          jnp.arange(math.ceil(pb.tokens / bt)))
    return (_unblock(losses, pb.tokens), _unblock(dx, pb.tokens),
            dweights.astype(pb.weights.dtype))


def scaled_gradients(residuals: tuple[jax.Array, jax.Array],
                     dout: jax.Array) -> dict[str, jax.Array]:
    """The gradients `gradient_in_forward` stored for a cotangent of 1, times the scalar
    loss's cotangent `dout`."""
    dx, dweights = residuals
    g = dout.astype(jnp.float32)
    return {"x": (dx * g).astype(dx.dtype), "weights": (dweights * g).astype(dweights.dtype)}


def _check_gradients_in_forward(ba: BoundArguments, vjp: Op | None) -> None:
    """`NotImplementedError` where gradients computed in the forward pass cannot serve:
    a per-token loss (its cotangent is not one number), or a VJP op of another kind (it
    reads the family's `(lse,)` residuals, not the stored gradients)."""
    if ba.arguments["reduction"] == "none":
        raise NotImplementedError(
            "XlaChunkedLossConfig(gradients='forward') needs a scalar loss (reduction "
            "'sum' or 'mean'): with reduction='none' the cotangent is per token; use "
            "gradients='backward'")
    if vjp is not None and not vjp.keeps_own_residuals():
        raise NotImplementedError(
            f"XlaChunkedLossConfig(gradients='forward') stores gradients that only "
            f"XlaChunkedLinearSoftmaxCrossEntropyLossVjp reads, not {type(vjp).__name__}")


class _PinnedGradientsInForward:
    """`keeps_own_residuals` of the forward op and its VJP op: a pinned
    `gradients="forward"` config, whose residuals are the stored `(dx, dweights)`."""

    config: XlaChunkedLossConfig | None

    def keeps_own_residuals(self) -> bool:
        return self.config is not None and self.config.in_forward


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaChunkedLinearSoftmaxCrossEntropyLoss(_PinnedGradientsInForward,
                                              LinearSoftmaxCrossEntropyLoss):
    """Online log-sum-exp over vocabulary tiles in XLA loops; memory O(one tile)."""

    config_cls = XlaChunkedLossConfig
    implementation = "xla_chunked"

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        if self.keeps_own_residuals():
            _check_gradients_in_forward(ba, self.vjp)

    def _fwd(self, x: jax.Array, labels: jax.Array, weights: jax.Array, *, reduction: str,
             logits_soft_cap: float | None, precision: Any, config: XlaChunkedLossConfig,
             return_residuals: bool) -> tuple[jax.Array, Any]:
        if return_residuals and self.keeps_own_residuals():
            chunked = dataclasses.replace(config, block_tokens=config.chunk_tokens)
            pb = _problem(x, labels, weights, logits_soft_cap, precision, chunked)
            losses, dx, dweights = gradient_in_forward(pb, reduction)
            loss = reduce_losses(losses.reshape(labels.shape), labels, reduction)
            return loss, (dx.reshape(x.shape), dweights)
        pb = _problem(x, labels, weights, logits_soft_cap, precision, config)
        losses, lse = chunked_forward(pb)
        losses, lse = losses.reshape(labels.shape), lse.reshape(labels.shape)
        return reduce_losses(losses, labels, reduction), (lse,) if return_residuals else None

    def _get_heuristics_config(self, ba: BoundArguments) -> XlaChunkedLossConfig:
        return heuristic_config(*_sizes(ba))

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[XlaChunkedLossConfig]:
        return search_space(*_sizes(ba))

    def _default_vjp(self) -> Op:
        """The scaling VJP op, its config pinned, for gradients stored in the forward
        pass; otherwise the recomputing one, its config resolved on its own."""
        config = self.config if self.keeps_own_residuals() else None
        return XlaChunkedLinearSoftmaxCrossEntropyLossVjp(config=config)


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaChunkedLinearSoftmaxCrossEntropyLossVjp(_PinnedGradientsInForward,
                                                 LinearSoftmaxCrossEntropyLossVjp):
    """Chunked backward from the family's `(lse,)` residual (pairs with any forward); with
    a `gradients="forward"` config (pinned by its forward), the stored gradients scaled."""

    config_cls = XlaChunkedLossConfig
    implementation = "xla_chunked"

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        if self.keeps_own_residuals() and len(ba.arguments["residuals"]) != 2:
            raise NotImplementedError(
                "XlaChunkedLossConfig(gradients='forward') scales the (dx, dweights) its "
                "forward stored; these residuals are the family's (lse,)")

    def _fwd(self, residuals: Any, out: Any, dout: jax.Array, *, config: XlaChunkedLossConfig,
             return_residuals: bool, x: jax.Array, labels: jax.Array, weights: jax.Array,
             reduction: str, logits_soft_cap: float | None,
             precision: Any) -> tuple[dict[str, Any], None]:
        del out, return_residuals
        if self.keeps_own_residuals():
            return scaled_gradients(residuals, dout), None
        (lse,) = residuals
        pb = _problem(x, labels, weights, logits_soft_cap, precision, config)
        g = token_cotangent(dout, labels, reduction)
        dx, dweights = chunked_backward(pb, lse.reshape(pb.tokens), g.reshape(pb.tokens))
        return {"x": dx.reshape(x.shape), "weights": dweights}, None

    def _get_heuristics_config(self, ba: BoundArguments) -> XlaChunkedLossConfig:
        return heuristic_config(*_sizes(ba))

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[XlaChunkedLossConfig]:
        return search_space(*_sizes(ba))
