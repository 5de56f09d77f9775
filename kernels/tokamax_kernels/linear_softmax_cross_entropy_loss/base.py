"""The linear-softmax-cross-entropy family: argument checks, the XLA reference, its VJP op.

The language-model head and its loss in one op: `x` (..., H) tokens, `weights` (H, V)
and integer `labels` (...). Semantics every implementation follows:

  logits = (x @ weights) in the inputs' dtype (float32 accumulation), then float32
  logits = cap * tanh(logits / cap)                 if logits_soft_cap is set
  loss_t = logsumexp(logits_t) - logits_t[label_t]  for 0 <= label_t < V
           0                                        for label_t < 0 (ignored: padding)
           NaN                                      for label_t >= V (only when traced:
                                                    concrete labels >= V are a ValueError)
  The gradient of a token whose label is >= V is that of its log-sum-exp alone, as
  autodiff of plain JAX's `lse - take_along_axis(logits, label)` gives it (the
  out-of-range gather has none): finite, so a token masked out after the loss adds
  nothing.
  "sum": sum_t loss_t;  "mean": that sum / max(1, #labels >= 0);  "none": loss_t (...).

The loss is float32. The logits are rounded to the inputs' dtype as plain JAX's
`x @ weights` rounds them, so every implementation computes the same numbers.

Residual contract (all implementations): `residuals = (lse,)`, float32 shaped like
`labels`: the logsumexp of each token's (soft-capped) logits. Any forward's
residuals therefore work with any backward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_kernels import _validation as v
from tokamax_kernels.ragged_dot.base import canonical_precision
from tokamax_pass.core import BoundArguments, NullConfig, Op, VjpOp, spec

_OP = "linear_softmax_cross_entropy_loss"
REDUCTIONS = ("sum", "mean", "none")


def _check_labels(labels: Any, x: Any, vocab: int) -> None:
    v.require_array("labels", labels, op=_OP)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"{_OP}: labels must be an integer array of class indices (e.g. int32; -1 marks "
            f"a token to ignore), got dtype {labels.dtype}; soft or one-hot targets are not "
            f"supported"
        )
    if tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"{_OP}: labels must have shape {tuple(x.shape[:-1])} (one label per token: x's "
            f"shape without its last axis H), got {tuple(labels.shape)}"
        )
    if isinstance(labels, (jax.core.Tracer, jax.ShapeDtypeStruct)) or labels.size == 0:
        return
    largest = int(np.max(np.asarray(labels)))
    if largest >= vocab:
        raise ValueError(
            f"{_OP}: labels must be < V = {vocab} (the last axis of weights), got a label "
            f"{largest}; use a negative label (e.g. -1) for tokens to ignore"
        )


def _canonical_soft_cap(cap: Any) -> float | None:
    if cap is None:
        return None
    return v.static_number("logits_soft_cap", cap, op=_OP, minimum=0.0, inclusive=False)


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(logits / cap)`, or `logits` when `cap` is `None`."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def float32_logits(x: jax.Array, weights: jax.Array, precision: Any,
                   cap: float | None) -> jax.Array:
    """Soft-capped float32 logits of `x @ weights`.

    bf16 and float32 products come out in the inputs' dtype, as the plain expression's
    do (bf16 has float32's range; a float32 output would double the logits' traffic).
    float16 ones come out in float32: rounded to float16, logits past 65504 turned into
    inf and the loss into inf or NaN, where the float32 accumulator held them."""
    wide = jnp.float32 if x.dtype == jnp.float16 else None
    logits = jnp.matmul(x, weights, precision=precision, preferred_element_type=wide)
    return soft_cap(logits.astype(jnp.float32), cap)


def reduce_losses(losses: jax.Array, labels: jax.Array, reduction: str) -> jax.Array:
    """Per-token float32 losses (zero where ignored) reduced as `reduction` says."""
    if reduction == "none":
        return losses
    total = jnp.sum(losses)
    if reduction == "sum":
        return total
    return total / jnp.maximum(jnp.sum(labels >= 0), 1).astype(jnp.float32)


def at_or_past(labels: jax.Array, vocab: int) -> jax.Array:
    """`labels >= vocab`, also for a label dtype too narrow to hold `vocab` (no label of it
    reaches V): compared as a Python int, V wrapped in it (int8 labels >= 300 compared
    against 44), and valid labels read as past V, a NaN loss."""
    if vocab > jnp.iinfo(labels.dtype).max:
        return jnp.zeros(labels.shape, jnp.bool_)
    return labels >= vocab


def token_cotangent(dout: jax.Array, labels: jax.Array, reduction: str) -> jax.Array:
    """d(result)/d(loss_t) times the result's cotangent, per token (float32, labels' shape):
    zero for ignored tokens. A label >= V matches no class, so the gradient built from it,
    `(softmax - onehot) * g`, is its log-sum-exp's alone (see the module docstring)."""
    dout = dout.astype(jnp.float32)
    if reduction == "mean":
        dout = dout / jnp.maximum(jnp.sum(labels >= 0), 1).astype(jnp.float32)
    return jnp.where(labels >= 0, jnp.broadcast_to(dout, labels.shape), 0.0)


