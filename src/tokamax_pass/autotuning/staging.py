"""Tuning every implementation in two stages, so a model's tuning compiles the configs
that can matter and not the losers' search spaces.

With `autotune(..., all_implementations=True)` each op call is timed once per
implementation of its family. Stage one times every implementation at its first
candidate (the config `None` runs today where one is measured, else the heuristics
config). Stage two searches the rest of an implementation's
configs only where `implementation=None` could then choose it: its first time, improved
by `TUNING_GAIN`, ranks it first among the family's measurements
(`cache.rank_with_evidence`, with the family's kernel margins and rerun shares), or its
first config failed (another may run). A call some of whose implementations a cache
already answers (not re-timed, so not compared) is searched whole in stage one.

Why (H200, the Llama step of `benchmarks/models`): autotuning was compile-bound, 58.8 s
of which 44 s compiled 115 candidates, most of them the configs of implementations that
lose to XLA by more than any config changes (the Mosaic and chunked LM-head kernels alone
took 274 s of compile threads); across its 15 tuned calls the heuristics config was
within 9% of the best config of its search space (`autotune_timeline_llama.jsonl`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from tokamax_pass.autotuning import cache
from tokamax_pass.autotuning.autotuner import Autotuner
from tokamax_pass.autotuning.result import Entry
from tokamax_pass.core.op import BoundArguments

# The most a search space is taken to improve on its heuristics config (time ratio).
# Over the 70 H200 library-cache entries with two or more configs measured, the best
# config's time over the heuristics config's: 10th percentile 0.89, worst 0.78 (a Triton
# layer norm with an offset, which loses to XLA by more than that anyway).
TUNING_GAIN = 0.8

Plan = tuple[BoundArguments, list[Any]]


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
        order = cache.rank_with_evidence(candidates, hoped)
        worth.append(order is None or _chosen(i, order, candidates, hoped))
    return worth


def _chosen(i: int, order: list[int], candidates: Sequence[BoundArguments],
            times: Sequence[float]) -> bool:
    """Whether `i` leads `order`: first, or a plain-JAX path tied with the first one."""
    first = order[0]
    if i == first:
        return True
    plain = candidates[i].op.runs_without_evidence and candidates[first].op.runs_without_evidence
    return plain and times[i] <= times[first] * (1 + cache.TIE_MARGIN)


def tune_in_stages(tuner: Autotuner, groups: Sequence[Sequence[Plan]],
                   on_stage_two: Callable[[int], None] | None = None,
                   search_all: Sequence[bool] | None = None) -> list[Entry]:
    """Entries of every plan of `groups` (each group: one call's implementations, with
    their candidate configs, the one `None` runs today first), tuned in the two stages.
    `on_stage_two(n)` is told how many configs stage two times. A group flagged in
    `search_all` (some of its implementations were answered by a cache, so stage one
    could not compare them all) has every config timed in stage one."""
    search_all = search_all or [False] * len(groups)
    firsts = tuner.tune_many([(ba, configs if whole else configs[:1])
                              for group, whole in zip(groups, search_all, strict=True)
                              for ba, configs in group])
    entries = iter(firsts)
    by_group = [[next(entries) for _ in group] for group in groups]
    searched: list[tuple[int, int]] = []
    rest: list[Plan] = []
    for g, (group, group_entries) in enumerate(zip(groups, by_group, strict=True)):
        if search_all[g]:
            continue
        worth = worth_searching([e.bound for e in group_entries],
                                [e.best_time_ms for e in group_entries])
        for p, ((ba, configs), keep) in enumerate(zip(group, worth, strict=True)):
            if keep and len(configs) > 1:
                searched.append((g, p))
                rest.append((ba, configs[1:]))
    if on_stage_two is not None:
        on_stage_two(sum(len(configs) for _, configs in rest))
    for (g, p), entry in zip(searched, tuner.tune_many(rest), strict=True):
        by_group[g][p] = by_group[g][p].merged(entry)
    return [entry for group_entries in by_group for entry in group_entries]
