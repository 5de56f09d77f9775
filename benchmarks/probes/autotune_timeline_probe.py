"""Device probe: when each phase of autotuning the seed-usage `f_grad` runs.

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/autotune_timeline_probe.py
It autotunes the seed-usage `f_grad` (`_probe.seed_f_grad_loss`) from nothing with the
autotuner's candidate compiles, input preparation and reference outputs wrapped to
record when each started and ended (seconds from the probe's start), then times the
tuned program. The first line of `$OUT/autotune_timeline.jsonl` is the summary (total
seconds, tuned ms, best config per op); the rest are the events in start order.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from benchmarks.probes._probe import device_time_ms as _device_time_ms
from benchmarks.probes._probe import seed_f_grad_loss as _loss
from benchmarks.probes._timeline import Timeline

TIMELINE = Timeline()


def main() -> None:
    TIMELINE.record_autotuner()
    x = jax.random.normal(jax.random.key(1), (32, 2048, 16, 64), dtype=jnp.bfloat16)
    scale = jax.random.normal(jax.random.key(0), (64,), dtype=jnp.float32)
    f_grad = jax.jit(jax.grad(_loss))
    begin = time.perf_counter()
    result = tokamax.autotune(f_grad, x, scale, ignore_cache=True, progress=False)
    seconds = time.perf_counter() - begin
    with result:
        tuned = _device_time_ms(f_grad, x, scale)
    best = {type(ba.op).__name__: str(min((m.median_ms, str(c)) for c, m in data.items() if m.ok))
            for ba, data in result}
    summary = dict(seconds=round(seconds, 1), autotune_started=round(begin - TIMELINE.start, 3),
                   tuned_ms=tuned, best=best)
    print(json.dumps(summary), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "autotune_timeline.jsonl"), "w") as f:
        for row in [summary, *TIMELINE.sorted_events()]:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
