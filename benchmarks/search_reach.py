"""How close the first k candidate configs come to the best config measured, over a
library cache: the evidence behind `autotune`'s default `max_configs`.

    python -m benchmarks.search_reach [--device-kind "NVIDIA H200"] [--min-configs 5]

For every shipped entry with at least `--min-configs` configs measured (the library
tuner searches up to 16), `candidate_configs(bound, k)` (the heuristics config and the
k - 1 nearest it) is intersected with the measured configs, and the best time among
them is compared with the best of all: a reach of 1.0 means the k configs hold the
best measured config, 0.9 that the best of them is 10% slower.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from tokamax_pass import core
from tokamax_pass.autotuning import cache
from tokamax_pass.autotuning.autotuner import candidate_configs
from tokamax_pass.autotuning.entry import Entry
from tokamax_pass.tables import render_table


@dataclasses.dataclass(frozen=True)
class Reach:
    """One entry's best time over the best time among its first k candidates."""

    op: str
    measured: int
    reach: float


# Config fields that change only the order in which the same blocks launch, set by a
# measured rule and timed on their own (`longest_first`:
# `benchmarks/probes/longest_first_probe.py`): a candidate matches a measured config whatever these
# say.
ORDER_FIELDS = ("longest_first",)


def _tiles(config: object) -> object:
    """`config` with its `ORDER_FIELDS` at their defaults (unchanged if it has none)."""
    fields = {f.name: f.default for f in dataclasses.fields(config)
              if f.name in ORDER_FIELDS} if dataclasses.is_dataclass(config) else {}
    return dataclasses.replace(config, **fields) if fields else config


def reach(entry: Entry, k: int) -> float:
    """Best measured time over the best among `candidate_configs(entry.bound, k)` (0 when
    none of those was measured)."""
    times = {_tiles(c): m.median_ms for c, m in entry.data.items() if m.ok}
    kept = [times[_tiles(c)] for c in candidate_configs(entry.bound, k)
            if _tiles(c) in times]
    return min(times.values()) / min(kept) if kept else 0.0


def reaches(device_kind: str, k: int, min_configs: int = 5) -> list[Reach]:
    """`Reach` of every library entry of `device_kind` with `min_configs` configs measured."""
    result = cache.library_result(device_kind)
    rows = []
    with core.targeting(device_kind):
        for entry in result.entries if result is not None else ():
            measured = sum(m.ok for m in entry.data.values())
            if measured >= min_configs:
                rows.append(Reach(type(entry.bound.op).__name__, measured, reach(entry, k)))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.search_reach", description=__doc__)
    parser.add_argument("--device-kind", default="NVIDIA H200")
    parser.add_argument("--min-configs", type=int, default=5)
    args = parser.parse_args(argv)
    columns = ("k", "entries", "worst", "10th pct", "median", "below 0.97")
    rows = []
    for k in (1, 2, 4, 5, 6, 8):
        values = sorted(r.reach for r in reaches(args.device_kind, k, args.min_configs))
        if not values:
            print("no entry has enough configs measured")
            return 1
        n = len(values)
        rows.append((k, n, f"{values[0]:.3f}", f"{values[n // 10]:.3f}",
                     f"{values[n // 2]:.3f}", sum(v < 0.97 for v in values)))
    print(render_table(columns, rows, right_aligned=columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
