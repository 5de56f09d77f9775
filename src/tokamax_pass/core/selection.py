"""The selection policy: which implementation and config an op call gets, and why.

This module is the one place the rule lives. Op calls reach it through
`OpCall.choose` (`core.primitive`), whether bound eagerly, under `jax.jit`, or rewritten
by `optimize` (`passes.rewrite`); the autotuner's staging (`autotuning.staging`) asks it
which implementations could still be chosen. It sits in `core` because ops must be able
to run with no autotuning package imported: `tokamax_pass.autotuning` plugs its
measurements in as a `ConfigSource` (`register_config_source`); kernels never import it.

The order, first that answers wins:

1. an explicit config or implementation (`implementation="triton"`, `op.replace(config=...)`);
2. active `AutotuningResult`s (innermost first), then the user cache, then the library
   cache shipped for the device kind: the registered config sources;
3. for `implementation=None`, the measurements of those sources at a measured
   neighbouring shape (`autotuning.neighbours` finds it; `rank_measured` weighs it);
4. predictions (`core.prediction`), where the target's device kind has a calibration,
   and the implementation's heuristics config;
5. `xla`: the plain-JAX paths, in the family's order.

For `implementation=None` the promise is never to be slower than plain JAX: a kernel runs
only where it was measured (at the shape, else at a neighbour) or predicted faster than
every plain-JAX path by more than its margin. Families state the facts the rule weighs,
as `Op` members: `plain_jax_path` and `runs_without_evidence` (what may run unmeasured),
`kernel_margin`/`kernel_margin_for` (how much faster a kernel must be),
`reruns_forward` (counted at `RERUN_SHARE`), `unmeasured_plain_path_loses` and
`yields_unmeasured_to` (plain paths known slower than another), `evidence_calls` (an op
measured as its nested calls). The rule that weighs them is here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from tokamax_pass.core import errors, options, prediction
from tokamax_pass.core.bound_arguments import BoundArguments, NullConfig
from tokamax_pass.core.device import Target, current_target, lowering_for
from tokamax_pass.core.hooks import HOOKS
from tokamax_pass.core.op import CannotLowerHere, Op

# Appended to a choice's source where `None` would run, on the target itself, an
# implementation this machine cannot lower (`CannotLowerHere`: cuDNN, when a CPU machine
# exports for cuda): the program made here differs from the one the target would make.
UNLOWERABLE_NOTE = "cannot be lowered here"
# A choice's ranking where a config source's measurements ordered the candidates.
MEASURED = "ranked by measurements"
# Config sources that are no measurement: a config-less op's, and the heuristics'.
NO_CONFIG = "no config"
HEURISTICS = "heuristics"


class ConfigSource(Protocol):
    """Somewhere configs and implementation timings can be looked up."""

    def find_config(self, ba: BoundArguments, device_kind: str | None) -> tuple[Any, str] | None:
        """`(config, label)` for `ba.op` on this device kind, or `None` on a miss."""

    def rank(
        self, candidates: Sequence[BoundArguments], device_kind: str | None,
        usable: Sequence[bool] | None = None,
    ) -> list[int] | None:
        """Indices of the usable candidates to try, best first, if this source measured
        enough to compare them; candidates left out must not run. A candidate not
        `usable` (default: all are) cannot run here, but its measurements are evidence
        about the others (`CannotLowerHere`)."""


_SOURCES: list[ConfigSource] = []

# Timings this close are a tie (H200 run-to-run noise is ~4%): among kernels, and among
# plain paths, ties keep the family's automatic order. A kernel displaces the plain-JAX
# paths (`Op.runs_without_evidence`) only when measured faster by more than its
# `Op.kernel_margin_for` the call (this, or more for ops XLA fuses with their neighbours).
TIE_MARGIN = 0.05
# What an XLA gradient that reruns its forward (`Op.reruns_forward`) is taken to cost
# inside a program, as a fraction of its time measured (or predicted) alone: XLA merges
# the rerun with the forward's products, so its lone time overstates it.
RERUN_SHARE = 0.5


def register_config_source(source: ConfigSource) -> None:
    if source not in _SOURCES:
        _SOURCES.append(source)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The implementation (with its config set) chosen for one op call, and why."""

    bound: BoundArguments
    source: str
    # Set where the target itself would run another implementation, one this machine
    # cannot lower (`UNLOWERABLE_NOTE`); shown beside the source in plans and manifests.
    note: str = ""
    # That implementation's name (`"cudnn"`), where `note` is set: the export falls back.
    fallback_from: str | None = None
    # What ordered the candidates, where something did: `MEASURED` (a config source's
    # timings at the shape or a measured neighbour), or "predicted: " and each
    # candidate's predicted time (`core.prediction`); shown beside the source in plans.
    ranking: str = ""

    @property
    def op(self) -> Op:
        return self.bound.op

    def described(self, source: str | None = None) -> str:
        """Why this implementation: `source` (default: this choice's; a plan's may say
        more, "autotuned"), the note, and what ranked it, as plans and manifests show
        them."""
        source = self.source if source is None else source
        # A measured config source already says the call was measured.
        ranking = self.ranking if self.ranking != MEASURED or source in (
            NO_CONFIG, HEURISTICS) else ""
        return "; ".join(part for part in (
            f"{source} ({self.note})" if self.note else source, ranking) if part)


