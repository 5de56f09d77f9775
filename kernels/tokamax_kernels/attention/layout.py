"""The `jax.nn` layouts of attention, folded into the family's rank-4 form and back.

`jax.nn.dot_product_attention` takes `(B, T, N, H)` or `(T, N, H)` inputs (the latter is
what a per-example `jax.vmap` produces) and a bias or mask of rank <= 4 that broadcasts,
after leading 1s are added, to `(B, N, T, S)`; upstream Tokamax also allows any number
of leading batch axes. The family's ops see exactly one batch axis and rank-4 bias and
mask, so the public function folds the leading batch axes (none, one or several) into
one, gives bias and mask the matching rank-4 form, and reshapes the output back to the
query's shape. Rank-4 calls pass through untouched.

`return_residual=True` also returns the logsumexp of each query row's logits; the
family keeps it as `(B, N, T)` float32 with `-inf` for a row that sees nothing, and
`lse_as_jax_nn` gives it `jax.nn`'s form (see there).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_kernels import _validation as v

_OP = "dot_product_attention"
_TRAILING = 3  # (seq, heads, head_dim)


def _array(name: str, value: Any) -> Any:
    """`value` as an array (`jax.nn` takes lists too); `ValueError` naming it otherwise
    (a ragged list, or a `jax.ShapeDtypeStruct`: folding reshapes values)."""
    if value is None:
        if name in ("query", "key", "value"):
            v.require_array(name, value, op=_OP)
        return None
    if isinstance(value, (list, tuple)):
        try:
            return jnp.asarray(value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{_OP}: {name} must be an array or a list that makes one, "
                             f"got a list that does not ({e})") from None
    v.require_array(name, value, op=_OP)
    if isinstance(value, jax.ShapeDtypeStruct):
        raise ValueError(
            f"{_OP}: {name} must be an array, got a jax.ShapeDtypeStruct (a shape without "
            f"values); pass an array, or call the function under jax.eval_shape, "
            f"tokamax_pass.autotune or export to trace it with shapes")
    return value


def _batch_axes(query: Any, key: Any, value: Any) -> tuple[int, ...]:
    """The common leading batch axes of query, key and value (missing leading axes are 1,
    as `jax.nn` reads a `(T, N, H)` input as batch 1)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < _TRAILING:
            raise ValueError(
                f"{_OP}: {name} must have rank >= 3, (..., seq, heads, head_dim) with any "
                f"number of leading batch axes, got shape {tuple(x.shape)}")
    shapes = [tuple(x.shape[:-_TRAILING]) for x in (query, key, value)]
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + s for s in shapes]
    if not padded[0] == padded[1] == padded[2]:
        raise ValueError(
            f"{_OP}: query, key and value must have the same leading batch axes, got "
            f"{shapes[0]}, {shapes[1]} and {shapes[2]} (shapes {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)})")
    return tuple(int(d) for d in padded[0])


def _fold_logits_operand(name: str, x: Any, batch: tuple[int, ...],
                         full: tuple[int, ...]) -> Any:
    """A bias or mask broadcastable to `(*batch, heads, q_seq, kv_seq)` as a rank-4
    `(B|1, heads|1, q_seq|1, kv_seq|1)` array over the folded batch."""
    shape = tuple(int(d) for d in x.shape)
    extra = len(shape) - len(full)
    if extra > 0 and all(d == 1 for d in shape[:extra]):
        shape = shape[extra:]
    padded = (1,) * (len(full) - len(shape)) + shape
    if len(padded) != len(full) or any(d not in (1, f) for d, f in zip(padded, full, strict=True)):
        raise ValueError(
            f"{_OP}: {name} must broadcast to (*batch, heads, q_seq, kv_seq) = {full} "
            f"(each dim 1 or full; leading dims may be left out), got shape {tuple(x.shape)}")
    x = x.reshape(padded)
    n = len(batch)
    if all(d == 1 for d in padded[:n]):
        return x.reshape(1, *padded[n:])
    x = jnp.broadcast_to(x, (*batch, *padded[n:]))
    return x.reshape(math.prod(batch), *padded[n:])


def _fold_lengths(name: str, x: Any, batch: tuple[int, ...]) -> Any:
    """Sequence lengths of shape `batch` (or already folded, or `(1,)` with no batch
    axis, as `jax.nn` takes) as a `(B,)` vector."""
    flat = math.prod(batch)
    if tuple(x.shape) not in (batch, (flat,)):
        raise ValueError(
            f"{_OP}: {name} must have the leading batch axes' shape {batch} (or "
            f"({flat},)), got shape {tuple(x.shape)}")
    return x.reshape(flat)


def needs_folding(query: Any, key: Any, value: Any, bias: Any, mask: Any) -> bool:
    """False where the call already has the family's rank-4 form."""
    return not all(x is None or getattr(x, "ndim", None) == 4
                   for x in (query, key, value, bias, mask))


def fold(query: Any, key: Any, value: Any, bias: Any, mask: Any, query_seq_lengths: Any,
         key_value_seq_lengths: Any) -> tuple[dict[str, Any], tuple[int, ...]]:
    """The arguments in the family's form (one batch axis, rank-4 bias and mask) and the
    output's shape (the query's, with the value's head dim).

    Raises `ValueError` naming the argument where shapes do not line up as `jax.nn` needs.
    """
    query, key, value = (_array(n, x) for n, x in
                         (("query", query), ("key", key), ("value", value)))
    batch = _batch_axes(query, key, value)
    flat = math.prod(batch)
    full = (*batch, int(query.shape[-2]), int(query.shape[-3]), int(key.shape[-3]))
    folded = {name: x.reshape(flat, *x.shape[-_TRAILING:])
              for name, x in (("query", query), ("key", key), ("value", value))}
    for name, given in (("bias", bias), ("mask", mask)):
        x = _array(name, given)
        folded[name] = None if x is None else _fold_logits_operand(name, x, batch, full)
    for name, given in (("query_seq_lengths", query_seq_lengths),
                        ("key_value_seq_lengths", key_value_seq_lengths)):
        x = _array(name, given)
        folded[name] = None if x is None else _fold_lengths(name, x, batch)
    return folded, (*(int(d) for d in query.shape[:-1]), int(value.shape[-1]))


def lse_as_jax_nn(lse: jax.Array, query_shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """The family's lse residual in the form `jax.nn.dot_product_attention(...,
    return_residual=True)` returns (its `xla` implementation, jax 0.11.2):

    * layout `(*batch, T, N)`, the query's shape without head_dim (`(T, N)` unbatched);
    * natural log, in the inputs' dtype (computed in float32, as `jax.nn` does);
    * a row that sees nothing at `jax.nn`'s masked logit, `-0.7 * float32 max` (the
      logsumexp of a row of only masked logits), cast to the dtype (`-inf` in float16).

    Only a transpose, a select and a cast: no pass over the logits. The gradient flows
    back to the family's lse (none to rows that see nothing).
    """
    logits_dtype = jnp.promote_types(dtype, jnp.float32)
    masked = -0.7 * min(float(jnp.finfo(logits_dtype).max), float(np.finfo(np.float32).max))
    lse = jnp.swapaxes(lse, 1, 2).astype(logits_dtype)
    lse = jnp.where(jnp.isneginf(lse), jnp.asarray(masked, logits_dtype), lse)
    return lse.astype(dtype).reshape(query_shape[:-1])
