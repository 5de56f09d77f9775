"""What the device probes share: each phase in a subprocess with a timeout (a deadlocked
kernel costs its phase, not the run, nor the machine), and one timing per variant."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any


def run_phases(argv: list[str], script: str, phases: Mapping[str, tuple[Callable[[], None], int]],
               log: Callable[[dict], None]) -> int:
    """`script --phase NAME` runs phase NAME here; otherwise each phase named in `argv` (all
    by default) runs as `script --phase NAME` in a subprocess limited to its seconds, and a
    failed or timed-out phase is logged."""
    if argv and argv[0] == "--phase":
        phases[argv[1]][0]()
        return 0
    for phase in argv or list(phases):
        timeout = phases[phase][1]
        try:
            result = subprocess.run([sys.executable, script, "--phase", phase], timeout=timeout)
            if result.returncode:
                log(dict(phase=phase, exit=result.returncode))
        except subprocess.TimeoutExpired:
            log(dict(phase=phase, timeout=timeout))
    return 0


def timed(record: dict, fn: Callable, args: tuple, flops: float) -> Any:
    """`fn(*args)` once (its result is returned, for numerics checks), then timed by
    `tokamax_pass.benchmarking` (CUPTI on a GPU, median after warm-up): `ms`, `tflops` and
    `timer` go into `record`. An exception goes into `record["error"]` (returns None)."""
    from tokamax_pass.benchmarking import compile_benchmark, standardize_function

    try:
        result = fn(*args)
        f_std, std_args = standardize_function(fn, *args)
        data = compile_benchmark(f_std, std_args)(std_args)
    except Exception as e:  # noqa: BLE001
        record.update(error=f"{type(e).__name__}: {str(e)[:800]}")
        return None
    ms = data.median_evaluation_time_ms
    record.update(ms=ms, tflops=flops / ms / 1e9, timer=data.method)
    return result
