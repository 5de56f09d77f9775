"""`"dot_product_attention"`: calls of `jax.nn.dot_product_attention` made while
`optimize` traces a function, replaced by the `dot_product_attention` op.

`jax.nn.dot_product_attention` traces to dozens of equations, and a gradient taken
inside the function differentiates them one by one; so it is recognized where it is
called, before JAX differentiates or batches it: while `optimize` traces (`intercepting`),
the `jax.nn` module's function checks whether the op would win for its arguments (the
decision `Rewriter.choose_rewrite` makes for every pattern) and calls the op, or else
`jax.nn`'s own code. Outside `optimize`, and in other threads, it is `jax.nn`'s.

Every argument is taken (`bias`, `mask`, `is_causal`, `scale`, the sequence lengths,
`local_window_size`, `return_residual`, `implementation=None` or `"xla"`); a row whose
keys are all hidden gets `jax.nn`'s value there (the mean of the values) rather than the
op's zeros, and the residual its stopped gradient. `implementation="cudnn"` (jax's
cuDNN kernel, pinned by the caller) and a traced `scale` are left as written.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_pass.passes.candidate import Candidate
from tokamax_pass.passes.swap import CountedSwap

NAME = "dot_product_attention"
_ARRAYS = ("query", "key", "value", "bias", "mask", "query_seq_lengths",
           "key_value_seq_lengths")

# `(candidate, input avals, output avals, label, source line) -> jaxpr or None`: the
# active pass's decision, set while it traces.
Decide = Callable[[Candidate, Sequence[Any], Sequence[Any], str, str], Any]
_DECIDE: contextvars.ContextVar[Decide | None] = contextvars.ContextVar(
    "tokamax_pass_attention_decide", default=None)
_ORIGINAL = jax.nn.dot_product_attention
_SIGNATURE = inspect.signature(_ORIGINAL)


@contextlib.contextmanager
def intercepting(decide: Decide) -> Iterator[None]:
    """Within the block (this context only), `jax.nn.dot_product_attention` calls are
    decided by `decide`."""
    token = _DECIDE.set(decide)
    try:
        with _SWAP.held():
            yield
    finally:
        _DECIDE.reset(token)


def _put(active: bool) -> None:
    """`_intercepted` in `jax.nn` when `active`, JAX's own function otherwise."""
    jax.nn.dot_product_attention = _intercepted if active else _ORIGINAL


_SWAP = CountedSwap(_put)


@functools.wraps(_ORIGINAL)
def _intercepted(*args: Any, **kwargs: Any) -> Any:
    decide = _DECIDE.get()
    if decide is None:
        return _ORIGINAL(*args, **kwargs)
    candidate, arrays = candidate_for(*args, **kwargs)
    in_avals = [jax.typeof(a) for a in arrays]
    out_avals = []
    if candidate.function is not None:
        out_avals = jax.tree.leaves(jax.eval_shape(
            lambda *values: _ORIGINAL(**_arguments(args, kwargs, values)), *arrays))
    caller = sys._getframe(1)  # the user's line that called jax.nn.dot_product_attention
    line = f"{caller.f_code.co_filename}:{caller.f_lineno} ({caller.f_code.co_name})"
    if decide(candidate, in_avals, out_avals, NAME, line) is None:
        return _ORIGINAL(*args, **kwargs)
    assert candidate.function is not None
    return candidate.function(*arrays)


def _arguments(args: Sequence[Any], kwargs: dict[str, Any], values: Sequence[Any]
               ) -> dict[str, Any]:
    """The call's arguments by name, its arrays replaced by `values`."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    names = [name for name in _ARRAYS if bound.arguments.get(name) is not None]
    return {**bound.arguments, **dict(zip(names, values, strict=True))}


def candidate_for(*args: Any, **kwargs: Any) -> tuple[Candidate, list[Any]]:
    """The op's candidate for a `jax.nn.dot_product_attention(*args, **kwargs)` call, and
    the arrays its function takes."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    implementation = given["implementation"]
    if implementation not in (None, "xla"):
        return Candidate(NAME, None, f"implementation={implementation!r} pins jax's own "
                                     "kernel"), []
    if isinstance(given["scale"], jax.core.Tracer):
        return Candidate(NAME, None, "the scale is traced; the op takes a static one"), []
    names = [name for name in _ARRAYS if given[name] is not None]
    arrays = [jnp.asarray(given[name]) for name in names]
    options = dict(scale=given["scale"], is_causal=bool(given["is_causal"]),
                   local_window_size=given["local_window_size"],
                   return_residual=bool(given["return_residual"]))

    def function(*values: Any) -> Any:
        return _attention(dict(zip(names, values, strict=True)), **options)

    return Candidate(NAME, function), arrays


