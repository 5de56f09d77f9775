"""The `Autotuner`: time every candidate config of one op call, keep every failure.

Candidates are compiled from abstract shapes in parallel threads while the inputs
and the reference output are prepared (`timing_inputs`), then timed one at a time on
the device on the same random inputs. A config that fails (compile error, timeout,
out of memory, wrong numerics against the family's XLA reference: `numerics`) is
recorded with its reason instead of raising. A config whose fastest of the first few
runs is already `early_stop_ratio` times the best median so far stops there. The
implementations of one call (one family, one argument spec) share their inputs and
reference output.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from tokamax_pass import benchmarking
from tokamax_pass.autotuning import keys, lowering, numerics, timing_inputs
from tokamax_pass.autotuning.entry import Entry, Measurement
from tokamax_pass.autotuning.lowering import call_op
from tokamax_pass.core import spec
from tokamax_pass.core.bound_arguments import BoundArguments, NullConfig
from tokamax_pass.core.device import current_target
from tokamax_pass.core.op import family_class
from tokamax_pass.core.vjp import VjpOp


def _distance(config: Any, anchor: Any) -> float:
    """How far `config` is from `anchor`: log2 steps over numeric fields, 1 per other change."""
    total = 0.0
    for field in dataclasses.fields(config):
        a, b = getattr(config, field.name), getattr(anchor, field.name)
        numeric = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (a, b))
        total += abs(np.log2(a) - np.log2(b)) if numeric else float(a != b)
    return total


def candidate_configs(ba: BoundArguments, max_configs: int | None = None) -> list[Any]:
    """The heuristics config first, then the op's search space (deterministic order).

    `max_configs` prunes by the heuristics: the configs nearest the heuristics config
    are kept (tiles and stages a few power-of-2 steps away are where a better config
    usually is), so tuning costs a bounded number of compiles per op.
    """
    if ba.op.config_cls is NullConfig:
        return [NullConfig()]
    configs: list[Any] = []
    with contextlib.suppress(NotImplementedError):
        configs.append(ba.heuristics_config)
    rest = sorted(set(ba.op._get_autotuning_configs(ba)) - set(configs),
                  key=lambda c: spec.dumps(spec.encode_config(c)))
    if max_configs is not None and configs and len(configs) + len(rest) > max_configs:
        rest = sorted(rest, key=lambda c: _distance(c, configs[0]))[: max_configs - 1]
    return configs + rest

def _inputs_key(ba: BoundArguments) -> tuple[type, str]:
    """Calls with one key are timed on the same inputs and checked against the same
    reference output: the implementations of one op call (one family, one argument spec,
    in either stage of a two-stage tuning)."""
    return family_class(type(ba.op)), ba.cache_key


def _describe(kind: str, error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    message = " ".join(text)[:500]
    if "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower():
        kind = "out of memory"
    return f"{kind}: {message}"

# Op calls whose inputs and reference outputs are on the device at once (bounds the
# device memory they hold). Candidates of all calls compile together regardless.
OPS_PER_WAVE = 8
# Threads compiling the later waves' untimed programs ahead (beside the candidates').
UNTIMED_AHEAD_WORKERS = 4


def _result_or_none(future: concurrent.futures.Future | None) -> Any:
    """A future's result, or `None` when there is none or it failed (the work is then
    done where the result was wanted)."""
    if future is None:
        return None
    try:
        return future.result()
    except Exception:  # noqa: BLE001 - compiling ahead is an optimization only
        return None


@dataclasses.dataclass
class _Job:
    """One op call on its way to the timer: its compiling candidates, and its inputs and
    reference output (prepared for the wave it is timed in)."""

    ba: BoundArguments
    configs: list[Any]
    compiles: dict[concurrent.futures.Future, Any] = dataclasses.field(default_factory=dict)
    compiled: dict[Any, Any] = dataclasses.field(default_factory=dict)
    failed: dict[Any, Measurement] = dataclasses.field(default_factory=dict)
    prepared: concurrent.futures.Future | None = None
    untimed: concurrent.futures.Future | None = None  # `Untimed`, compiled ahead

    def prepared_inputs(self) -> Any:
        """The prepared `(arrays, expected output)`, waited for."""
        if self.prepared is None:
            raise RuntimeError(f"{type(self.ba.op).__name__}: timed before it was prepared")
        return self.prepared.result()

    def collect(self, deadline: float, timeout: float) -> None:
        """Waits for the compiles (until the deadline); records failures."""
        done, pending = concurrent.futures.wait(
            self.compiles, timeout=max(0.0, deadline - time.monotonic()))
        for future in done:
            config = self.compiles[future]
            try:
                self.compiled[config] = future.result()
            except Exception as e:  # noqa: BLE001 - every failure is recorded, not raised
                self.failed[config] = Measurement(error=_describe("compile error", e))
        for future in pending:
            future.cancel()
            self.failed[self.compiles[future]] = Measurement(
                error=f"timeout: not compiled within {timeout:g} s per op call")


def _compiles_gemms_with_xla(op: Any) -> bool:
    """Whether `op` is an XLA implementation: compiling its program runs XLA's GEMM
    autotuning on the device, which the compiles of concurrent candidates wait their turn
    for."""
    return op.implementation.startswith("xla") or op.plain_jax_path


def _round_robin(jobs: Sequence[_Job]) -> Iterator[tuple[_Job, Any]]:
    """Each call's candidates in turn (heuristics configs first), so a call whose compiles
    are slow starts early: first the XLA implementations' calls, whose compiles take the
    device for XLA's GEMM autotuning one at a time (a MoE step's XLA ragged dots, handed
    over 26 s into its compile phase, took 8-10 s each and ended it:
    `benchmarks/probes/model_autotune_timeline_probe.py`), each kind gradient (VJP) calls
    first, as their programs hold the most GEMMs and compile longest (in program order
    the MoE step's compile phase waited 15 s on them:
    `benchmarks/probes/model_autotune_timeline_probe.py`)."""
    ordered = sorted(jobs, key=lambda job: (not _compiles_gemms_with_xla(job.ba.op),
                                            not isinstance(job.ba.op, VjpOp)))
    for row in itertools.zip_longest(*([(job, c) for c in job.configs] for job in ordered)):
        yield from (pair for pair in row if pair is not None)


@dataclasses.dataclass
class Autotuner:
    """Times the candidate configs of op calls on the default device."""

    timeout: float = 600.0
    max_workers: int | None = None
    iterations: int = benchmarking.DEFAULT_ITERATIONS
    method: str | None = None
    early_stop_iterations: int = 3
    early_stop_ratio: float = 1.5
    check_numerics: bool = True
    seed: int = 0
    on_config_done: Callable[[BoundArguments], None] | None = None
    # Processes exporting candidates (`lowering.py`); None: some when enough are slow.
    lowering_processes: int | None = None
    # Export workers started by the caller (and closed by it); None: per call, as above.
    exporters: lowering.ExportWorkers | None = None
    # `timing_inputs.Untimed` futures by `_inputs_key`, kept across `tune_many` calls.
    _untimed: dict[Any, concurrent.futures.Future] = dataclasses.field(
        default_factory=dict, init=False, repr=False)

    def autotune(self, fn_factory: Callable[[Any], Callable[..., Any]], configs: Iterable[Any],
                 *args: Any, timeout: float | None = 600.0, **kwargs: Any
                 ) -> dict[Any, benchmarking.BenchmarkData | Exception]:
        """Times `fn_factory(config)(*args, **kwargs)` for each config, as upstream
        Tokamax's `Autotuner.autotune`: `{config: BenchmarkData, or the exception that
        config raised}`. Abstract arguments (`ShapeDtypeStruct`) get one set of random
        values (this tuner's `seed`) shared by every config; every config compiles
        before any is timed, within `timeout` seconds in all (`None`: no limit); a
        config left uncompiled then maps to a `TimeoutError`."""
        configs = list(configs)
        deadline = None if timeout is None else time.monotonic() + timeout
        compiled: dict[Any, tuple[Any, list[Any]]] = {}
        results: dict[Any, benchmarking.BenchmarkData | Exception] = {}
        arrays = None
        for config in configs:
            if deadline is not None and time.monotonic() >= deadline:
                results[config] = TimeoutError(
                    f"not compiled within the autotuning timeout of {timeout} s")
                continue
            try:
                f_std, abstract = benchmarking.standardize_function(
                    fn_factory(config), *args, kwargs=kwargs, seed=None)
                if arrays is None:
                    arrays = benchmarking.random_initialize(abstract, self.seed)
                compiled[config] = (benchmarking.compile_benchmark(f_std, arrays), arrays)
            except Exception as e:  # noqa: BLE001 - a failing config is a result
                results[config] = e
        for config, (run, config_arrays) in compiled.items():
            try:
                results[config] = run(config_arrays, method=self.method,
                                      iterations=self.iterations)
            except Exception as e:  # noqa: BLE001
                results[config] = e
        return {config: results[config] for config in configs}

    def tune(self, ba: BoundArguments, configs: list[Any] | None = None) -> Entry:
        """Measures every config of `ba` (default: `candidate_configs(ba)`)."""
        return self.tune_many([(ba, configs)])[0]

    def tune_many(self, plans: Sequence[tuple[BoundArguments, list[Any] | None]]
                  ) -> list[Entry]:
        """Measures the configs of several op calls. Every candidate of every call
        compiles first, in `_compile_all`'s two thread pools (with the first wave's
        inputs and references prepared meanwhile, and every call's untimed programs
        compiled ahead in a small pool of their own, once per `_inputs_key` for this
        tuner's life); then,
        `OPS_PER_WAVE` calls at a time, inputs and references are prepared (once per
        key in the wave) and every candidate is timed, one at a time. Compiling (which
        can run XLA's own autotuning on the device) never overlaps a timing, no wave
        waits on another's slowest compile, and preparing a wave runs its untimed
        programs rather than compiling them (a MoE step's tuning waited 9 s on that:
        `benchmarks/probes/model_autotune_timeline_probe.py`; a Llama step's stage two waited 5.6 s
        on compiling a reference stage one had compiled:
        `benchmarks/probes/model_autotune_timeline_probe.py`).
        Those programs skip XLA's GEMM autotuning, so compiling them ahead never uses
        the device."""
        canonical = [keys.canonical(ba) for ba, _ in plans]
        jobs = [_Job(ba, candidate_configs(ba) if configs is None else configs)
                for ba, (_, configs) in zip(canonical, plans, strict=True)]
        waves = [jobs[i:i + OPS_PER_WAVE] for i in range(0, len(jobs), OPS_PER_WAVE)]
        entries: list[Entry] = []
        ahead = concurrent.futures.ThreadPoolExecutor(UNTIMED_AHEAD_WORKERS)
        with concurrent.futures.ThreadPoolExecutor(OPS_PER_WAVE) as preparer:
            try:
                for job in jobs:
                    job.untimed = self._untimed_programs(job.ba, ahead)
                self._compile_all(jobs, first_wave=waves[0] if waves else [],
                                  preparer=preparer)
                for wave in waves:
                    self._time_wave(wave, preparer, entries)
            finally:
                ahead.shutdown(wait=False, cancel_futures=True)
        return entries

    def _untimed_programs(self, ba: BoundArguments,
                          pool: concurrent.futures.Executor) -> concurrent.futures.Future:
        """The future `Untimed` of `ba`, compiled once per `_inputs_key` in `pool`."""
        key = _inputs_key(ba)
        future = self._untimed.get(key)
        if future is None or future.cancelled():
            future = self._untimed[key] = pool.submit(timing_inputs.compile_untimed, ba,
                                                      self.check_numerics, self.seed)
        return future

    def _prepare_wave(self, wave: Sequence[_Job],
                      preparer: concurrent.futures.Executor) -> None:
        """Starts preparing the wave's inputs and references, once per `_inputs_key`."""
        shared: dict[Any, concurrent.futures.Future] = {}
        for job in wave:
            if job.prepared is None:
                key = _inputs_key(job.ba)
                if key not in shared:
                    shared[key] = preparer.submit(self._prepare, job.ba, job.untimed)
                job.prepared = shared[key]

    def _time_wave(self, wave: Sequence[_Job], preparer: concurrent.futures.Executor,
                   entries: list[Entry]) -> None:
        """Prepares the wave's inputs and references, then times its calls in order."""
        self._prepare_wave(wave, preparer)
        # Every input and reference of the wave is ready before any timing: their device
        # work would otherwise run under the timer.
        inputs = [job.prepared_inputs() for job in wave]
        for job, (arrays, expected) in zip(wave, inputs, strict=True):
            job.prepared = job.untimed = None  # inputs and programs go once timed
            entries.append(self._time(job, arrays, expected))
            job.compiled.clear()

    def _compile_all(self, jobs: Sequence[_Job], first_wave: Sequence[_Job],
                     preparer: concurrent.futures.Executor) -> None:
        """Compiles every candidate of `jobs` (the first wave's inputs prepared meanwhile:
        candidates compile from abstract shapes, so none waits for them).

        The XLA implementations' candidates get a pool of their own: their compiles spend
        most of their time waiting for the device (XLA's GEMM autotuning, one compile at a
        time), and in a shared pool they held every thread while the kernels' compiles,
        which need the CPU only, waited behind them (a Gemma-2 step's Mosaic attention
        gradients started 5-10 s late and ended its compile phase:
        `benchmarks/probes/model_autotune_timeline_probe.py`)."""
        slow = sum(len(job.configs) for job in jobs if job.ba.op.slow_lowering)
        cpus = os.cpu_count() or 1
        pools: dict[bool, concurrent.futures.ThreadPoolExecutor] = {}
        for xla in (True, False):
            count = sum(len(job.configs) for job in jobs
                        if _compiles_gemms_with_xla(job.ba.op) == xla)
            if count:
                pools[xla] = concurrent.futures.ThreadPoolExecutor(
                    max(self.max_workers or min(count, cpus), 1))
        exporters = owned = None
        if self.exporters is not None:
            exporters = self.exporters
        elif processes := lowering.process_count(self.lowering_processes, slow, cpus):
            exporters = owned = lowering.ExportWorkers(processes)
        # The calls share the pools, so they get `timeout` per call in all.
        deadline = time.monotonic() + self.timeout * len(jobs)
        try:
            self._prepare_wave(first_wave, preparer)
            for job, config in _round_robin(jobs):
                pool = pools[_compiles_gemms_with_xla(job.ba.op)]
                future = pool.submit(self._compile_one, job.ba, config, exporters)
                job.compiles[future] = config
            for job in jobs:
                job.collect(deadline, self.timeout)
        finally:
            for pool in pools.values():
                pool.shutdown(wait=False, cancel_futures=True)
            if owned is not None:
                owned.close()

    def _prepare(self, ba: BoundArguments,
                 untimed: concurrent.futures.Future | None = None) -> tuple[list[Any], Any]:
        """The flat input arrays every config of `ba` is timed on, and the reference output
        (None when numerics go unchecked), run by the programs compiled ahead (`untimed`)
        where they were."""
        ahead = _result_or_none(untimed) or timing_inputs.Untimed(None, None)
        arguments = timing_inputs.timing_arguments(ba, self.seed, ahead.forward, ahead.random)
        _, arrays = benchmarking.standardize_function(
            call_op(ba.op, ba.vmap, arguments), arguments, seed=None)
        expected = (self._reference_output(ba, arguments, ahead.reference)
                    if self.check_numerics else None)
        return arrays, expected

    @staticmethod
    def _compile_one(ba: BoundArguments, config: Any,
                     workers: lowering.ExportWorkers | None) -> Any:
        """`compile_benchmark`'s runner of one candidate, compiled for `ba`'s shapes."""
        op = ba.op.replace(config=config)
        arguments = timing_inputs.operand_shapes(ba)
        f_std, specs = benchmarking.standardize_function(
            call_op(op, ba.vmap, arguments), arguments, seed=None)
        if workers is not None and op.slow_lowering:
            try:
                blob = workers.export(op, ba.vmap, arguments,
                                      jax.export.default_export_platform(),
                                      current_target().device_kind)
            except Exception:  # noqa: BLE001 - not exportable there: lower it here
                pass
            else:
                f_std = lowering.deserialized(blob)
        return benchmarking.compile_benchmark(f_std, specs)

    def _time(self, job: _Job, arrays: list[Any], expected: Any) -> Entry:
        results, best = dict(job.failed), float("inf")
        for config in job.configs:
            if config in job.compiled:
                measurement = self._measure(job.compiled[config], arrays, expected, best)
                results[config] = measurement
                best = min(best, measurement.median_ms)
            self._done(job.ba)
        return Entry(job.ba, {c: results[c] for c in job.configs}, keys.provenance(job.ba.op))

    def _done(self, ba: BoundArguments) -> None:
        if self.on_config_done is not None:
            self.on_config_done(ba)

    def _reference_output(self, ba: BoundArguments, arguments: dict[str, Any],
                          compiled: Callable[[Any], Any] | None = None) -> Any:
        """The reference op's output on `arguments`, or None (numerics go unchecked) where
        it cannot run. Awaited here: a reference that fails on the device (XLA's attention
        gradient asks 48 GiB at b4 s8192 h16 d128) reports it when its output is used, and
        unawaited that failure would surface in every config's numerics check instead, so
        no config of the call would be timed."""
        reference = ba.op.reference_op()
        try:
            f_std, arrays = benchmarking.standardize_function(
                call_op(reference, ba.vmap, arguments), arguments, seed=None)
            return jax.block_until_ready(timing_inputs.run_untimed(f_std, arrays, compiled))
        except Exception:  # noqa: BLE001 - without a reference, numerics go unchecked
            return None

    def _measure(self, run: Any, f_args: list[Any], expected: Any, best: float) -> Measurement:
        """Checks numerics, then times: a few runs, and the rest only if it can still win."""
        base: dict[str, Any] = dict(lower_time_ms=None, compile_time_ms=None,
                                    peak_memory_mb=None)
        try:
            out = jax.block_until_ready(run.compiled(f_args))
            if expected is not None:
                error = numerics.numerics_error(out, expected)
                if error is not None:
                    return Measurement(error=error)
            start = time.perf_counter()
            first = run(f_args, method=self.method, iterations=self.early_stop_iterations)
            times = list(first.evaluation_times_ms)
            base = dict(lower_time_ms=first.lower_time_ms, compile_time_ms=first.compile_time_ms,
                        peak_memory_mb=first.peak_memory_mb)
            can_win = min(times) <= self.early_stop_ratio * best
            if can_win and time.perf_counter() - start < self.timeout:
                rest = self.iterations - len(times)
                if rest > 0:
                    times += run(f_args, method=self.method, iterations=rest).evaluation_times_ms
        except Exception as e:  # noqa: BLE001 - every failure is recorded, not raised
            return Measurement(error=_describe("run error", e), **base)
        return Measurement(evaluation_times_ms=tuple(times), **base)
