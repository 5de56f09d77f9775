"""Rewrites a jaxpr so every op call carries the implementation and config chosen for it.

Each `tokamax_call` equation, at any depth (inside `jit`, `custom_vjp`/`custom_jvp`,
`scan`, `cond`, `while`, `remat`, `shard_map`, ...), is resolved with
`selection.choose` for every target platform and its `OpCall` replaced by one whose
candidates are exactly the chosen ops, configs pinned. Programs traced later (a
`custom_vjp` forward or backward, traced only when the caller differentiates) are
wrapped so that they are rewritten the same way, under the same results, when they
are traced. `bind_call` binds one call resolved, per device when it is partitioned
(the pass's evaluation of a program, `emit`, binds every call with it).

`bind_pattern` replaces an equation a plain-JAX pattern (`patterns`) matches by an op
call, where `implementation=None` would pick a kernel for it on some target; where it
would pick the plain path (`xla`), the user's equation stays as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
from jax.extend import linear_util as lu
from jax.extend.core import Jaxpr

from tokamax_pass.core import selection, sharding, spec
from tokamax_pass.core.bound_arguments import BoundArguments, NullConfig
from tokamax_pass.core.device import Target
from tokamax_pass.core.op import Op
from tokamax_pass.core.primitive import (
    OpCall,
    bind_call,
    bind_partitioned,
    is_tokamax_call,
)
from tokamax_pass.core.vjp import AutodiffVjp
from tokamax_pass.passes import emit, patterns, walk
from tokamax_pass.passes.candidate import Candidate
from tokamax_pass.passes.graph import Graph


@dataclasses.dataclass(frozen=True)
class Decision:
    """One op call resolved for one target: where it is, what was chosen, from where."""

    path: str
    target: Target
    choice: selection.Choice
    source: str
    # Every candidate of an `implementation=None` call, unconfigured (what autotuning compares).
    alternatives: tuple[BoundArguments, ...]

    @property
    def unconfigured(self) -> BoundArguments:
        """The chosen implementation without its config: what autotuning tunes."""
        return self.choice.bound.replace(op=self.choice.op.replace(config=None))


def tuning_key(ba: BoundArguments) -> str:
    """Identity of an (unconfigured) op on one argument spec."""
    return ba.replace(op=ba.op.replace(config=None)).to_json()


_IMPLEMENTATION_PREFIX = re.compile(r"^(pallas_)?(triton|mosaic_gpu|mosaic|cudnn|xla_chunked|xla)_")


def op_label(op: Op) -> str:
    """The op family as a path element: `layer_norm`, `layer_norm_vjp` for its VJP op
    (whichever implementation was chosen, so every platform's row has the same path)."""
    forward = getattr(op, "forward", None)
    if isinstance(forward, Op):
        return f"{op_label(forward)}_vjp"
    return _IMPLEMENTATION_PREFIX.sub("", op.family_name())


class Rewriter:
    """Resolves op calls for `targets` and rewrites jaxprs; one per traced program.

    `contexts` gives the context managers (autotuning results) under which configs
    are resolved; `record`, when given, collects a `Decision` per op call and target;
    `autotuned(ba)` tells whether this program's own autotuning measured `ba`.
    `rewrite` names the plain-JAX patterns to replace by op calls; `matches`, when
    given, collects a `patterns.RewriteMatch` per equation one of them matched.
    """

    def __init__(self, targets: Sequence[Target], *,
                 contexts: Callable[[], Sequence[Any]] = tuple,
                 record: list[Decision] | None = None,
                 autotuned: Callable[[BoundArguments], bool] = lambda ba: False,
                 rewrite: frozenset[str] = frozenset(),
                 matches: list[patterns.RewriteMatch] | None = None) -> None:
        if not targets:
            raise ValueError("at least one target platform is needed")
        self.targets = tuple(targets)
        self._contexts = contexts
        self._record = record
        self.rewrite_patterns = rewrite
        # The primitives a selected pattern starts at: sub-jaxprs holding one are re-emitted.
        self.pattern_primitives = patterns.primitives(rewrite)
        self._matches = matches
        self._autotuned = autotuned
        # Tracebacks (by id, kept alive) of equations matched before a transformation.
        self._matched_before_transform: dict[int, Any] = {}
        # Decisions taken at an equation inside a larger match before its root was
        # reached (`patterns.enclosing_root`), by the root's id: `(root, kept)`.
        self._decided_roots: dict[int, tuple[Any, Any]] = {}
        # Tracebacks (by id, kept alive) of equations a kept larger match took: what JAX
        # leaves of them in a differentiated program (a dead primal) is no match either.
        self._taken: dict[int, Any] = {}
        self._memo: dict[Any, tuple[OpCall, list[tuple[Target, selection.Choice, str]],
                                    tuple[BoundArguments, ...]]] = {}
        # Set when a call is partitioned by `custom_partitioning`: its per-device calls
        # are resolved (and recorded) only when the program is compiled.
        self.deferred = False

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Enters the results that configs are resolved under (innermost wins)."""
        with contextlib.ExitStack() as stack:
            for context in self._contexts():
                stack.enter_context(context)
            yield

    # --- op calls ---------------------------------------------------------------------

    def resolve_call(self, call: OpCall, avals: Sequence[Any], path: str, *,
                     record: bool = True) -> OpCall:
        new_call, choices, alternatives = self._resolved(call, avals)
        if record and self._record is not None:
            for target, choice, source in choices:
                self._record.append(Decision(
                    f"{path}/{op_label(choice.op)}" if path else op_label(choice.op),
                    target, choice, source, alternatives,
                ))
        return new_call

    def _resolved(self, call: OpCall, avals: Sequence[Any]) -> tuple[
            OpCall, list[tuple[Target, selection.Choice, str]], tuple[BoundArguments, ...]]:
        key = (call, tuple((tuple(a.shape), a.dtype) for a in avals))
        if key not in self._memo:
            self._memo[key] = self._resolve(call, avals)
        return self._memo[key]

    def bind_call(self, call: OpCall, operands: Sequence[Any], path: str) -> list[Any]:
        """Binds `call` resolved, per device when its operands are sharded.

        Each device's call is resolved (and recorded) for the shapes it sees: at trace
        time under `shard_map`, or when the program is compiled under
        `custom_partitioning` (then `deferred` is set: the plan needs a compile).
        """

        def local(*xs: Any) -> Sequence[Any]:
            resolved = self.resolve_call(call, [jax.typeof(x) for x in xs], path)
            return bind_call(resolved, *xs)

        def unpartitioned(*xs: Any) -> Sequence[Any]:
            self.deferred = True
            resolved = self.resolve_call(call, [jax.typeof(x) for x in xs], path, record=False)
            return bind_call(resolved, *xs)

        return bind_partitioned(call, operands, local, unpartitioned)

    # --- plain-JAX patterns ------------------------------------------------------------

    def bind_pattern(self, eqn: Any, read: Callable[[Any], Any], path: str,
                     graph: Graph | None = None) -> list[Any] | None:
        """`eqn`'s outputs computed by an op call, where a selected pattern matches it (or
        the region of `graph` it ends) and `implementation=None` picks a kernel for some
        target; `None` where the equation is to be bound as it is (no pattern, a
        near-miss, or the plain path chosen). `read` gives a variable's value."""
        kept = self.kept_pattern(eqn, path, graph)
        if kept is None:
            return None
        candidate, inputs, traced = kept
        values = [read(v) for v in inputs]
        if any(_placed(jax.typeof(value)) for value in values):
            assert candidate.function is not None  # kept: it has one
            # Traced again at the values' types: inside a `shard_map` under `check_vma`,
            # so that jnp marks its constants varying where they meet varying values;
            # with sharded values (Explicit mesh axes), so that its equations place their
            # results as the values are placed.
            traced = walk.trace_plain(jax.make_jaxpr(candidate.function),
                                      *map(jax.typeof, values))
        outs = emit.emit(self, traced, values, path)
        # Placed as the user's equation placed its results, where the op placed them
        # otherwise (an `out_sharding` inside the matched region).
        return [sharding.placed_like(out, var.aval)
                for out, var in zip(outs, eqn.outvars, strict=True)]

    def kept_pattern(self, eqn: Any, path: str, graph: Graph | None,
                     names: frozenset[str] | None = None, *, differentiated: bool = False
                     ) -> tuple[Candidate, Sequence[Any], Any] | None:
        """The candidate of the pattern (of `names`, all selected ones if `None`) matched
        at `eqn`, its input variables and the jaxpr of its function, where the rewrite
        is kept (`choose_rewrite`); `None` otherwise (the match, if any, is recorded
        either way). Equations derived from ones already matched before a
        transformation (`transforms`) are not matched by `patterns.REGIONS` again. An
        equation inside a larger match (`patterns.enclosing_root`) is left to it where
        that match is kept (decided there and then, once, for its root)."""
        if eqn.primitive.name not in self.pattern_primitives:
            return None
        names = self.rewrite_patterns if names is None else names
        traceback = eqn.source_info.traceback
        if id(traceback) in self._matched_before_transform:
            names = names - patterns.REGIONS
        if id(eqn) in self._decided_roots:
            return self._decided_roots.pop(id(eqn))[1]
        if id(traceback) in self._taken:
            return None
        root = patterns.enclosing_root(eqn, names, graph)
        if root is not None:
            if id(root) not in self._decided_roots:
                kept = self.kept_pattern(root, path, graph, names,
                                         differentiated=differentiated)
                self._decided_roots[id(root)] = (root, kept)
            if self._decided_roots[id(root)][1] is not None:
                if traceback is not None:
                    self._taken[id(traceback)] = traceback
                return None
        candidate = patterns.match(eqn, names, graph)
        if candidate is None:
            return None
        inputs = eqn.invars if candidate.inputs is None else candidate.inputs
        label = "/".join(p for p in (path, candidate.pattern) if p)
        traced = self.choose_rewrite(candidate, [v.aval for v in inputs],
                                     [v.aval for v in eqn.outvars], label,
                                     patterns.source_line(eqn), differentiated=differentiated)
        return None if traced is None else (candidate, inputs, traced)

    def matched_before_transform(self, jaxpr: Jaxpr) -> None:
        """Notes that `jaxpr`'s equations were matched before a transformation: what JAX
        derives from them keeps their tracebacks, and is not matched again."""
        for traceback in walk.tracebacks(jaxpr):
            self._matched_before_transform[id(traceback)] = traceback

    def choose_rewrite(self, candidate: Candidate, in_avals: Sequence[Any],
                       out_avals: Sequence[Any], label: str, line: str, *,
                       differentiated: bool = False) -> Any:
        """The jaxpr of `candidate.function` on `in_avals` where it is kept (a kernel is
        chosen for some target), else `None`; the match is recorded either way.
        `differentiated`: the match is about to be differentiated, so the op's VJP
        call is chosen for too, and a kernel chosen for either keeps it."""

        def note(rewritten: bool, implementation: dict[str, str], reason: str = "",
                 plain_calls: tuple[BoundArguments, ...] = ()) -> None:
            if self._matches is not None:
                self._matches.append(patterns.RewriteMatch(
                    candidate.pattern, label, line, rewritten, implementation, reason,
                    plain_calls))

        if candidate.function is None:
            note(False, {}, candidate.reason)
            return None
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
        try:
            traced = walk.trace_plain(jax.make_jaxpr(candidate.function), *specs)
            decided = traced if not differentiated else walk.trace_plain(
                jax.make_jaxpr(_with_vjp(candidate.function)), *specs)
        except (ValueError, TypeError, NotImplementedError) as e:
            note(False, {}, f"the op does not take it: {e}")
            return None
        wanted = [(tuple(a.shape), a.dtype) for a in out_avals]
        if [(tuple(a.shape), a.dtype) for a in traced.out_avals] != wanted:
            note(False, {}, "the op's output shapes or dtypes differ")
            return None
        try:
            resolved = [self._resolved(call.params["call"], [v.aval for v in call.invars])
                        for call in _op_calls(decided.jaxpr)]
        except NotImplementedError as e:
            note(False, {}, str(e))
            return None
        chosen = [(target, choice) for _, choices, _ in resolved
                  for target, choice, _ in choices]
        implementation = _implementations([(target.platform, choice.op)
                                           for target, choice in chosen])
        if not rewrite_wins(choice.bound for _, choice in chosen):
            note(False, {}, "the plain path is chosen (" + ", ".join(
                f"{platform} {name}" for platform, name in implementation.items()) + ")",
                tuple(choice.bound.replace(op=choice.op.replace(config=None))
                      for _, choice in chosen))
            return None
        note(True, implementation, " | ".join(dict.fromkeys(
            f"{target.platform} {type(choice.op).__name__}: {choice.described(source)}"
            for _, choices, _ in resolved for target, choice, source in choices)))
        return traced

    def _resolve(self, call: OpCall, avals: Sequence[Any]) -> tuple[
            OpCall, list[tuple[Target, selection.Choice, str]], tuple[BoundArguments, ...]]:
        candidates = [call.bound(op, avals) for op in call.candidates]
        symbolic = spec.has_symbolic_dims(avals)
        choices = []
        with self.active():
            for target in self.targets:
                choice = call.choose(candidates, target, symbolic)
                choice = dataclasses.replace(choice, bound=choice.bound.replace(
                    op=_pin_forward_config(choice.op, choice.bound, target)))
                source = choice.source
                if source not in ("explicit", selection.NO_CONFIG) and self._autotuned(
                        choice.bound):
                    source = "autotuned"
                choices.append((target, choice, source))
        ops = _ordered_ops(call.candidates, [c.op for _, c, _ in choices])
        for target, choice, _ in choices:
            first = next(op for op in ops if _runs_on(op, choice.bound, target))
            if first != choice.op:
                raise NotImplementedError(
                    f"cannot pin {type(choice.op).__name__} for {target.platform} in a program "
                    f"that also targets {[t.platform for t in self.targets]}: "
                    f"{type(first).__name__} runs there too and comes first"
                )
        alternatives = () if call.explicit else tuple(candidates)
        return dataclasses.replace(call, candidates=ops, explicit=True), choices, alternatives

    # --- jaxprs -----------------------------------------------------------------------

    def rewrite(self, jaxpr: Jaxpr, path: str = "") -> Jaxpr:
        """`jaxpr` with every op call resolved (the same object if it holds none)."""
        eqns = [self.rewrite_eqn(eqn, path) for eqn in jaxpr.eqns]
        if all(new is old for new, old in zip(eqns, jaxpr.eqns, strict=True)):
            return jaxpr
        return jaxpr.replace(eqns=eqns)

    def rewrite_eqn(self, eqn: Any, path: str) -> Any:
        if is_tokamax_call(eqn.primitive):
            call = self.resolve_call(eqn.params["call"], [v.aval for v in eqn.invars], path)
            return eqn.replace(params={**eqn.params, "call": call})
        if eqn.primitive.name in walk.OPAQUE:
            return eqn
        sub = path if walk.is_op_wrapper(eqn) else "/".join(
            p for p in (path, walk.path_label(eqn)) if p)
        params = {name: self._rewrite_param(name, value, sub)
                  for name, value in eqn.params.items()}
        if all(params[name] is value for name, value in eqn.params.items()):
            return eqn
        return eqn.replace(params=params)

    def _rewrite_param(self, name: str, value: Any, path: str) -> Any:
        if isinstance(value, Jaxpr):
            return self.rewrite(value, path)
        if isinstance(value, tuple) and value and all(isinstance(v, Jaxpr) for v in value):
            new = tuple(self.rewrite(v, f"{path}/{name}{i}") for i, v in enumerate(value))
            return value if all(a is b for a, b in zip(new, value, strict=True)) else new
        if isinstance(value, lu.WrappedFun):
            if name in ("fwd_jaxpr_thunk", "jvp_jaxpr_fun"):
                return emit.wrap_thunk(self, value, path)
            if name == "bwd":
                return emit.wrap_bwd(self, value, path)
        return value


