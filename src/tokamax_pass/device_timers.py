"""Device timers: how long a compiled program's runs take on the device.

Wall-clock timing of `jax.block_until_ready(f(x))` mostly measures Python and dispatch
overhead, so the default timers read device time: CUPTI on NVIDIA GPUs (kernel time
only), else the `jax.profiler` trace (the union of the intervals of the executable's HLO
ops, per run). `wallclock` is the fallback.
"""

from __future__ import annotations

import glob
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

METHODS = ("cupti", "profiler", "wallclock")
# Runs timed in one CUPTI session: a bound keeps its activity buffers from overflowing
# (which ends the process) on programs that launch many kernels.
CUPTI_RUNS_A_SESSION = 8


def platform_of(args: Sequence[Any]) -> str:
    for a in args:
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            return next(iter(a.devices())).platform
    return jax.default_backend()


def _interval_union_ns(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def traced_hlo_ops(run: Callable[[], Any], iterations: int) -> list[tuple[str, dict, float, float]]:
    """`run()` `iterations` times under `jax.profiler`: `(event name, stats, start ns,
    duration ns)` of every traced event that names an HLO op (`stats["hlo_op"]`, with
    `hlo_module` and `run_id` where the profiler records them)."""
    with tempfile.TemporaryDirectory() as tmp:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        # The events name their HLO ops and modules themselves; the HLO protos of every
        # executable the process holds would be serialized into the trace as well, which
        # makes each timing slower the more programs the process has compiled.
        options.enable_hlo_proto = False
        with jax.profiler.trace(tmp, profiler_options=options):
            for _ in range(iterations):
                jax.block_until_ready(run())
        files = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        profile = jax.profiler.ProfileData.from_file(files[0])
    events = []
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                with warnings.catch_warnings():  # jaxlib's stats type warns on introspection
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stats = dict(event.stats)
                if "hlo_op" in stats:
                    events.append((event.name, stats, event.start_ns, event.duration_ns))
    return events


def profiler_times(compiled: Any, args: list[Any], iterations: int, module: str) -> list[float]:
    jax.block_until_ready(compiled(args))  # Warm-up.
    runs: dict[Any, list[tuple[float, float]]] = {}
    for _, stats, start, duration in traced_hlo_ops(lambda: compiled(args), iterations):
        if stats.get("hlo_module", module) == module:
            runs.setdefault(stats.get("run_id"), []).append((start, start + duration))
    if not runs:
        raise RuntimeError(
            "the profiler recorded no device time for this function; use method='wallclock'")
    if len(runs) == 1 and iterations > 1:
        (intervals,) = runs.values()
        return [_interval_union_ns(intervals) / 1e6 / iterations] * iterations
    return [_interval_union_ns(v) / 1e6 for v in list(runs.values())[-iterations:]]


def cupti_times(compiled: Any, args: list[Any], iterations: int) -> list[float]:
    from jax.experimental.mosaic.gpu import profiler

    times: list[float] = []
    while len(times) < iterations:
        count = min(CUPTI_RUNS_A_SESSION, iterations - len(times))
        _, timings = profiler.Cupti(finalize=False).measure(compiled, iterations=count)(args)
        if timings is None:
            raise RuntimeError("CUPTI recorded no kernel launches for this function")
        times += [float(t) for t in ([timings] if count == 1 else timings)]
    return times


def wallclock_times(compiled: Any, args: list[Any], iterations: int) -> list[float]:
    jax.block_until_ready(compiled(args))  # Warm-up.
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        jax.block_until_ready(compiled(args))
        times.append((time.perf_counter() - start) * 1e3)
    return times


# Upstream Tokamax's name for the profiler timer.
METHOD_ALIASES = {"xprof": "profiler"}


def canonical_method(method: str | None) -> str | None:
    """`method` with upstream Tokamax's names (`"xprof"`) read as ours."""
    return METHOD_ALIASES.get(method, method) if isinstance(method, str) else method


def check_method(method: str | None, platform: str) -> None:
    """A `ValueError` unless `method` is one of `METHODS` (or None, the best available)
    and can time kernels on `platform` (a jax backend name)."""
    if method is not None and method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} or None, got {method!r}")
    if method == "cupti" and platform not in ("gpu", "cuda"):
        raise ValueError(
            f"method='cupti' times NVIDIA GPU kernels, but these inputs are on {platform}; "
            "use method=None (the best available), 'profiler' or 'wallclock'"
        )


def time_runs(compiled: Any, args: list[Any], iterations: int, method: str | None,
              module: str) -> tuple[list[float], str]:
    """`iterations` run times (ms) of `compiled(args)` after a warm-up, and the timer that
    took them: `method`, or with `None` the best that works here (CUPTI on GPUs, else the
    profiler, else wall clock). `module`: the program's HLO module name, which picks its
    events from the profiler's trace."""
    platform = platform_of(args)
    method = canonical_method(method)
    check_method(method, platform)
    if method is None:
        order = ("cupti", "profiler") if platform in ("gpu", "cuda") else ("profiler",)
        for name in order:
            try:
                return _times(name, compiled, args, iterations, module), name
            except (RuntimeError, ImportError):
                continue
        method = "wallclock"
    return _times(method, compiled, args, iterations, module), method


def _times(method: str, compiled: Any, args: list[Any], iterations: int,
           module: str) -> list[float]:
    if method == "cupti":
        return cupti_times(compiled, args, iterations)
    if method == "profiler":
        return profiler_times(compiled, args, iterations, module)
    return wallclock_times(compiled, args, iterations)