def resolve_config(op: Op, ba: BoundArguments, target: Target | None = None) -> tuple[Any, str]:
    """`(config, source)` for `op` on `ba`; `source` names where it came from."""
    if op.config is not None:
        return op.config, "explicit"
    if op.config_cls is NullConfig:
        return NullConfig(), NO_CONFIG
    target = target or current_target()
    for source in _consulted_sources():
        hit = source.find_config(ba.replace(op=op), target.device_kind)
        if hit is not None:
            return hit
    fallback = options.autotuning_cache_miss_fallback.value
    if fallback == "error":
        raise ValueError(
            f"no config found for {type(op).__name__} on "
            f"{target.device_kind}, and tokamax_pass.config.autotuning_cache_miss_fallback "
            "is 'error': autotune this call or pin a config")
    if fallback == "autotune":
        return _fastest_measured(ba.replace(op=op)), "autotuned on a cache miss"
    with lowering_for(target):
        return op._get_heuristics_config(ba.replace(op=op)), HEURISTICS


HOOKS.resolve_config = resolve_config


def _consulted_sources() -> Sequence[ConfigSource]:
    """The config sources, or none under `tokamax_pass.config.ignore_autotuning_cache`."""
    return () if options.ignore_autotuning_cache.value else _SOURCES


def _fastest_measured(ba: BoundArguments) -> Any:
    """The fastest of `ba.op`'s candidate configs, measured now (and cached)."""
    measured = {config: m for config, m in ba.autotune().items() if m.ok}
    if not measured:
        raise NotImplementedError(f"{type(ba.op).__name__}: no candidate config ran here")
    return min(measured, key=lambda config: min(measured[config].evaluation_times_ms))


def _ranked(
    candidates: list[BoundArguments], target: Target, explicit: bool,
    evidence_only: Sequence[BoundArguments] = (),
) -> tuple[list[BoundArguments], str]:
    """`(candidates, ranking)`: those `implementation=None` may use, best first (see
    the module docstring), and what ordered them (`Choice.ranking`).

    With no measurement and no prediction to go on, only the plain-JAX paths
    (`Op.runs_without_evidence`) remain. `evidence_only`: implementations the target runs
    but this machine cannot lower; they are never returned, but their measurements and
    predictions on the target count (cuDNN's attention time stands as a bound on XLA's
    when a CPU machine exports for cuda).
    """
    if explicit:
        return candidates, ""
    everything = [*candidates, *evidence_only]
    usable = [i < len(candidates) for i in range(len(everything))]
    for source in _consulted_sources():
        order = source.rank(everything, target.device_kind, usable)
        if order is not None:
            return [everything[i] for i in order if usable[i]], MEASURED
    plain = [ba for ba in candidates if ba.op.runs_without_evidence]
    # Stable: the family's order, less the plain paths that lose unmeasured at this call.
    plain.sort(key=lambda ba: ba.op.unmeasured_plain_path_loses(ba))
    predicted = _by_prediction(everything, usable, plain, target)
    if predicted is None:
        return plain or candidates, ""
    ranked, text = predicted
    return ranked or candidates, text


