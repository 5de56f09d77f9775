"""Functions handed to JAX's transformations while `optimize` traces, rewritten first.

A gradient taken inside the optimized function (`jax.value_and_grad(loss)(params,
batch)` in a training step) differentiates the user's equations one by one: the backward
of a norm, a gated linear unit, a loss or attention written in `jnp` reads values inside
it, so the differentiated program no longer holds the pattern as a region that can be
replaced. So while `optimize` traces (`intercepting`), `jax.grad`, `jax.value_and_grad`
and `jax.vjp` (reverse mode, listed as `vjp` in a plan's paths) and `jax.shard_map` are
handed the function rewritten: it is traced to a jaxpr, and that jaxpr is evaluated
with each match the `implementation=None` rule keeps (`Rewriter.kept_pattern`, the
decision every pattern gets) computed by the op. JAX then differentiates the op through
its own VJP, or maps it per shard; the pass resolves the op calls afterwards, like any
other.

What JAX derives from equations matched here keeps their tracebacks, and the pass does
not match it again (`Rewriter.matched_before_transform`). `jax.grad` and
`value_and_grad` are reached wherever they were made; `jax.vjp` and `jax.shard_map`
where they are called while `optimize` traces, spelled so (not a name imported from
`jax` before). A `shard_map` function made before is met as an equation instead, and
mapped again with its body re-emitted (`emit`). Calls made by the library's own code
(an op's autodiff) or by JAX's other internals, in other threads or outside `optimize`
are JAX's own.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax._src import api as jax_api

from tokamax_pass.core.primitive import bind_call
from tokamax_pass.passes import emit, patterns, walk
from tokamax_pass.passes.graph import Graph
from tokamax_pass.passes.rewrite import Rewriter
from tokamax_pass.passes.swap import CountedSwap

# Reverse mode: `jax.vjp`, and the function `jax.grad` and `jax.value_and_grad` call
# (wherever they were made, before `optimize` too). A function `jax.jvp` or
# `jax.linearize` differentiates is not rewritten: JAX has no forward mode of an op's
# `custom_vjp`.
_VJP = "vjp"
_GRAD_FUNCTION = "value_and_grad_f"  # what `jax.grad` and `jax.value_and_grad` return
# `jax` functions whose function argument (the first) is rewritten when user code calls them.
_PUBLIC = (_VJP, "shard_map")
_ORIGINALS: dict[str, Callable[..., Any]] = {name: getattr(jax, name) for name in _PUBLIC}
_LIBRARY_PACKAGES = ("tokamax_pass", "tokamax_kernels")
_ACTIVE: contextvars.ContextVar[Rewriter | None] = contextvars.ContextVar(
    "tokamax_pass_transforms_rewriter", default=None)
# Set while a function about to be differentiated is traced: a `shard_map` body inside
# it is differentiated too.
_DIFFERENTIATED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tokamax_pass_transforms_differentiated", default=False)


@contextlib.contextmanager
def intercepting(rewriter: Rewriter) -> Iterator[None]:
    """Within the block (this context only), functions handed to JAX's transformations
    are rewritten by `rewriter`'s `patterns.REGIONS` before JAX transforms them."""
    token = _ACTIVE.set(rewriter)
    try:
        with _SWAP.held():
            yield
    finally:
        _ACTIVE.reset(token)


def _put(active: bool) -> None:
    """The intercepting functions in `jax` (and the `vjp` of `jax._src.api`, which its
    `grad` calls) when `active`, JAX's own otherwise."""
    for name in _PUBLIC:
        setattr(jax, name, _FROM_USER_CODE[name] if active else _ORIGINALS[name])
    jax_api.vjp = _FROM_JAX_API if active else _ORIGINALS[_VJP]


_SWAP = CountedSwap(_put)


def _intercepted(name: str, callers: Callable[[Any], bool]) -> Callable[..., Any]:
    """JAX's `name`, handed its function rewritten when called (while `optimize` traces)
    from a frame `callers` accepts."""
    original = _ORIGINALS[name]

    @functools.wraps(original)
    def intercepted(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE.get() is None or not callers(sys._getframe(1)):
            return original(*args, **kwargs)
        if not args or args[0] is None:  # `jax.shard_map(mesh=..., ...)` as a decorator
            return lambda fun: original(_rewritten(fun, name), *args[1:], **kwargs)
        return original(_rewritten(args[0], name), *args[1:], **kwargs)

    return intercepted


def _from_user_code(frame: Any) -> bool:
    """Not the library's own code (an op's autodiff differentiates its reference)."""
    module = frame.f_globals.get("__name__", "")
    return module.split(".", maxsplit=1)[0] not in _LIBRARY_PACKAGES


def _from_grad(frame: Any) -> bool:
    """`jax.grad` or `jax.value_and_grad`; JAX's other internals (`jacrev`, remat, linear
    solves) call `api.vjp` as they are."""
    return (frame.f_globals.get("__name__") == jax_api.__name__
            and frame.f_code.co_name == _GRAD_FUNCTION)


_FROM_USER_CODE = {name: _intercepted(name, _from_user_code) for name in _PUBLIC}
_FROM_JAX_API = _intercepted(_VJP, _from_grad)


def _rewritten(fun: Callable[..., Any], transform: str) -> Callable[..., Any]:
    """`fun`, computing the matches the rule keeps by op calls when called while
    `optimize` traces (else `fun` itself); matches are listed under `transform`."""

    @functools.wraps(fun)
    def primal(*args: Any, **kwargs: Any) -> Any:
        rewriter = _ACTIVE.get()
        if rewriter is None:
            return fun(*args, **kwargs)
        differentiated = transform == _VJP or _DIFFERENTIATED.get()
        token = _DIFFERENTIATED.set(differentiated)
        try:
            jaxpr, values, out_tree = walk.trace_arguments(fun, args, kwargs)
            binder = _PrimalBinder(rewriter, differentiated=differentiated)
            outs = walk.trace_plain(emit.emit, binder, jaxpr, values, transform)
        finally:
            _DIFFERENTIATED.reset(token)
        rewriter.matched_before_transform(jaxpr)
        return jax.tree.unflatten(out_tree, outs)

    return primal


class _PrimalBinder:
    """Evaluates a jaxpr in the current trace (`emit.emit`) with the matches the rule
    keeps computed by their ops; op calls are bound unresolved (the pass resolves them
    in the transformed program). A `shard_map` made before `optimize` is mapped again
    with its body evaluated the same way (`emit`); a body without a pattern's first
    primitive is bound as it is. `differentiated`:
    the rule decides for each op and its VJP (a kernel for either keeps the match)."""

    def __init__(self, rewriter: Rewriter, *, differentiated: bool) -> None:
        self._rewriter = rewriter
        self._differentiated = differentiated
        self._names = rewriter.rewrite_patterns & patterns.REGIONS
        self.pattern_primitives = patterns.primitives(self._names)

    def bind_call(self, call: Any, operands: Sequence[Any], path: str) -> list[Any]:
        return list(bind_call(call, *operands))

    def bind_pattern(self, eqn: Any, read: Callable[[Any], Any], path: str,
                     graph: Graph | None) -> list[Any] | None:
        kept = self._rewriter.kept_pattern(eqn, path, graph, self._names,
                                           differentiated=self._differentiated)
        if kept is None:
            return None
        candidate, inputs, _ = kept
        assert candidate.function is not None
        return jax.tree.leaves(candidate.function(*(read(v) for v in inputs)))

    def rewrite_eqn(self, eqn: Any, path: str) -> Any:
        return eqn
