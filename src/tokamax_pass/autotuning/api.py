"""`autotune`: find the op calls, measure their configs, return an `AutotuningResult`."""

from __future__ import annotations

import difflib
import inspect
import logging
import math
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import jax

from tokamax_pass import benchmarking
from tokamax_pass.autotuning import cache as cache_lib
from tokamax_pass.autotuning import discovery, distributed, keys, lowering, staging
from tokamax_pass.autotuning.autotuner import Autotuner, candidate_configs
from tokamax_pass.autotuning.result import AutotuningResult
from tokamax_pass.core import checks, registry, spec
from tokamax_pass.core.bound_arguments import BoundArguments, NullConfig
from tokamax_pass.core.caller_warnings import warn_at_caller
from tokamax_pass.core.device import current_target

_log = logging.getLogger("tokamax_pass.autotuning")


class NothingToTuneWarning(UserWarning):
    """`autotune` was given a function that makes no op calls of this package."""

# Configs timed per op by default: the heuristics config and its nearest neighbours.
# Candidates compile at once and every extra config costs wall time. Over the H200
# library cache's 64 entries searched 5 to 32 configs wide, the 6 nearest held a config
# within 1.1% of the best measured (the 4 nearest missed by up to 19%, 8 of 64 by more
# than 3%): `python -m benchmarks.search_reach`.
DEFAULT_MAX_CONFIGS = 6