def _by_prediction(everything: list[BoundArguments], usable: list[bool],
                   plain: list[BoundArguments],
                   target: Target) -> tuple[list[BoundArguments], str] | None:
    """`(order, text)`: the usable kernels predicted faster than the fastest plain-JAX
    path by more than their margin, fastest first, then the `plain` paths (fastest first
    where each has a prediction, else in their order), and the predictions as text.
    `None` where no plain path has a prediction (no calibration for the target, or none
    for these ops). A plain gradient that reruns its forward counts at
    `RERUN_SHARE` of its time, as measured ones do."""
    times = prediction.predict_all(everything, target.device_kind)
    if times is None:
        return None
    plain_times = {
        id(ba): t.seconds * (RERUN_SHARE if ba.op.reruns_forward(ba) else 1.0)
        for ba, t in zip(everything, times, strict=True)
        if ba.op.runs_without_evidence and t is not None}
    if not plain_times:
        return None
    best_plain = min(plain_times.values())
    seconds = {i: t.seconds for i, t in enumerate(times) if t is not None}
    winners = sorted(
        (i for i, ba in enumerate(everything)
         if usable[i] and not ba.op.runs_without_evidence and i in seconds
         and seconds[i] < best_plain * (1 - ba.op.kernel_margin_for(ba))),
        key=seconds.__getitem__)
    if all(id(ba) in plain_times for ba in plain):
        plain = sorted(plain, key=lambda ba: plain_times[id(ba)])
    shown = sorted((t.seconds, prediction.op_name(ba.op)) for ba, t in
                   zip(everything, times, strict=True) if t is not None)
    text = "predicted: " + ", ".join(f"{name} {seconds * 1e3:.3g} ms"
                                     for seconds, name in shown)
    return [*(everything[i] for i in winners), *plain], text


def rank_on_target(candidates: Sequence[BoundArguments], target: Target) -> list[BoundArguments]:
    """The candidates `implementation=None` tries on `target`, best first, by the sources,
    measured neighbours and predictions `choose` weighs (configs not yet resolved): the
    rule as it decides on the target itself, every candidate taken to run there."""
    return _ranked(list(candidates), target, explicit=False)[0]


def _target_runs_unlowerable(on_target: list[BoundArguments],
                             evidence_only: Sequence[BoundArguments],
                             target: Target) -> str | None:
    """The implementation `None` would run on the target itself, when it is one this
    machine cannot lower: the program made here then differs from the target's own.

    `on_target`: the candidates the target runs, in the family's order (with no
    measurement or prediction, the order decides: cuDNN's attention before XLA's)."""
    if not evidence_only:
        return None
    order = rank_on_target(on_target, target)
    first = order[0] if order else None
    if first is None or not any(first is other for other in evidence_only):
        return None
    return first.op.implementation


def _fallback_order(supported: list[BoundArguments], target: Target) -> list[BoundArguments]:
    """What runs in place of a fused implementation the target would run but this machine
    cannot lower (cuDNN attention, exported from a CPU machine): the fused kernels first,
    best measured first, then the rest of the family's order. The plain-JAX paths
    (`Op.runs_without_evidence`: the `xla` attention materializes the logits) come last,
    for a fused kernel stands closer to what the target would run."""
    measured, _ = _ranked(supported, target, explicit=False)
    kernels = [ba for ba in measured if not ba.op.runs_without_evidence]
    kernels += [ba for ba in supported
                if not ba.op.runs_without_evidence and not any(ba is k for k in kernels)]
    return [*kernels, *(ba for ba in supported if ba.op.runs_without_evidence)]


SYMBOLIC_SOURCE = "symbolic shapes: the XLA reference"


def choose_for_symbolic_shapes(candidates: Sequence[BoundArguments], target: Target) -> Choice:
    """The first candidate that is an `xla` implementation without a config, for a call
    whose shapes hold symbolic dimensions (`jax.export` with `jax.export.symbolic_shape`).

    Only those compute in shape-polymorphic `jax.numpy`: a kernel's grid and tiles, and a
    config's chunk sizes, need every dimension known, and no cache or measurement is keyed
    by a symbol. Raises `NotImplementedError` naming each candidate left out when none fits.
    """
    failures: list[tuple[str, Exception]] = []
    for ba in candidates:
        name = prediction.op_name(ba.op)
        if not _computes_with_symbolic_shapes(ba.op):
            failures.append((name, NotImplementedError(
                "needs every dimension known (symbolic shapes run the XLA reference, "
                "implementation='xla')")))
            continue
        try:
            ba.op.check_supported(ba, target)
        except NotImplementedError as e:
            failures.append((name, e))
            continue
        config = ba.op.config if ba.op.config is not None else NullConfig()
        return Choice(ba.replace(op=ba.op.replace(config=config)), SYMBOLIC_SOURCE)
    raise errors.all_failed("no implementation takes symbolic shapes:", failures)


