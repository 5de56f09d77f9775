"""`optimize`: the pass. A drop-in for `jax.jit` that bakes each op's kernel and config in.

Per input signature the wrapped function is traced to a jaxpr with partitioning off
(every op call a plain `tokamax_call`), and the jaxpr is evaluated in the trace of a
`jax.jit` with every op call (at any depth) re-bound resolved for the target
(explicit config -> autotuning results -> user cache -> library cache -> heuristics,
or measured with `autotune=`) and partitioned per device as `core.sharding` decides:
under a mesh each device's call is resolved for the shapes that device sees. So the
rewrite happens once per signature, inside jit's own trace, and a later call with
the same signature is exactly a `jax.jit` call.

Plain-JAX patterns (`passes.patterns`: `jax.lax.ragged_dot`, norms, gated linear units,
cross-entropy losses and attention written in `jnp`) are replaced by op calls in the
same evaluation, and `jax.nn.dot_product_attention` calls while the function is traced,
where `implementation=None` picks a kernel for them (`rewrite=`). A function that
`jax.grad`, `jax.value_and_grad`, `jax.vjp` or `jax.shard_map` transforms while it is
traced is rewritten before it is transformed (`passes.transforms`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import types
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax

from tokamax_pass.artifact import make_artifact
from tokamax_pass.autotuning.result import AutotuningResult
from tokamax_pass.core import checks, device, selection, spec
from tokamax_pass.core.bound_arguments import BoundArguments, NullConfig
from tokamax_pass.core.caller_warnings import warn_at_caller
from tokamax_pass.export_checks import DISABLE_JAX_EXPORT_CHECKS
from tokamax_pass.passes import emit, patterns, patterns_attention, transforms, walk
from tokamax_pass.passes.plan import Plan
from tokamax_pass.passes.rewrite import Decision, Rewriter, tuning_key

Autotune = Literal["never", "missing", "always"]
_AUTOTUNE_MODES = ("never", "missing", "always")
# A key of JAX's jit caches: a function jitted inside the optimized one and traced while
# the pass intercepts (`jax.nn` attention, a gradient's function) holds the op calls that
# trace chose; each such trace has a value of its own, so that trace's jaxpr is never
# reused by a plain `jax.jit` call or by another trace.
_INTERCEPTED_TRACE = jax.make_user_context(default_value=None)
_INTERCEPTED_TRACES = itertools.count()
# What `jax.jvp` of a `custom_vjp` function (an op call among them) leaves in a jaxpr: an
# equation that raises this error when lowered or evaluated.
_FORWARD_MODE_OF_AN_OP = frozenset({"custom_lin"})
_FORWARD_MODE_ERROR = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"


def optimize(fun: Callable[..., Any], *, static_argnums: int | Sequence[int] | None = None,
             static_argnames: str | Sequence[str] | None = None,
             donate_argnums: int | Sequence[int] = (),
             autotune: Autotune = "never", results: Any = None,
             rewrite: bool | str | Sequence[str] = True) -> Optimized:
    """Wraps `fun` like `jax.jit`, with every tokamax_pass op's kernel and config resolved.

    Args:
      fun: the function (it may call `jax.grad`, `jax.vmap`, `lax.scan`, `shard_map`, ...).
      static_argnums, static_argnames, donate_argnums: as for `jax.jit`.
      autotune: `"never"` uses results, caches and heuristics; `"missing"` measures the
        configs of ops that only have a heuristic one; `"always"` measures every op not
        pinned by the caller, and for `implementation=None` every implementation, so the
        fastest is chosen. Measuring runs on first call per signature.
      results: an `AutotuningResult` (or a sequence, later ones winning) whose configs
        take precedence over the caches for this function.
      rewrite: which plain-JAX patterns (`patterns.NAMES`: `"ragged_dot"`,
        `"dot_product_attention"`, `"layer_norm"`, `"gated_linear_unit"`,
        `"linear_softmax_cross_entropy_loss"`, `"attention"`) are replaced by op calls
        where a kernel is chosen for them:
        `True` all, `False` none, or a sequence of pattern names.
    """
    optimized = Optimized(fun, static_argnums=static_argnums, static_argnames=static_argnames,
                          donate_argnums=donate_argnums, autotune=autotune, results=results,
                          rewrite=rewrite)
    if autotune == "never":
        # Calls then go straight to jit's C++ dispatch, with no Python frame of ours in
        # between: a cached call costs exactly what a `jax.jit` call costs.
        fast = type("Optimized", (Optimized,), {"__call__": staticmethod(optimized._jitted)})
        optimized.__class__ = fast
    return optimized


class Optimized:
    """`optimize(fun)`: call it like `jax.jit(fun)`; `.plan`, `.lower`, `.export` describe it."""

    def __init__(self, fun: Callable[..., Any], *, static_argnums: int | Sequence[int] | None,
                 static_argnames: str | Sequence[str] | None, donate_argnums: int | Sequence[int],
                 autotune: Autotune, results: Any,
                 rewrite: bool | str | Sequence[str] = True) -> None:
        if not callable(fun):
            raise TypeError(f"optimize: fun must be callable, got {type(fun).__name__}")
        if autotune not in _AUTOTUNE_MODES:
            raise ValueError(
                f"optimize: autotune must be one of {_AUTOTUNE_MODES}, got {autotune!r}")
        # Checked here, where `jax.jit` would fail with "'str' object cannot be interpreted
        # as an integer" and no argument's name.
        if static_argnums is not None:
            checks.require_ints("optimize", "static_argnums", static_argnums)
        checks.require_ints("optimize", "donate_argnums", donate_argnums)
        if static_argnames is not None:
            checks.require_strs("optimize", "static_argnames", static_argnames)
        self.fun = fun
        self.autotune = autotune
        self.results = _as_results(results)
        self.rewrite = patterns.selected(rewrite)
        # The statics `None` where not given, as `jax.jit`'s defaults: it then finds the
        # positions `static_argnames` names (given `()`, it did not, and `f(x, "sum")`, "sum"
        # static by name, failed in JAX as a non-array argument).
        self._jit_kwargs: dict[str, Any] = dict(
            static_argnums=static_argnums, static_argnames=static_argnames,
            donate_argnums=donate_argnums)
        self._tuned: list[Any] = []
        self._tuned_signatures: set[Any] = set()
        self._jitted = self._jit(platforms=None, record=None)
        functools.update_wrapper(self, fun)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.autotune != "never":
            self._autotune_for(args, kwargs)
        return self._jitted(*args, **kwargs)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """A method when read from an instance (`model.apply(x)` calls it with `model`
        first), as a function or `jax.jit` object is, so `optimize` decorates methods
        (`@functools.partial(optimize, static_argnums=0)` makes the instance static)."""
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"optimize({getattr(self.fun, '__name__', self.fun)!r}, autotune={self.autotune!r})"

    # --- inspection and export --------------------------------------------------------

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """Which implementation and config each op gets for these arguments, and why.

        Arguments may be arrays or `jax.ShapeDtypeStruct`s (statics as values).
        """
        if self.autotune != "never":
            self._autotune_for(args, kwargs)
        return Plan.from_decisions(*self._trace(args, kwargs, platforms=None))

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The lowered program (StableHLO with each op's spec as metadata), like `jit.lower`."""
        if self.autotune != "never":
            self._autotune_for(args, kwargs)
        return self._jitted.lower(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> jax.stages.Traced:
        """The traced program, like `jit.trace`."""
        if self.autotune != "never":
            self._autotune_for(args, kwargs)
        return self._jitted.trace(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The outputs' shapes and dtypes, like `jit.eval_shape`; nothing is measured."""
        return self._jitted.eval_shape(*args, **kwargs)

    def export(self, *args: Any, platforms: Sequence[str] | None = None,
               device_kind: str | Sequence[str] | None = None,
               name: str | None = None) -> Any:
        """A tuned StableHLO artifact; see `tokamax_pass.export`."""
        return make_artifact(self, args, platforms=platforms, device_kind=device_kind,
                             name=name)

    def static_positions(self, count: int) -> frozenset[int]:
        """Which of `count` positional arguments `jax.jit` takes as static: those
        `static_argnums` names (negative ones from the end) and the positional parameters
        `static_argnames` names."""
        nums, names = self._jit_kwargs["static_argnums"], self._jit_kwargs["static_argnames"]
        nums = () if nums is None else nums if isinstance(nums, (list, tuple)) else (nums,)
        names = () if names is None else (names,) if isinstance(names, str) else names
        positions = {n % count for n in nums if -count <= n < count}
        try:
            parameters = list(inspect.signature(self.fun).parameters.values())[:count]
        except (TypeError, ValueError):  # no signature: jax.jit maps no names either
            return frozenset(positions)
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positions.update(i for i, p in enumerate(parameters)
                         if p.name in names and p.kind in positional)
        return frozenset(positions)

    def export_with_plan(self, args: Sequence[Any], platforms: Sequence[str]
                         ) -> tuple[jax.export.Exported, Plan]:
        """`jax.export` of the rewritten program for `platforms`, with the decisions made."""
        if self.autotune != "never":
            self._autotune_for(tuple(args), {})
        record: list[Decision] = []
        matches: list[patterns.RewriteMatch] = []
        jitted = self._jit(platforms=tuple(platforms), record=record, matches=matches)
        exported = jax.export.export(jitted, platforms=tuple(platforms),
                                     disabled_checks=DISABLE_JAX_EXPORT_CHECKS)(*args)
        return exported, Plan.from_decisions(record, matches)

    # --- the pass ---------------------------------------------------------------------

    def _contexts(self) -> list[Any]:
        # Tuned results first, so the caller's `results=` win over them.
        return [*self._tuned, *self.results]

    def _jit(self, *, platforms: tuple[str, ...] | None, record: list[Decision] | None,
             rewriters: list[Rewriter] | None = None,
             matches: list[patterns.RewriteMatch] | None = None) -> Any:
        return jax.jit(self._body(platforms, record, rewriters, matches), **self._jit_kwargs)

    def _body(self, platforms: tuple[str, ...] | None, record: list[Decision] | None,
              rewriters: list[Rewriter] | None = None,
              matches: list[patterns.RewriteMatch] | None = None) -> Callable[..., Any]:
        fun = self.fun

        @functools.wraps(fun)
        def body(*args: Any, **kwargs: Any) -> Any:
            targets = _targets(platforms)
            _warn_if_no_results_apply(self.results, targets)
            logs = [log for log in (record, rewriters, matches) if log is not None]
            marks = [len(log) for log in logs]
            outs = trace(targets, args, kwargs, intercept=True)
            if outs is None:
                # A region rewritten while the function was traced (a `jax.nn` attention
                # call, a gradient's function) is differentiated in forward mode
                # (`jax.jvp`, `jax.linearize`, `jax.jacfwd`), which an op's `custom_vjp`
                # does not have: traced again with those left as written, the jaxpr's
                # patterns still matched.
                for log, mark in zip(logs, marks, strict=True):
                    del log[mark:]
                outs = trace(targets, args, kwargs, intercept=False)
            assert outs is not None
            return outs

        def trace(targets: Any, args: Any, kwargs: Any, *, intercept: bool) -> Any:
            """The function's outputs, traced and rewritten; `None` where `intercept`ing
            put an op under forward-mode autodiff."""
            rewriter = Rewriter(targets, contexts=self._contexts, record=record,
                                autotuned=self._was_tuned, rewrite=self.rewrite,
                                matches=matches)
            if rewriters is not None:
                rewriters.append(rewriter)
            with (_INTERCEPTED_TRACE(next(_INTERCEPTED_TRACES)) if intercept
                  else contextlib.nullcontext()), \
                    (patterns_attention.intercepting(rewriter.choose_rewrite)
                     if intercept and patterns_attention.NAME in self.rewrite
                     else contextlib.nullcontext()), \
                    (transforms.intercepting(rewriter)
                     if intercept and self.rewrite & patterns.REGIONS
                     else contextlib.nullcontext()):
                try:
                    jaxpr, values, out_tree = walk.trace_arguments(fun, args, kwargs)
                except TypeError as error:  # under `vmap`, as `jax.jacfwd` maps it
                    if intercept and _FORWARD_MODE_ERROR in str(error):
                        return None
                    raise
                if intercept and walk.holds_primitives(jaxpr.jaxpr, _FORWARD_MODE_OF_AN_OP):
                    return None
                outs = emit.emit(rewriter, jaxpr, values)
            return jax.tree.unflatten(out_tree, outs)

        return body

    def _trace(self, args: Sequence[Any], kwargs: dict[str, Any],
               platforms: tuple[str, ...] | None
               ) -> tuple[list[Decision], list[patterns.RewriteMatch]]:
        """The decisions and pattern matches for these arguments. Calls partitioned by
        `custom_partitioning` (a `jax.set_mesh` mesh) are resolved per device when the
        program is compiled: then it is compiled, and they are recorded with the shapes
        each device sees."""
        record: list[Decision] = []
        matches: list[patterns.RewriteMatch] = []
        rewriters: list[Rewriter] = []
        traced = self._jit(platforms=platforms, record=record, rewriters=rewriters,
                           matches=matches).trace(*args, **kwargs)
        if any(r.deferred for r in rewriters):
            traced.lower().compile()
        return record, matches

    def _autotune_for(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Measures the ops this signature needs (once per signature), outside any trace."""
        signature = _signature(args, kwargs)
        if signature in self._tuned_signatures:
            return
        to_tune: dict[str, BoundArguments] = {}
        compare = False
        decisions, matches = self._trace(args, kwargs, platforms=None)
        for decision in decisions:
            if _needs_tuning(decision, self.autotune):
                to_tune.setdefault(tuning_key(decision.unconfigured), decision.unconfigured)
                compare = compare or (self.autotune == "always" and len(decision.alternatives) > 1)
        if self.autotune == "always":
            # A pattern left on the plain path: its op's implementations are measured too,
            # and a kernel measured faster then rewrites it.
            for ba in (ba for match in matches for ba in match.plain_calls):
                to_tune.setdefault(tuning_key(ba), ba)
                compare = True
        if to_tune:
            from tokamax_pass.autotuning import autotune

            self._tuned.append(autotune(
                list(to_tune.values()), ignore_cache=self.autotune == "always",
                all_implementations=compare, progress=False,
            ))
        self._tuned_signatures.add(signature)

    def _was_tuned(self, ba: Any) -> bool:
        return any(ba in result for result in self._tuned)


def _needs_tuning(decision: Decision, mode: Autotune) -> bool:
    """`"missing"`: only a heuristic config was found; `"always"`: anything not pinned
    by the caller, including the choice among `implementation=None` candidates."""
    if decision.source in ("explicit", "autotuned"):
        return False
    if mode == "missing":
        return decision.source == selection.HEURISTICS
    return (decision.choice.op.config_cls is not NullConfig
            or len(decision.alternatives) > 1)


def _targets(platforms: tuple[str, ...] | None) -> list[device.Target]:
    if platforms is None:
        return [device.current_target()]
    return [device.lowering_target(p) for p in platforms]


def _warn_if_no_results_apply(results: Sequence[Any], targets: Sequence[device.Target]
                              ) -> None:
    """Warns when `results=` were given and none is for a device compiled for (a result
    applies only to its own device kind): they were silently unused."""
    kinds = {target.device_kind for target in targets}
    if results and all(r.device_kind is not None and r.device_kind not in kinds
                       for r in results):
        warn_at_caller(
            f"optimize: results= are for {sorted({r.device_kind for r in results})}, but "
            f"this program is compiled for {sorted(map(str, kinds))}: none of them is used (an "
            f"AutotuningResult applies to the device kind it was tuned on)")


def _as_results(results: Any) -> tuple[Any, ...]:
    if results is None:
        return ()
    items = tuple(results) if isinstance(results, (list, tuple)) else (results,)
    for item in items:
        if not isinstance(item, AutotuningResult):
            hint = (" (read a saved one with tokamax_pass.AutotuningResult.load(path))"
                    if isinstance(item, (str, os.PathLike)) else "")
            raise TypeError(
                "optimize: results must be an AutotuningResult or a sequence of them, got "
                f"{type(item).__name__}{hint}"
            )
    return items


def _signature(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The arguments' tree, array shapes and dtypes and other (static) values: a `ValueError`
    (`jax.jit`'s) naming an unhashable static value (the set of tuned signatures raised a
    bare "unhashable type: 'set'")."""
    leaves, treedef = jax.tree.flatten((tuple(args), kwargs))
    key = tuple((tuple(x.shape), str(x.dtype)) if spec.is_array(x) else x for x in leaves)
    for value in key:
        try:
            hash(value)
        except TypeError:
            raise ValueError(
                f"optimize: an argument is a {type(value).__name__} ({value!r:.60}), neither "
                f"an array nor hashable: as for jax.jit, static arguments (static_argnums, "
                f"static_argnames) must be hashable: pass a tuple or a frozenset") from None
    return treedef, key