def _collect(f: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[BoundArguments]:
    if isinstance(f, BoundArguments):
        f = [f]
    if isinstance(f, (list, tuple)):
        if args or kwargs:
            raise TypeError("autotune: a list of BoundArguments takes no further arguments")
        if not all(isinstance(b, BoundArguments) for b in f):
            raise TypeError("autotune: a list must hold only BoundArguments (Op.bind(...))")
        return discovery.dedupe(f)
    return discovery.get_bound_args(f, *args, **kwargs)


def _name_ops_of(f: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """What a process other than 0 runs before reading process 0's result: finds the op
    calls `f` makes (lowering it), so the result may name their op classes here as it
    does on process 0 (`spec.remember_lowered`; a list of calls' ops, never lowered)."""
    for ba in _collect(f, args, kwargs):
        spec.remember_lowered(type(ba.op))


def _expand(bound: list[BoundArguments], target: Any) -> list[list[BoundArguments]]:
    """Each call once per implementation of its family that supports it here, grouped
    by call (a call already in an earlier group is dropped from later ones)."""
    groups: list[list[BoundArguments]] = []
    seen: set[tuple[str, str]] = set()
    for ba in bound:
        group = []
        for op in registry.implementations_of(ba.op):
            candidate = ba.replace(op=op)
            try:
                op.check_supported(candidate, target)
            except NotImplementedError:
                continue
            group.append(candidate)
        group = [c for c in discovery.dedupe(group) if keys.entry_key(c) not in seen]
        seen.update(keys.entry_key(c) for c in group)
        if group:
            groups.append(group)
    return groups


def autotune(f: Any, *args: Any, ignore_cache: bool = False, all_implementations: bool = False,
             timeout: float = 600.0, max_workers: int | None = None, cache: bool = False,
             progress: bool = True, iterations: int = 5, method: str | None = None,
             max_configs: int | None = DEFAULT_MAX_CONFIGS,
             lowering_processes: int | None = None, search_losers: bool = False,
             progress_bar: bool | None = None, **kwargs: Any) -> AutotuningResult:
    """Measures the configs of every op call in `f(*args, **kwargs)` on the default device.

    Args:
      f: a callable (plain or jitted; `jax.grad(f)` brings its VJP ops), a
        `jax.stages.Lowered`, StableHLO text, or a sequence of `BoundArguments`.
      ignore_cache: tune calls that active results or the caches already answer.
      all_implementations: time every implementation of each op's family (each
        with its configs), so `implementation=None` can pick by measurement.
      timeout: seconds allowed per op call for compiling its candidates (calls compiled
        together share their allowance).
      max_workers: threads compiling candidates, per pool (the XLA implementations' and
        the kernels'; default: one per CPU each).
      lowering_processes: worker processes exporting the candidates of ops that are slow
        to lower (`Op.slow_lowering`: Mosaic GPU kernels), so they lower in parallel
        (default: up to 8, started before `f` is traced on a GPU and elsewhere for a
        wave of 8 such candidates or more; 12 or 16 were no faster on the H200; 0: none).
      cache: merge the result into the user cache (`result.save_to_cache()`). Where that
        fails, the result is written to a file in the temporary directory and
        `UnsavedResultError` names it (its `.result` holds the result too).
      progress: show a tqdm progress bar. `progress_bar` (upstream Tokamax's name), when
        given, sets it.
      iterations, method: timed runs per config and the timer (`benchmarking`).
      max_configs: configs timed per op: the config `None` runs today where one is
        measured, the heuristics config and those nearest it (`None`: the whole search
        space).
      search_losers: with `all_implementations`, time and search every implementation.
        By default an implementation the caches of this device kind measured at least
        `staging.HOPELESS_RATIO` times slower than another at the call's shape or a
        near one is not timed, the others are first timed at their first config (as
        above), and only those that could then be chosen (`staging.py`) have their
        other configs timed: the losers' compiles were most of a model's tuning time.
        Nor is a config timed again that the caches measured at the call's own shape
        slower than the config `None` runs today, in the search that chose that one.

    In a multi-process run (`jax.distributed`) process 0 tunes and every process
    returns its result, so all compile the same kernels (`distributed.tune_once`).
    """
    _check_misspelled_options(f, kwargs)
    if progress_bar is not None:
        progress = progress_bar
    _check_options(f, ignore_cache=ignore_cache, all_implementations=all_implementations,
                   timeout=timeout, max_workers=max_workers, cache=cache, progress=progress,
                   iterations=iterations, method=method, max_configs=max_configs,
                   lowering_processes=lowering_processes, search_losers=search_losers)
    result = distributed.tune_once(lambda: _autotune_here(
        f, args, kwargs, ignore_cache=ignore_cache, all_implementations=all_implementations,
        timeout=timeout, max_workers=max_workers, progress=progress, iterations=iterations,
        method=method, max_configs=max_configs, lowering_processes=lowering_processes,
        search_losers=search_losers), discover=lambda: _name_ops_of(f, args, kwargs))
    if cache:
        _save_or_keep(result)
    return result


def _save_or_keep(result: AutotuningResult) -> None:
    """Merges `result` into the user cache; where that fails for any reason (an
    unwritable or corrupt cache, a cache file of another device kind), writes it to a
    fresh file in the temporary directory and raises `UnsavedResultError` naming that
    file and holding the result: a tuning run never loses its measurements to the
    cache."""
    try:
        result.save_to_cache()
    except Exception as e:  # any failure: the measurements are kept in the fallback file
        try:
            fd, fallback = tempfile.mkstemp(prefix="tokamax_pass-autotune-", suffix=".json")
            os.close(fd)
            result.dump(fallback)
        except OSError as dump_error:
            raise cache_lib.UnsavedResultError(
                f"autotune: saving the result to the user cache failed ({e}), and so did "
                f"writing it to the temporary directory ({dump_error}); the error's .result "
                f"holds it", result, None) from e
        raise cache_lib.UnsavedResultError(
            f"autotune: saving the result to the user cache failed ({e}); the result is in "
            f"{fallback}: AutotuningResult.load({fallback!r}) reads it, and its "
            f"save_to_cache(directory) saves it once a cache is writable", result,
            fallback) from e


def _check_options(f: Any, *, ignore_cache: Any, all_implementations: Any, timeout: Any,
                   max_workers: Any, cache: Any, progress: Any, iterations: Any, method: Any,
                   max_configs: Any, lowering_processes: Any, search_losers: Any) -> None:
    """Errors naming a bad argument before anything is traced or compiled: unchecked,
    `max_configs=-1` sliced the search space from its end, `iterations=0` timed
    nothing, and a flag like `all_implementations="sometimes"` read as true."""
    if not (callable(f) or isinstance(f, (str, list, tuple, BoundArguments, jax.stages.Lowered))):
        raise TypeError(
            f"autotune: f must be a callable, a jax.stages.Lowered, StableHLO text or a "
            f"sequence of BoundArguments, got {type(f).__name__}")
    for name, flag in (("ignore_cache", ignore_cache), ("all_implementations",
                       all_implementations), ("cache", cache), ("progress", progress),
                       ("search_losers", search_losers)):
        checks.require_bool("autotune", name, flag)
    if isinstance(timeout, float) and not math.isfinite(timeout):
        # An infinite one overflowed deep in `threading`, after the tracing.
        raise ValueError(f"autotune: timeout must be > 0 and finite (seconds), got {timeout!r}")
    checks.require_positive_number("autotune", "timeout", timeout)
    checks.require_int("autotune", "max_workers", max_workers, minimum=1, allow_none=True)
    checks.require_int("autotune", "lowering_processes", lowering_processes, minimum=0,
                       allow_none=True)
    checks.require_int("autotune", "iterations", iterations, minimum=1)
    checks.require_choice("autotune", "method", method, (None, *benchmarking.METHODS))
    try:  # before compiling: every timing would fail, and autotune keeps failures
        benchmarking.check_method(method, jax.default_backend())
    except ValueError as e:
        raise ValueError(f"autotune: {e}") from None
    checks.require_int("autotune", "max_configs", max_configs, minimum=1, allow_none=True)


def _check_misspelled_options(f: Any, kwargs: dict[str, Any]) -> None:
    """A `TypeError` for a keyword that `f` does not take and that is close to one of
    `autotune`'s options (`max_config=2`): it went to `f`, which failed to trace with
    "got an unexpected keyword argument", naming neither `autotune` nor the option."""
    if not kwargs or not callable(f) or isinstance(f, BoundArguments):
        return
    try:
        parameters = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):  # no signature to compare with
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    taken = {p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    options = [name for name, p in inspect.signature(autotune).parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY]
    for name in kwargs:
        close = difflib.get_close_matches(name, options, n=1)
        if name not in taken and close:
            raise TypeError(f"autotune: {name}= is neither an option of autotune nor a "
                            f"parameter of f; did you mean {close[0]}=?")


def _autotune_here(f: Any, args: Sequence[Any], kwargs: dict[str, Any], *, ignore_cache: bool,
                   all_implementations: bool, timeout: float, max_workers: int | None,
                   progress: bool, iterations: int, method: str | None,
                   max_configs: int | None, lowering_processes: int | None,
                   search_losers: bool) -> AutotuningResult:
    target = current_target()
    exporters = lowering.start_early(lowering_processes)
    try:
        return _tune(f, args, kwargs, target, ignore_cache=ignore_cache,
                     all_implementations=all_implementations, timeout=timeout,
                     max_workers=max_workers, progress=progress, iterations=iterations,
                     method=method, max_configs=max_configs,
                     lowering_processes=lowering_processes, exporters=exporters,
                     search_losers=search_losers)
    finally:
        if exporters is not None:
            exporters.close()


def _tune(f: Any, args: Sequence[Any], kwargs: dict[str, Any], target: Any, *,
          ignore_cache: bool, all_implementations: bool, timeout: float,
          max_workers: int | None, progress: bool, iterations: int, method: str | None,
          max_configs: int | None, lowering_processes: int | None,
          exporters: lowering.ExportWorkers | None, search_losers: bool) -> AutotuningResult:
    bound = _collect(f, args, kwargs)
    if not bound and callable(f) and not isinstance(f, jax.stages.Compiled):
        warn_at_caller(
            "autotune: the function makes no tokamax_pass op calls, so there is nothing to "
            "measure. autotune measures the ops a function calls (tokamax_pass."
            "dot_product_attention, layer_norm, ...); for a function written in plain JAX "
            "(jax.nn.dot_product_attention, a norm or a gated MLP in jax.numpy), "
            "tokamax_pass.optimize(f, autotune='always') (on the command line, "
            "tokamax-pass export --autotune always) rewrites those patterns into op calls "
            "and measures them", NothingToTuneWarning)
    if all_implementations:
        groups = _expand(bound, target)
    else:
        _require_device(bound, target)
        groups = [[ba] for ba in bound if ba.op.config_cls is not NullConfig]
    partly_cached = [False] * len(groups)
    if not ignore_cache:
        uncached = [[ba for ba in group
                     if cache_lib.SOURCE.find_config(ba, target.device_kind) is None]
                    for group in groups]
        partly_cached = [len(u) < len(g) for u, g in zip(uncached, groups, strict=True)]
        groups = uncached
    plans = [[plan for ba in group
              if (plan := _plan(ba, max_configs, target.device_kind)) is not None]
             for group in groups]
    staged = all_implementations and not search_losers
    if staged:
        plans = [[_without_known_losers(ba, configs, target.device_kind)
                  for ba, configs in group] for group in plans]
    beaten = [_hopeless(group, target.device_kind) if staged else [None] * len(group)
              for group in plans]
    bar = _progress_bar(sum(len(c if whole or not staged else c[:1])
                            for g, whole, verdicts in zip(plans, partly_cached, beaten,
                                                          strict=True)
                            for (_, c), by in zip(g, verdicts, strict=True) if by is None),
                        progress)
    tuner = Autotuner(timeout=timeout, max_workers=max_workers, iterations=iterations,
                      method=method, on_config_done=_advance(bar),
                      lowering_processes=lowering_processes, exporters=exporters)
    try:
        if staged:
            entries = staging.tune_in_stages(tuner, plans, on_stage_two=_extend(bar),
                                             search_all=partly_cached, beaten=beaten)
        else:
            entries = tuner.tune_many([plan for group in plans for plan in group])
    finally:
        if bar is not None:
            bar.close()
    return AutotuningResult(target.device_kind, entries)


def _without_known_losers(ba: BoundArguments, configs: list[Any], device_kind: str | None
                          ) -> tuple[BoundArguments, list[Any]]:
    """`staging.without_known_losers`'s plan for `ba`, the configs it drops logged."""
    kept = staging.without_known_losers(ba, configs, device_kind)
    if len(kept) < len(configs):
        _log.info("autotune: not timing %d configs of %s at %r again: the caches measured "
                  "them at this shape slower than %s (search_losers=True times them)",
                  len(configs) - len(kept), type(ba.op).__name__, ba, configs[0])
    return ba, kept


def _hopeless(group: Sequence[tuple[BoundArguments, list[Any]]], device_kind: str | None
              ) -> list[tuple[int, ...] | None]:
    """`staging.hopeless` for one call's plans, each implementation not timed logged."""
    calls = [ba for ba, _ in group]
    verdicts = staging.hopeless(calls, device_kind)
    for ba, by in zip(calls, verdicts, strict=True):
        if by is not None:
            _log.info("autotune: not timing %s at %r: the caches measured %s at least %gx faster "
                      "(search_losers=True times it)", type(ba.op).__name__, ba,
                      ", ".join(type(calls[j].op).__name__ for j in by),
                      staging.HOPELESS_RATIO)
    return verdicts


def _plan(ba: BoundArguments, max_configs: int | None, device_kind: str | None
          ) -> tuple[BoundArguments, list[Any]] | None:
    """`(ba, its candidate configs)`, or `None` (logged) for a broken search space."""
    try:
        configs = candidate_configs(ba, max_configs)
    except Exception as e:  # noqa: BLE001 - one op's broken search space skips that op only
        _log.warning("autotune: skipping %r: %s", ba, e)
        return None
    return ba, with_current_config(ba, configs, max_configs, device_kind)


def with_current_config(ba: BoundArguments, configs: list[Any], max_configs: int | None,
                        device_kind: str | None) -> list[Any]:
    """`configs` with the config `implementation=None` runs for `ba` today (a measured
    one: an active result's, the user cache's or the library cache's) first, the list
    kept to `max_configs`.

    Tuned must not lose to untuned: the search around the heuristics config can miss the
    shipped config (`python -m benchmarks.search_reach` counts, over the library cache,
    the entries whose best config lies outside the first k candidates), and then the
    tuned program would never have timed what it replaces. First, because stage one
    compares implementations at their first config."""
    found = cache_lib.SOURCE.find_config(ba, device_kind)
    if found is None or not isinstance(found[0], ba.op.config_cls):
        return configs
    current = found[0]
    rest = [c for c in configs if c != current]
    if max_configs is not None:
        rest = rest[:max_configs - 1]
    return [current, *rest]


def _require_device(bound: Sequence[BoundArguments], target: Any) -> None:
    """A `RuntimeError` for a call whose implementation cannot run on this machine's device
    (`PallasMosaicTpuRaggedDot` bound on a CPU machine): timing a kernel needs its device,
    and tuning nothing would look like success."""
    for ba in bound:
        try:
            ba.op.check_supported_target(target)
        except NotImplementedError as e:
            raise RuntimeError(
                f"autotune: cannot time {type(ba.op).__name__} here: {e}. Timing needs the "
                f"device it runs on: run autotune there (its result can be dumped and loaded "
                f"anywhere), or pass all_implementations=True to tune what runs here") from None


def _advance(bar: Any) -> Any:
    """A callback moving the progress bar one config on, naming the op being timed."""
    if bar is None:
        return None

    def advance(ba: BoundArguments) -> None:
        bar.set_postfix_str(type(ba.op).__name__, refresh=False)
        bar.update(1)

    return advance


def _extend(bar: Any) -> Any:
    """A callback adding stage two's configs to the progress bar's total."""
    if bar is None:
        return None

    def extend(n: int) -> None:
        bar.total += n
        bar.refresh()

    return extend


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="autotuning", unit="config")