def _computes_with_symbolic_shapes(op: Op) -> bool:
    """Whether `op` is an `xla` implementation without a config, as is every op it wraps
    (a ragged dot's VJP op runs its gradients with the kernel it holds)."""
    if op.implementation != "xla" or op.config_cls is not NullConfig:
        return False
    wrapped = [getattr(op, f.name) for f in dataclasses.fields(op)
               if f.name not in ("config", "vjp") and isinstance(getattr(op, f.name), Op)]
    return all(_computes_with_symbolic_shapes(inner) for inner in wrapped)


def choose(candidates: Sequence[BoundArguments], target: Target, *, explicit: bool) -> Choice:
    """The first candidate that supports `target`, with its config resolved.

    Raises `NotImplementedError` listing every candidate's reason when none can run.
    """
    supported: list[BoundArguments] = []
    evidence_only: list[BoundArguments] = []
    on_target: list[BoundArguments] = []  # both, in the family's order
    failures: list[tuple[str, Exception]] = []
    for ba in candidates:
        try:
            ba.op.check_supported(ba, target)
        except NotImplementedError as e:
            failures.append((type(ba.op).__name__, e))
            if isinstance(e, CannotLowerHere):
                evidence_only.append(ba)
                on_target.append(ba)
            continue
        supported.append(ba)
        on_target.append(ba)
    unlowerable = None if explicit else _target_runs_unlowerable(on_target, evidence_only,
                                                                  target)
    if unlowerable is None:
        order, ranking = _ranked(supported, target, explicit, evidence_only)
    else:
        order, ranking = _fallback_order(supported, target), ""
    for ba in order:
        try:
            config, source = resolve_config(ba.op, ba, target)
        except NotImplementedError as e:
            failures.append((type(ba.op).__name__, e))
            continue
        note = "" if unlowerable is None else f"{unlowerable} on the target: {UNLOWERABLE_NOTE}"
        return Choice(ba.replace(op=ba.op.replace(config=config)), source, note,
                      fallback_from=unlowerable, ranking=ranking)
    raise errors.all_failed(
        f"no implementation can run on {target.platform} ({target.device_kind}):", failures)


def rank_measured(candidates: Sequence[BoundArguments],
                  exact_times: Callable[[Sequence[BoundArguments]], list[float | None]],
                  neighbour_times: Callable[[Sequence[BoundArguments]], list[float | None]],
                  usable: Sequence[bool] | None = None) -> list[int] | None:
    """`rank_with_evidence` over a source's measurements: at the call's own shape first,
    else at the nearest measured neighbour, whose order keeps the kernels re-ranked by
    their own times where the call's shape has them; `None` where neither settles it.

    `exact_times`/`neighbour_times` give each candidate's time at the shape / at the
    nearest neighbour (`None`: not measured). Where unusable candidates (`usable`) left
    it unsettled, the usable ones are ranked on their own measurements.
    """
    exact = exact_times(candidates)
    order = rank_with_evidence(candidates, exact, usable)
    if order is not None:
        return order
    order = rank_with_evidence(candidates, neighbour_times(candidates), usable)
    if order is not None:
        return _kernels_by_own_times(order, candidates, exact)
    if usable is None or all(usable):
        return None
    kept = [i for i, ok in enumerate(usable) if ok]
    return _ranked_subset(kept, rank_measured([candidates[i] for i in kept], exact_times,
                                              neighbour_times))


