"""Label smoothing and z-loss around the family's cross entropy, for every implementation.

Per counted token t (0 <= label < V), with l the (soft-capped) logits and ce_t the
family's loss `lse_t - l_{t,y}`:

  label smoothing eps (optax.smooth_labels' targets `(1 - eps) onehot + eps / V`):
    loss_t = lse_t - (1 - eps) l_{t,y} - (eps / V) sum_v l_{t,v}
           = ce_t + eps * (l_{t,y} - mean_v l_{t,v})
  z-loss z (PaLM's auxiliary loss; Liger-Kernel's `lse_square_scale`):
    loss_t += z * lse_t**2,   lse_t = ce_t + l_{t,y}

`l_{t,y}` is one dot product per token (`x_t . weights[:, y_t]`, a gather of columns)
and, without a soft cap, `mean_v l_{t,v} = x_t . mean_v weights[:, v]` one matrix-vector
product: neither needs the (tokens, V) logits, so every implementation keeps its memory
bound and runs its kernels once (one forward, one backward). The smoothing term is
linear in the tokens, so the family's call keeps the requested reduction; the z-loss
squares each token's log-sum-exp, so with it the family returns per-token losses and
the reduction follows here, its gradient reaching the family's VJP as a per-token
cotangent. The mean of soft-capped logits needs every logit, so label smoothing with a
soft cap is `NotImplementedError`.

Ignored tokens (label < 0) get neither term, and no gradient from them; a traced label
>= V keeps the family's NaN loss and the gradient of its log-sum-exp alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_kernels import _validation as v
from tokamax_kernels.linear_softmax_cross_entropy_loss.base import (
    at_or_past,
    reduce_losses,
    soft_cap,
)
from tokamax_kernels.ragged_dot.base import canonical_precision

_OP = "linear_softmax_cross_entropy_loss"


def canonical_label_smoothing(value: Any) -> float:
    """`value` as a Python float in [0, 1]."""
    number = v.static_number("label_smoothing", value, op=_OP, minimum=0.0, inclusive=True)
    if number > 1.0:
        raise ValueError(f"{_OP}: label_smoothing must be in [0, 1], got {value!r}")
    return number


def canonical_z_loss(value: Any) -> float:
    """`value` as a Python float >= 0."""
    return v.static_number("z_loss", value, op=_OP, minimum=0.0, inclusive=True)


def check_supported(label_smoothing: float, logits_soft_cap: float | None) -> None:
    """`NotImplementedError` for label smoothing with a soft cap (module docstring)."""
    if label_smoothing and logits_soft_cap is not None:
        raise NotImplementedError(
            f"{_OP}: label_smoothing with logits_soft_cap is not supported: the smoothed "
            f"loss needs the mean of the soft-capped logits, which takes all (tokens, V) "
            f"of them")


def _label_logits(x: jax.Array, classes: jax.Array, weights: jax.Array, precision: Any,
                  cap: float | None) -> jax.Array:
    """float32 (soft-capped) logit of each token's class, `x_t . weights[:, class_t]`,
    rounded as the family's `x @ weights` rounds its logits (float16: kept float32). The
    leading axes stay as they are, so tokens split over devices are not gathered."""
    wide = jnp.float32 if x.dtype == jnp.float16 else None
    columns = jnp.take(weights, classes, axis=1)  # (H, ...)
    logits = jnp.einsum("...h,h...->...", x, columns, precision=precision,
                        preferred_element_type=wide)
    return soft_cap(logits.astype(jnp.float32), cap)


def _mean_logits(x: jax.Array, weights: jax.Array, precision: Any) -> jax.Array:
    """float32 `mean_v (x @ weights)[..., v]` as one matrix-vector product."""
    mean_column = jnp.mean(weights.astype(jnp.float32), axis=1)
    return jnp.matmul(x.astype(jnp.float32), mean_column, precision=precision)


def with_options(run: Callable[[str], jax.Array], x: jax.Array, labels: jax.Array,
                 weights: jax.Array, *, reduction: str, logits_soft_cap: float | None,
                 precision: Any, label_smoothing: float, z_loss: float) -> jax.Array:
    """The loss with label smoothing and z-loss, from `run(reduction)`: the family's
    cross entropy of these arguments, reduced as asked (called once, first, so that its
    checks of the arguments come before anything here reads them)."""
    out = run("none" if z_loss else reduction)
    labels = jnp.asarray(labels)
    cap = None if logits_soft_cap is None else float(logits_soft_cap)  # checked by `run`
    precision = canonical_precision(precision, op=_OP)
    counted = (labels >= 0) & ~at_or_past(labels, weights.shape[1])
    classes = jnp.where(counted, labels, 0)
    label_logits = _label_logits(x, classes, weights, precision, cap)
    extra = jnp.zeros(labels.shape, jnp.float32)
    if label_smoothing:
        extra = label_smoothing * (label_logits - _mean_logits(x, weights, precision))
    if not z_loss:
        return out + reduce_losses(jnp.where(counted, extra, 0.0), labels, reduction)
    lse = jnp.where(counted, out + label_logits, 0.0)
    extra = jnp.where(counted, extra + z_loss * jnp.square(lse), 0.0)
    return reduce_losses(out + extra, labels, reduction)
