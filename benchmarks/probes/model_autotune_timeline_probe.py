"""Device probe: where a model's `autotune(..., all_implementations=True)` time goes.

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/model_autotune_timeline_probe.py llama
It tunes one model of `benchmarks/models` from an empty user cache with the autotuner's
candidate compiles, input preparation, reference outputs and timings wrapped to record
when each started and ended (seconds from the probe's start). The first line of
`$OUT/timeline_<model>.jsonl` is the summary (total seconds, candidates, busy seconds
per kind, per-op sums); the rest are the events in start order.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import tempfile
import time
from typing import Any

import jax

import tokamax_pass as tokamax
from benchmarks.models import MODELS, ops, run
from benchmarks.probes._timeline import Timeline
from tokamax_pass.autotuning import cache

TIMELINE = Timeline()


def _summary(name: str, seconds: float, calls: int) -> dict[str, Any]:
    busy: dict[str, float] = collections.defaultdict(float)
    per_op: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float))
    for e in TIMELINE.events:
        busy[e["kind"]] += e["end"] - e["start"]
        per_op[e["op"]][e["kind"]] += e["end"] - e["start"]
    return dict(model=name, seconds=round(seconds, 1), calls=calls,
                candidates=sum(e["kind"] == "candidate" for e in TIMELINE.events),
                busy_s={k: round(v, 1) for k, v in busy.items()},
                per_op={o: {k: round(v, 2) for k, v in d.items()} for o, d in per_op.items()})


def main(name: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("tokamax_pass.autotuning").setLevel(logging.INFO)  # what is not timed
    TIMELINE.record_autotuner(timings=True)
    model = MODELS[name]
    params, batch = run._inputs(model, smoke=False)
    step = jax.grad(model.loss_fn(ops.variants()["ours"], smoke=False))
    with tempfile.TemporaryDirectory() as empty:
        os.environ[cache.ENV_CACHE_DIR] = empty
        begin = time.perf_counter()
        result = tokamax.autotune(step, params, batch, all_implementations=True,
                                  ignore_cache=True, progress=False)
        seconds = time.perf_counter() - begin
    summary = _summary(name, seconds, len(result))
    print(json.dumps(summary, indent=1), flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, f"timeline_{name}.jsonl"), "w") as f:
        for row in [summary, *TIMELINE.sorted_events()]:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llama")