def rank_with_evidence(candidates: Sequence[BoundArguments],
                       times: Sequence[float | None],
                       usable: Sequence[bool] | None = None) -> list[int] | None:
    """Indices of the usable candidates `implementation=None` may use, best first, or
    `None` when the measurements cannot compare them with the plain-JAX paths.

    A kernel (an implementation that does not run without evidence) is listed only when
    it was measured faster than every usable plain-JAX candidate by more than its
    `kernel_margin_for` the call, a plain gradient that reruns its forward counting at
    `RERUN_SHARE` of its time; the plain-JAX candidates follow (measured ones fastest
    first), so the call never runs a kernel that was measured slower, or not measured, on
    this shape. A plain candidate not measured counts only where it yields to a measured
    one (`Op.yields_unmeasured_to`: XLA's attention to cuDNN's, by a device sweep); it
    then comes last, and the time it yields to stands as a bound on its own.

    `usable` (default: all): a candidate that is not usable cannot run on this machine
    (`CannotLowerHere`) and is never listed, but its time still bounds those that yield
    to it: with cuDNN's attention measured and XLA's not, a kernel measured faster than
    cuDNN beats XLA too, on a CPU machine exporting for cuda as on the GPU.
    """
    usable = [True] * len(candidates) if usable is None else list(usable)
    known = {i: t for i, t in enumerate(times) if t is not None}
    plain = [i for i, ba in enumerate(candidates) if ba.op.runs_without_evidence]
    if not plain:
        measured = [i for i in known if usable[i]]
        return (_rank_by_time(measured, known)
                if all(t is not None for t in times) and measured else None)
    measured_plain = [i for i in plain if times[i] is not None]
    unmeasured = [i for i in plain if times[i] is None]
    if not measured_plain or not all(yields(candidates, i, measured_plain)
                                     for i in unmeasured):
        return None
    usable_plain = [i for i in measured_plain if usable[i]]
    bounds = [known[j] for i in unmeasured if usable[i] for j in measured_plain
              if candidates[i].op.yields_unmeasured_to(candidates[i], candidates[j])]
    if not usable_plain and not bounds:
        return None
    best_plain = min([known[i] * (RERUN_SHARE if candidates[i].op.reruns_forward(candidates[i])
                                  else 1.0) for i in usable_plain] + bounds)
    winners = [i for i, ba in enumerate(candidates) if not ba.op.runs_without_evidence
               and usable[i] and i in known
               and known[i] < best_plain * (1 - max(ba.op.kernel_margin_for(ba), TIE_MARGIN))]
    if not usable_plain and not winners:
        return None  # no kernel beat the bound: the bound alone cannot rank them
    return (_rank_by_time(winners, known) + _rank_by_time(usable_plain, known)
            + [i for i in unmeasured if usable[i]])


def _rank_by_time(indices: Sequence[int], times: Mapping[int, float]) -> list[int]:
    """`indices`: those within `TIE_MARGIN` of the fastest in their given order, then the
    rest fastest first."""
    if not indices:
        return []
    best = min(times[i] for i in indices)
    ties = [i for i in indices if times[i] <= best * (1 + TIE_MARGIN)]
    rest = sorted((i for i in indices if times[i] > best * (1 + TIE_MARGIN)),
                  key=lambda i: times[i])
    return ties + rest


def yields(candidates: Sequence[BoundArguments], i: int, others: Sequence[int]) -> bool:
    """Whether plain candidate `i` is known slower than one of `others` at its call
    (`Op.yields_unmeasured_to`), so it need not be measured where they are."""
    ba = candidates[i]
    return any(j != i and ba.op.yields_unmeasured_to(ba, candidates[j]) for j in others)


def _kernels_by_own_times(order: list[int], candidates: Sequence[BoundArguments],
                          exact: Sequence[float | None]) -> list[int]:
    """`order` (ranked at a neighbour) with its kernels re-ranked by their times at the
    call's own shape where every one of them was measured there: the neighbour says
    which kernels beat the plain-JAX paths, the call's own times which kernel is
    fastest (an `autotune` result times the kernels, not the plain paths its evidence
    showed hopeless: `staging.hopeless`)."""
    kernels = [i for i in order if not candidates[i].op.runs_without_evidence]
    known = {i: t for i, t in enumerate(exact) if t is not None}
    if len(kernels) < 2 or any(i not in known for i in kernels):
        return order
    return _rank_by_time(kernels, known) + [i for i in order if i not in kernels]


def _ranked_subset(kept: Sequence[int], order: list[int] | None) -> list[int] | None:
    """`order`, ranked over `kept`'s candidates, as indices of the full candidate list."""
    return None if order is None else [kept[i] for i in order]