def token_losses(lse: jax.Array, label_logits: jax.Array, labels: jax.Array,
                 vocab: int) -> jax.Array:
    """`lse - label_logit` per token; 0 for ignored tokens and NaN for labels >= V. The
    NaN is added, not selected, so autodiff of this (the `xla` path's reference) passes
    the log-sum-exp's gradient through, as the VJPs compute it."""
    losses = jnp.where(labels >= 0, lse - label_logits, 0.0)
    return losses + jnp.where(at_or_past(labels, vocab), jnp.nan, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearSoftmaxCrossEntropyLoss(Op[Any]):
    """The reference: the (tokens, V) logits materialized, as plain JAX computes the loss
    (`x @ weights` in the inputs' dtype, then optax-style float32 softmax cross entropy)."""

    # A kernel forward must beat this one by half: the XLA gradient recomputes the logits
    # product, which XLA merges with this forward's when both run in one program, so a
    # kernel forward adds that GEMM back (with the Mosaic forward, faster than this one
    # measured alone, the Llama step ran slower than plain JAX on the H200).
    kernel_margin = 0.5

    def similarity_arguments(self, arguments: Any) -> dict[str, Any]:
        """Tokens x H: how the leading axes of x and labels split does not matter."""
        x, labels = arguments["x"], arguments["labels"]
        tokens = math.prod(x.shape[:-1])
        return {**arguments, "x": jax.ShapeDtypeStruct((tokens, x.shape[-1]), x.dtype),
                "labels": jax.ShapeDtypeStruct((tokens,), labels.dtype)}

    def partition_rule(self, ba: BoundArguments) -> Any:
        """How a call splits over devices (`tokamax_pass.core.sharding`)."""
        from tokamax_kernels.linear_softmax_cross_entropy_loss.sharding import partition_rule

        return partition_rule(ba)

    def bind(self, x: Any, labels: Any, weights: Any, *, reduction: str = "sum",
             logits_soft_cap: float | None = None, precision: Any = None) -> BoundArguments:
        v.require_rank("x", x, range(1, 64), op=_OP)
        v.require_float("x", x, op=_OP)
        v.require_rank("weights", weights, (2,), op=_OP)
        v.require_float("weights", weights, op=_OP)
        if weights.shape[0] != x.shape[-1]:
            raise ValueError(
                f"{_OP}: H mismatch: x is {tuple(x.shape)} (..., H) but weights is "
                f"{tuple(weights.shape)}; weights must be (H, V) = ({x.shape[-1]}, V)"
            )
        if weights.dtype != x.dtype:
            raise ValueError(
                f"{_OP}: x and weights must have the same dtype, got {x.dtype} and "
                f"{weights.dtype}; cast one (e.g. weights.astype(x.dtype))"
            )
        if weights.shape[1] == 0 or math.prod(x.shape[:-1]) == 0:
            raise ValueError(
                f"{_OP}: need at least one token and one class, got x {tuple(x.shape)} and "
                f"weights {tuple(weights.shape)}"
            )
        _check_labels(labels, x, weights.shape[1])
        if not isinstance(reduction, str) or reduction not in REDUCTIONS:
            raise ValueError(f"{_OP}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        return BoundArguments(self, dict(
            x=x, labels=labels, weights=weights, reduction=str(reduction),
            logits_soft_cap=_canonical_soft_cap(logits_soft_cap),
            precision=canonical_precision(precision, op=_OP),
        ))

    def _fwd(self, x: jax.Array, labels: jax.Array, weights: jax.Array, *, reduction: str,
             logits_soft_cap: float | None, precision: Any, config: Any,
             return_residuals: bool) -> tuple[jax.Array, Any]:
        logits = float32_logits(x, weights, precision, logits_soft_cap)
        lse = jax.nn.logsumexp(logits, axis=-1)
        label_logits = jnp.take_along_axis(
            logits, jnp.maximum(labels, 0)[..., None], axis=-1, mode="fill")[..., 0]
        losses = token_losses(lse, label_logits, labels, weights.shape[1])
        return reduce_losses(losses, labels, reduction), (lse,) if return_residuals else None

    def _default_vjp(self) -> Op:
        return LinearSoftmaxCrossEntropyLossVjp()

    def random_arguments(self, ba: BoundArguments, seed: int) -> dict[str, Any]:
        """Autotuning inputs: see `random_arguments`."""
        return random_arguments(ba, seed)