def _as_4d(x: Any) -> Any:
    return None if x is None else jnp.expand_dims(x, tuple(range(4 - x.ndim)))


def _attention(arrays: dict[str, Any], *, scale: Any, is_causal: bool,
               local_window_size: int | tuple[int, int] | None,
               return_residual: bool) -> Any:
    """`jax.nn.dot_product_attention`'s result computed by the op."""
    from tokamax_kernels.attention.api import dot_product_attention

    shape = arrays["query"].shape
    query, key, value, bias, mask = (_as_4d(arrays.get(n)) for n in _ARRAYS[:5])
    q_lengths = arrays.get("query_seq_lengths")
    kv_lengths = arrays.get("key_value_seq_lengths")
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    result = dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
        local_window_size=local_window_size, return_residual=return_residual)
    out, lse = result if return_residual else (result, None)
    hidden = _hidden_rows(query.shape, key.shape, mask, is_causal, local_window_size,
                          q_lengths, kv_lengths)
    if hidden is not None:
        out = jnp.where(hidden[..., None], _mean_values(value, query.shape[2]), out)
    out = out.reshape(shape)
    if lse is None:
        return out
    return out, jax.lax.stop_gradient(lse.reshape(shape[:-1]))


def _mean_values(value: Any, heads: int) -> Any:
    """`(B, 1, N, H)`: each query head's mean value over keys, `jax.nn`'s output for a
    row with every key hidden (uniform probabilities)."""
    mean = jnp.mean(value.astype(jnp.float32), axis=1).astype(value.dtype)
    return jnp.repeat(mean, heads // value.shape[2], axis=1)[:, None]


def _hidden_rows(q_shape: tuple[int, ...], k_shape: tuple[int, ...], mask: Any,
                 is_causal: bool, window: tuple[int, int] | None, q_lengths: Any,
                 kv_lengths: Any) -> Any:
    """`(B, T, N)` bool: the rows inside `query_seq_lengths` whose keys are all hidden
    (by the mask, causality, window and key lengths), or `None` where there are none."""
    batch, t, heads, _ = q_shape
    s = k_shape[1]
    rows = np.arange(t)
    first = np.zeros(t, np.int64)
    last = np.full(t, s - 1, np.int64)
    if is_causal:
        last = np.minimum(last, rows)
    if window is not None:
        first = np.maximum(first, rows - window[0])
        last = np.minimum(last, rows + window[1])
    if mask is None and kv_lengths is None:
        if not (first > last).any():
            return None
        hidden = jnp.broadcast_to(jnp.asarray(first > last)[None, :, None], (batch, t, heads))
    else:
        keys = jnp.arange(s)
        band = (keys[None, :] >= jnp.asarray(first)[:, None]) & (
            keys[None, :] <= jnp.asarray(last)[:, None])  # (T, S)
        visible = jnp.broadcast_to(band, (1, 1, t, s))
        if kv_lengths is not None:
            visible = visible & (keys < jnp.reshape(kv_lengths, (-1, 1, 1, 1)))
        if mask is not None:
            visible = visible & mask
        seen = jnp.broadcast_to(jnp.any(visible, axis=-1), (batch, heads, t))
        hidden = ~jnp.transpose(seen, (0, 2, 1))
    if q_lengths is not None:
        hidden = hidden & (jnp.arange(t)[None, :, None] < jnp.reshape(q_lengths, (-1, 1, 1)))
    return hidden
