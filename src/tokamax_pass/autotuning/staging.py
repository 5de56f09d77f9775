"""Tuning every implementation in two stages, so a model's tuning compiles the configs
that can matter and not the losers' search spaces.

With `autotune(..., all_implementations=True)` each op call is timed once per
implementation of its family. Stage one times every implementation at its first
candidate (the config `None` runs today where one is measured, else the heuristics
config). Stage two searches the rest of an implementation's
configs only where `implementation=None` could then choose it: its first time, improved
by `TUNING_GAIN`, ranks it first among the family's measurements
(`selection.rank_with_evidence`, with the family's kernel margins and rerun shares), or its
first config failed (another may run). A call some of whose implementations a cache
already answers (not re-timed, so not compared) is searched whole in stage one.

Why: autotuning a model is compile-bound, and most candidates are the configs of
implementations that lose to XLA by more than any config changes, while the heuristics
config is close to the best of its search space
(`benchmarks/probes/model_autotune_timeline_probe.py`).

Before stage one, an implementation the evidence `None` ranks by (the caches of this
device kind, at the call's shape or its nearest measured neighbour) shows
`HOPELESS_RATIO` times slower than the fastest of its family is not timed at all: no
config makes up such a gap, and these losers' compiles are the critical path of a
model's tuning (compiled one after another, as XLA's GEMM autotuning runs them;
`benchmarks/probes/model_candidate_compile_probe.py`). Where every implementation that
made one hopeless fails in stage one, the hopeless one is timed in stage two after all.

Nor is a config timed again that the caches measured at the call's own shape, in the
entry whose fastest is the config `None` runs today: that search was done, and its
losers lost in the same run as the winner (`without_known_losers`; failures are timed
again, as they may not recur). At shapes no cache holds nothing changes. Stage two's
candidates are not compiled while stage one times: compile threads would starve the
timing thread of the interpreter lock and skew its timings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from tokamax_pass.autotuning import cache
from tokamax_pass.autotuning.autotuner import Autotuner
from tokamax_pass.autotuning.entry import Entry
from tokamax_pass.core import selection
from tokamax_pass.core.bound_arguments import BoundArguments

# The most a search space is taken to improve on its heuristics config (time ratio).
# Over the 70 H200 library-cache entries with two or more configs measured, the best
# config's time over the heuristics config's: 10th percentile 0.89, worst 0.78 (a Triton
# layer norm with an offset, which loses to XLA by more than that anyway).
TUNING_GAIN = 0.8
# An implementation this much slower than its family's fastest, in the evidence, is not
# timed: more than any config gains (`TUNING_GAIN`), and a win of this size does not
# vanish a few sizes away (`neighbours.DOMINANT_WIN`).
HOPELESS_RATIO = 2.0

Plan = tuple[BoundArguments, list[Any]]


def without_known_losers(ba: BoundArguments, configs: Sequence[Any],
                         device_kind: str | None) -> list[Any]:
    """`configs` (the first the config `None` runs today) less the configs the caches of
    `device_kind` measured at `ba`'s own shape, in the entry that made the first one
    `None`'s choice: that entry timed them against it and they lost, so timing them again
    would repeat a search already done (`cache.measured_losers`)."""
    if not configs:
        return list(configs)
    losers = cache.measured_losers(ba, configs[0], device_kind)
    return [configs[0], *(c for c in configs[1:] if c not in losers)]


def worth_searching(candidates: Sequence[BoundArguments],
                    first_times: Sequence[float]) -> list[bool]:
    """For each of one call's implementations (timed at their first config, `inf` when
    it failed), whether its other configs could make `implementation=None` choose it."""
    worth = []
    for i, first_time in enumerate(first_times):
        if not math.isfinite(first_time):
            worth.append(True)
            continue
        hoped = [t * TUNING_GAIN if j == i else t for j, t in enumerate(first_times)]
        order = selection.rank_with_evidence(candidates, hoped)
        worth.append(order is None or _chosen(i, order, candidates, hoped))
    return worth


def _chosen(i: int, order: list[int], candidates: Sequence[BoundArguments],
            times: Sequence[float]) -> bool:
    """Whether `i` leads `order`: first, or a plain-JAX path tied with the first one."""
    first = order[0]
    if i == first:
        return True
    plain = candidates[i].op.runs_without_evidence and candidates[first].op.runs_without_evidence
    return plain and times[i] <= times[first] * (1 + selection.TIE_MARGIN)


def hopeless(candidates: Sequence[BoundArguments], device_kind: str | None
             ) -> list[tuple[int, ...] | None]:
    """For each of one call's implementations, `None` where it is to be timed, else the
    implementations measured `HOPELESS_RATIO` times faster than it in the caches of
    `device_kind` (`cache.evidence_times`; a plain gradient that reruns its forward
    counted at `selection.RERUN_SHARE` of its time, as `None` counts it)."""
    times = cache.evidence_times(candidates, device_kind)
    share = [selection.RERUN_SHARE if ba.op.runs_without_evidence and ba.op.reruns_forward(ba)
             else 1.0 for ba in candidates]
    cost = [None if t is None else t * f for t, f in zip(times, share, strict=True)]
    verdicts: list[tuple[int, ...] | None] = []
    for mine in cost:
        faster = () if mine is None else tuple(
            j for j, t in enumerate(cost) if t is not None and t * HOPELESS_RATIO <= mine)
        verdicts.append(faster or None)
    return verdicts


def tune_in_stages(tuner: Autotuner, groups: Sequence[Sequence[Plan]],
                   on_stage_two: Callable[[int], None] | None = None,
                   search_all: Sequence[bool] | None = None,
                   beaten: Sequence[Sequence[tuple[int, ...] | None]] | None = None
                   ) -> list[Entry]:
    """Entries of every timed plan of `groups` (each group: one call's implementations,
    with their candidate configs, the one `None` runs today first), tuned in the two
    stages. `on_stage_two(n)` is told how many configs stage two times. A group flagged in
    `search_all` (some of its implementations were answered by a cache, so stage one
    could not compare them all) has every config timed in stage one. `beaten` (by
    default none): per plan, `hopeless`'s verdict; a hopeless plan is timed (at its first
    config, in stage two) only where every implementation that beat it failed."""
    search_all = search_all or [False] * len(groups)
    beaten = beaten or [[None] * len(group) for group in groups]
    timed = [[p for p, by in enumerate(verdicts) if by is None] for verdicts in beaten]
    firsts = tuner.tune_many([(ba, configs if whole else configs[:1])
                              for group, whole, kept in zip(groups, search_all, timed,
                                                            strict=True)
                              for ba, configs in (group[p] for p in kept)])
    entries = iter(firsts)
    by_group: list[dict[int, Entry]] = [{p: next(entries) for p in kept} for kept in timed]
    searched: list[tuple[int, int]] = []
    rest: list[Plan] = []
    for g, group in enumerate(groups):
        found = by_group[g]
        for p, by in enumerate(beaten[g]):
            if by is not None and not any(
                    j in found and math.isfinite(found[j].best_time_ms) for j in by):
                searched.append((g, p))
                rest.append((group[p][0], group[p][1][:1]))
        if search_all[g]:
            continue
        kept = timed[g]
        worth = worth_searching([found[p].bound for p in kept],
                                [found[p].best_time_ms for p in kept])
        for p, keep in zip(kept, worth, strict=True):
            ba, configs = group[p]
            if keep and len(configs) > 1:
                searched.append((g, p))
                rest.append((ba, configs[1:]))
    if on_stage_two is not None:
        on_stage_two(sum(len(configs) for _, configs in rest))
    for (g, p), entry in zip(searched, tuner.tune_many(rest), strict=True):
        found = by_group[g]
        found[p] = found[p].merged(entry) if p in found else entry
    return [found[p] for found in by_group for p in sorted(found)]