def _vmapped_names(ba: BoundArguments) -> dict[str, list[bool]]:
    """For each top-level argument holding arrays: per `jax.vmap` level, whether it is mapped."""
    paths = jax.tree_util.tree_flatten_with_path(dict(ba.arguments), is_leaf=lambda a: a is None)
    names = [path[0].key for path, leaf in paths[0] if spec.is_array(leaf)]
    mapped: dict[str, list[bool]] = {}
    for i, name in enumerate(names):
        levels = [level.axes[i] is not None for level in ba.vmap]
        mapped[name] = [a or b for a, b in zip(mapped.get(name, levels), levels, strict=True)]
    return mapped


def random_arguments(ba: BoundArguments, seed: int) -> dict[str, Any]:
    """Normal x, weights scaled by 1/sqrt(H) (logits of order one, as in a trained model),
    labels uniform in [0, V) with about one token in eight ignored (-1); the leading axes
    of the `jax.vmap`s around the call included."""
    arguments = dict(ba.arguments)
    mapped = _vmapped_names(ba)

    def shape_of(name: str) -> tuple[int, ...]:
        lead = [level.size for level, m in zip(ba.vmap, mapped[name], strict=True) if m]
        return (*lead, *arguments[name].shape)

    kx, kl, kw, ki = jax.random.split(jax.random.key(seed), 4)
    x, labels, weights = arguments["x"], arguments["labels"], arguments["weights"]
    hidden, vocab = weights.shape
    arguments["x"] = jax.random.normal(kx, shape_of("x")).astype(x.dtype)
    arguments["weights"] = (jax.random.normal(kw, shape_of("weights"))
                            / math.sqrt(hidden)).astype(weights.dtype)
    drawn = jax.random.randint(kl, shape_of("labels"), 0, vocab)
    ignored = jax.random.bernoulli(ki, 0.125, drawn.shape)
    arguments["labels"] = jnp.where(ignored, -1, drawn).astype(labels.dtype)
    return arguments


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearSoftmaxCrossEntropyLossVjp(VjpOp):
    """The gradient as autodiff of the plain expression computes it, from the `(lse,)`
    residual: the logits are recomputed (XLA shares the GEMM with the forward's when both
    are in one program), `dlogits = (softmax - onehot) * g` in float32, cast to the inputs'
    dtype for the two GEMMs `dx = dlogits @ weights.T` and `dweights = x.T @ dlogits`."""

    forward_family = LinearSoftmaxCrossEntropyLoss

    def saves_memory_over_plain(self, ba: BoundArguments) -> bool:
        """For inputs narrower than float32: the gradient keeps each token's log-sum-exp
        and the logits in the inputs' dtype (XLA shares them with the forward), where
        autodiff of the plain expression keeps its float32 log-softmax as well. With
        float32 inputs the two keep the same."""
        return jnp.dtype(ba.arguments["x"].dtype).itemsize < 4

    def reruns_forward(self, ba: BoundArguments) -> bool:
        return self.implementation == "xla"  # the logits GEMM; not the kernels

    def _fwd(self, residuals: Any, out: Any, dout: jax.Array, *, config: Any,
             return_residuals: bool, x: jax.Array, labels: jax.Array, weights: jax.Array,
             reduction: str, logits_soft_cap: float | None,
             precision: Any) -> tuple[dict[str, Any], None]:
        del out, config, return_residuals
        (lse,) = residuals
        vocab = weights.shape[1]
        logits = float32_logits(x, weights, precision, logits_soft_cap)
        g = token_cotangent(dout, labels, reduction)
        onehot = labels[..., None] == jnp.arange(vocab)
        dlogits = (jnp.exp(logits - lse[..., None]) - onehot) * g[..., None]
        if logits_soft_cap is not None:
            dlogits = dlogits * (1.0 - jnp.square(logits / logits_soft_cap))
        dlogits = dlogits.astype(x.dtype)
        dx = jnp.matmul(dlogits, weights.T, precision=precision)
        dweights = jnp.einsum("...h,...v->hv", x, dlogits, precision=precision)
        return {"x": dx, "weights": dweights}, None

    def random_arguments(self, ba: BoundArguments, seed: int) -> dict[str, Any]:
        """The forward's random inputs, a normal cotangent and the reference's residuals."""
        arguments = random_arguments(ba, seed)
        forward = {k: val for k, val in arguments.items() if k not in ("residuals", "out", "dout")}
        reference = LinearSoftmaxCrossEntropyLoss()
        names = ("x", "labels", "weights")

        def run(*operands: Any) -> Any:
            kw = {**forward, **dict(zip(names, operands, strict=True))}
            return reference._fwd(**kw, config=NullConfig(), return_residuals=True)

        mapped = _vmapped_names(ba)
        for i in reversed(range(len(ba.vmap))):
            in_axes = tuple(0 if mapped[name][i] else None for name in names)
            run = jax.vmap(run, in_axes=in_axes, axis_size=ba.vmap[i].size)
        out, residuals = jax.jit(run)(*(arguments[name] for name in names))
        dout = jax.random.normal(jax.random.key(seed + 1), out.shape, out.dtype)
        return {**arguments, "residuals": residuals, "out": out, "dout": dout}
