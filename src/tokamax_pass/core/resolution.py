"""Which implementation and config an op call gets, and where the choice came from.

Config order, first hit wins: a pinned config -> the registered config sources
(active `AutotuningResult`s, the user cache, the library cache; registered by
`tokamax_pass.autotuning`) -> the implementation's heuristics.

For `implementation=None` the promise is never to be slower than plain JAX. The order,
first that ranks wins:

1. measurements: a kernel runs where a source measured it faster than the plain-JAX
   paths (the XLA reference, `jax.nn`'s cuDNN attention) on this shape, or on a
   measured neighbouring shape (`autotuning.neighbours`);
2. predictions (`core.prediction`), where the target's device kind has a calibration: a
   kernel runs where it is predicted faster than the fastest plain-JAX path by more than
   its `Op.kernel_margin_for` the call, and the plain-JAX paths follow fastest predicted
   first;
3. otherwise the plain-JAX paths run, in the family's order (less those that lose
   unmeasured at the call, `Op.unmeasured_plain_path_loses`: cuDNN attention on tiny
   calls).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from tokamax_pass.core import options, prediction
from tokamax_pass.core.device import Target, current_target, lowering_for
from tokamax_pass.core.op import BoundArguments, CannotLowerHere, NullConfig, Op

# Appended to a choice's source where `None` would run, on the target itself, an
# implementation this machine cannot lower (`CannotLowerHere`: cuDNN, when a CPU machine
# exports for cuda): the program made here differs from the one the target would make.
UNLOWERABLE_NOTE = "cannot be lowered here"


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
    # Set where predictions ordered the candidates: "predicted: " and each candidate's
    # predicted time (`core.prediction`); shown beside the source in plans.
    prediction: str = ""

    @property
    def op(self) -> Op:
        return self.bound.op


def resolve_config(op: Op, ba: BoundArguments, target: Target | None = None) -> tuple[Any, str]:
    """`(config, source)` for `op` on `ba`; `source` names where it came from."""
    if op.config is not None:
        return op.config, "explicit"
    if op.config_cls is NullConfig:
        return NullConfig(), "no config"
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
        return op._get_heuristics_config(ba.replace(op=op)), "heuristics"


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
    """`(candidates, prediction)`: those `implementation=None` may use, best first (see
    the module docstring), and the predicted times where predictions ordered them.

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
            return [everything[i] for i in order if usable[i]], ""
    plain = [ba for ba in candidates if ba.op.runs_without_evidence]
    # Stable: the family's order, less the plain paths that lose unmeasured at this call.
    plain.sort(key=lambda ba: ba.op.unmeasured_plain_path_loses(ba))
    predicted = _by_prediction(everything, usable, plain, target)
    if predicted is None:
        return plain or candidates, ""
    order, text = predicted
    return order or candidates, text


def _by_prediction(everything: list[BoundArguments], usable: list[bool],
                   plain: list[BoundArguments],
                   target: Target) -> tuple[list[BoundArguments], str] | None:
    """`(order, text)`: the usable kernels predicted faster than the fastest plain-JAX
    path by more than their margin, fastest first, then the `plain` paths (fastest first
    where each has a prediction, else in their order), and the predictions as text.
    `None` where no plain path has a prediction (no calibration for the target, or none
    for these ops). A plain gradient that reruns its forward counts at
    `prediction.RERUN_SHARE` of its time, as measured ones do."""
    times = prediction.predict_all(everything, target.device_kind)
    if times is None:
        return None
    plain_times = {
        id(ba): t.seconds * (prediction.RERUN_SHARE if ba.op.reruns_forward(ba) else 1.0)
        for ba, t in zip(everything, times, strict=True)
        if ba.op.runs_without_evidence and t is not None}
    if not plain_times:
        return None
    best_plain = min(plain_times.values())
    winners = sorted(
        (i for i, ba in enumerate(everything)
         if usable[i] and not ba.op.runs_without_evidence and times[i] is not None
         and times[i].seconds < best_plain * (1 - ba.op.kernel_margin_for(ba))),
        key=lambda i: times[i].seconds)
    if all(id(ba) in plain_times for ba in plain):
        plain = sorted(plain, key=lambda ba: plain_times[id(ba)])
    shown = sorted((t.seconds, prediction.op_name(ba.op)) for ba, t in
                   zip(everything, times, strict=True) if t is not None)
    text = "predicted: " + ", ".join(f"{name} {seconds * 1e3:.3g} ms"
                                     for seconds, name in shown)
    return [*(everything[i] for i in winners), *plain], text


def _target_runs_unlowerable(candidates: list[BoundArguments],
                             evidence_only: Sequence[BoundArguments],
                             target: Target) -> str | None:
    """The implementation `None` would run on the target itself, when it is one this
    machine cannot lower: the program made here then differs from the target's own."""
    if not evidence_only:
        return None
    order, _ = _ranked([*candidates, *evidence_only], target, explicit=False)
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
    reasons: list[str] = []
    for ba in candidates:
        name = type(ba.op).__name__
        if ba.op.implementation != "xla" or ba.op.config_cls is not NullConfig:
            reasons.append(f"{name}: needs every dimension known (symbolic shapes run the "
                           "XLA reference, implementation='xla')")
            continue
        try:
            ba.op.check_supported(ba, target)
        except NotImplementedError as e:
            reasons.append(f"{name}: {e}")
            continue
        config = ba.op.config if ba.op.config is not None else NullConfig()
        return Choice(ba.replace(op=ba.op.replace(config=config)), SYMBOLIC_SOURCE)
    raise NotImplementedError("no implementation takes symbolic shapes:\n  "
                              + "\n  ".join(reasons))


def choose(candidates: Sequence[BoundArguments], target: Target, *, explicit: bool) -> Choice:
    """The first candidate that supports `target`, with its config resolved.

    Raises `NotImplementedError` listing every candidate's reason when none can run.
    """
    supported: list[BoundArguments] = []
    evidence_only: list[BoundArguments] = []
    reasons: list[str] = []
    for ba in candidates:
        try:
            ba.op.check_supported(ba, target)
        except NotImplementedError as e:
            reasons.append(f"{type(ba.op).__name__}: {e}")
            if isinstance(e, CannotLowerHere):
                evidence_only.append(ba)
            continue
        supported.append(ba)
    unlowerable = None if explicit else _target_runs_unlowerable(supported, evidence_only,
                                                                  target)
    if unlowerable is None:
        order, predicted = _ranked(supported, target, explicit, evidence_only)
    else:
        order, predicted = _fallback_order(supported, target), ""
    for ba in order:
        try:
            config, source = resolve_config(ba.op, ba, target)
        except NotImplementedError as e:
            reasons.append(f"{type(ba.op).__name__}: {e}")
            continue
        note = "" if unlowerable is None else f"{unlowerable} on the target: {UNLOWERABLE_NOTE}"
        return Choice(ba.replace(op=ba.op.replace(config=config)), source, note,
                      fallback_from=unlowerable, prediction=predicted)
    raise NotImplementedError(
        f"no implementation can run on {target.platform} ({target.device_kind}):\n  "
        + "\n  ".join(reasons)
    )