def _placed(aval: Any) -> bool:
    """Whether a value's type says where it lives: varying over `shard_map` axes, or split
    over Explicit mesh axes."""
    return bool(aval.mat.varying) or (sharding.has_explicit_mesh(aval) and any(
        axis is not None for axis in aval.sharding.spec))


def rewrite_wins(chosen: Iterable[BoundArguments]) -> bool:
    """Whether a pattern's op call is kept, given its calls bound to the implementation
    chosen per target (the op's, and its VJP's where the match is differentiated): where
    every target runs a plain path (`xla` computes what the user's equation does), the
    user's equation stays, unless one of those keeps less memory than the equation at its
    speed (`Op.saves_memory_over_plain`)."""
    return any(not ba.op.runs_without_evidence or ba.op.saves_memory_over_plain(ba)
               for ba in chosen)


def _with_vjp(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` and its VJP at its own outputs: the op calls its gradient makes too."""

    def both(*args: Any) -> Any:
        out, pullback = jax.vjp(function, *args)
        return out, pullback(out)

    return both


def _implementations(chosen: Sequence[tuple[str, Op]]) -> dict[str, str]:
    """Per platform, the implementation chosen for a match's op calls (in order: the op,
    then its VJP's): `"triton"`, or each call's where they differ
    (`"layer_norm xla, layer_norm_vjp triton"`)."""
    per_platform: dict[str, list[Op]] = {}
    for platform, op in chosen:
        per_platform.setdefault(platform, []).append(op)
    described = {}
    for platform, ops in per_platform.items():
        names = {op.implementation for op in ops}
        described[platform] = names.pop() if len(names) == 1 else ", ".join(
            f"{op_label(op)} {op.implementation}" for op in ops)
    return described


def _op_calls(jaxpr: Jaxpr) -> Iterator[Any]:
    """The op-call equations of `jaxpr`, at any depth."""
    for eqn in jaxpr.eqns:
        if is_tokamax_call(eqn.primitive):
            yield eqn
        elif eqn.primitive.name not in walk.OPAQUE:
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from _op_calls(sub)


def _pin_forward_config(op: Op, ba: BoundArguments, target: Target) -> Op:
    """An autodiff VJP differentiates its forward op with the forward's config: pin it too."""
    if not isinstance(op, AutodiffVjp) or op.forward.config is not None:
        return op
    if op.forward.config_cls is NullConfig:
        return op
    forward_arguments = {k: v for k, v in ba.arguments.items()
                         if k not in ("residuals", "out", "dout")}
    forward_ba = BoundArguments(op.forward, forward_arguments, ba.vmap)
    config, _ = selection.resolve_config(op.forward, forward_ba, target)
    return op.replace(forward=op.forward.replace(config=config))


def _ordered_ops(candidates: Sequence[Op], chosen: Sequence[Op]) -> tuple[Op, ...]:
    """The chosen ops without repeats, in the call's candidate (preference) order."""

    def rank(op: Op) -> int:
        for i, candidate in enumerate(candidates):
            if _kind(candidate) == _kind(op):
                return i
        for i, candidate in enumerate(candidates):
            if type(candidate) is type(op):
                return i
        return len(candidates)

    unique = list(dict.fromkeys(chosen))
    return tuple(sorted(unique, key=rank))


def _kind(op: Op) -> tuple[type, ...]:
    """An op's class and the classes of the ops it holds (a VJP op's `inner`), configs
    aside: `RaggedDotVjp(inner=<Mosaic TPU>)` and `RaggedDotVjp(inner=<XLA>)` differ."""
    nested = (getattr(op, f.name) for f in dataclasses.fields(op)
              if f.name not in ("config", "vjp"))
    return (type(op), *(type(value) for value in nested if isinstance(value, Op)))


def _runs_on(op: Op, ba: BoundArguments, target: Target) -> bool:
    try:
        op.check_supported(ba.replace(op=op), target)
    except NotImplementedError:
        return False
    return True
