"""Measurements at neighbouring shapes: what `implementation=None` knows off the exact shape.

A cache holds timings at the shapes someone measured. A call at another shape of the
same kind (`keys.similarity`: the same op, static arguments, dtypes and ranks) borrows
the timings of the nearest measured shape whose every size is within `MAX_RATIO` of its
own, provided that shape timed all the call's plain-JAX candidates (so a kernel is only
ever compared with what it would displace). With no such shape, a shape within
`FAR_RATIO` lends its timings only where a kernel beat every plain-JAX candidate there
by `DOMINANT_WIN` or more (a win of that size does not vanish a few sizes away: the
Mosaic ragged dot ran 7x XLA's at the Mixtral shape, and a Mixtral-8x7B layer's sizes
are up to 4x from it). Farther away, nothing is borrowed and the plain-JAX paths run.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tokamax_pass.autotuning import keys
from tokamax_pass.core import selection
from tokamax_pass.core.bound_arguments import BoundArguments

# A neighbour's sizes may differ from the call's by at most this factor, each size alone.
MAX_RATIO = 2.0
# Farther neighbours, and how much faster than the plain-JAX paths a kernel must have run
# there for them to count.
FAR_RATIO = 4.0
DOMINANT_WIN = 2.0

Sizes = tuple[int, ...]
# category -> {sizes: best time (ms)}, for one result.
_Index = dict[str, dict[Sizes, float]]
_INDEXES: OrderedDict[int, _Index] = OrderedDict()
_MAX_INDEXES = 64


def _index(layer: Any) -> _Index:
    """The fresh entries of a layer's result by similarity category (built once per result)."""
    serial = layer.result._serial
    if serial in _INDEXES:
        _INDEXES.move_to_end(serial)
        return _INDEXES[serial]
    index: _Index = {}
    for entry in layer.result.entries:
        if keys.stale_reason(entry.bound.op, entry.provenance) is not None and (
                layer.label != "autotuning result"):
            continue
        try:
            category, sizes = keys.similarity(entry.bound)
        except Exception:  # noqa: BLE001 - an entry of an op that cannot say is never a neighbour
            continue
        index.setdefault(category, {})[sizes] = entry.best_time_ms
    _INDEXES[serial] = index
    if len(_INDEXES) > _MAX_INDEXES:
        _INDEXES.popitem(last=False)
    return index


def distance(a: Sizes, b: Sizes, max_ratio: float = MAX_RATIO) -> float:
    """Sum of |log2| size ratios; `inf` when ranks differ or a size is beyond `max_ratio`."""
    if len(a) != len(b):
        return math.inf
    total = 0.0
    for x, y in zip(a, b, strict=True):
        if x == y:
            continue
        if min(x, y) <= 0:
            return math.inf
        step = abs(math.log2(x / y))
        if step > math.log2(max_ratio):
            return math.inf
        total += step
    return total


def nearest_times(candidates: Sequence[BoundArguments],
                  stack: Sequence[Any]) -> list[float | None]:
    """Each candidate's best time at the nearest neighbouring shape where every plain-JAX
    candidate was measured (`None` for a candidate not measured there; all `None` when
    no such shape is near)."""
    keyed = [keys.similarity(ba) for ba in candidates]
    measured: list[dict[Sizes, float]] = [{} for _ in candidates]
    for layer in stack:
        index = _index(layer)
        for found, (category, _) in zip(measured, keyed, strict=True):
            for sizes, time in index.get(category, {}).items():
                found.setdefault(sizes, time)  # an earlier layer wins
    plain = [i for i, ba in enumerate(candidates) if ba.op.runs_without_evidence]
    # A plain path known slower than another (`Op.yields_unmeasured_to`) need not be
    # measured at the site: the other stands for it.
    required = [i for i in plain if not selection.yields(candidates, i, plain)] or range(
        len(candidates))
    sites = set.intersection(*(set(measured[i]) for i in required)) if required else set()

    def dominated(sizes: Sizes) -> bool:
        kernels = [found[sizes] for i, found in enumerate(measured)
                   if i not in plain and sizes in found]
        return bool(plain and kernels) and (
            min(kernels) * DOMINANT_WIN <= min(measured[i][sizes] for i in required))

    best = _nearest(sorted(sites), keyed, required, MAX_RATIO)
    if best is None:
        best = _nearest([s for s in sorted(sites) if dominated(s)], keyed, required, FAR_RATIO)
    if best is None:
        return [None] * len(candidates)
    return [found.get(best) for found in measured]


def _nearest(sites: Sequence[Sizes], keyed: Sequence[tuple[str, Sizes]],
             required: Sequence[int], max_ratio: float) -> Sizes | None:
    """The site nearest every required candidate's sizes, each size within `max_ratio`."""
    best, best_distance = None, math.inf
    for sizes in sites:
        d = max(distance(keyed[i][1], sizes, max_ratio) for i in required)
        if d < best_distance:
            best, best_distance = sizes, d
    return best
