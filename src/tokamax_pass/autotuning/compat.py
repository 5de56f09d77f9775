"""Upstream Tokamax's autotuning entry points on `BoundArguments` and `Op`, built on ours.

`BoundArguments.autotune` measures one call with an `Autotuner` (and can keep the result
in the user cache); `.cached_autotuning_data` reads its measurements from the active
results and the caches; `.benchmark` times it; `.vjp_arg_spec` gives its VJP op's
arguments; `Op.get_autotuning_cache` reads an op's measurements from the caches.
`core.op` reaches these through its hooks, since the core never imports the framework.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax

from tokamax_pass import benchmarking
from tokamax_pass.autotuning import cache
from tokamax_pass.autotuning.autotuner import Autotuner
from tokamax_pass.autotuning.entry import AutotuningData
from tokamax_pass.autotuning.result import AutotuningResult
from tokamax_pass.core import device, options
from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.core.hooks import HOOKS
from tokamax_pass.core.op import Op


def tune_bound(ba: BoundArguments, configs: Iterable[Any] | None, *,
               autotuner: Autotuner | None, cache_results: bool,
               timeout: float | None) -> Mapping[Any, Any]:
    """`{config: Measurement}` of `ba` on the default device (see `BoundArguments.autotune`)."""
    if autotuner is None:
        autotuner = Autotuner() if timeout is None else Autotuner(timeout=timeout)
    if not isinstance(autotuner, Autotuner):
        raise TypeError(f"autotune: autotuner must be a tokamax_pass.autotuning.Autotuner or "
                        f"None, got {type(autotuner).__name__}")
    entry = autotuner.tune(ba, None if configs is None else list(configs))
    if cache_results:
        cache.save(AutotuningResult(device.current_target().device_kind, [entry]))
    return AutotuningData(entry.data)


def cached_data(ba: BoundArguments) -> AutotuningData | None:
    """`ba`'s measurements, first layer that has them (see
    `BoundArguments.cached_autotuning_data`)."""
    if options.ignore_autotuning_cache.value:
        return None
    for layer in cache.layers(device.current_target().device_kind):
        entry = layer.lookup(ba)
        if entry is not None and entry.data:
            return AutotuningData(entry.data)
    return None


def benchmark_bound(ba: BoundArguments, mode: benchmarking.Mode) -> benchmarking.BenchmarkData:
    f_std, arrays = benchmarking.standardize_function(ba.op, *ba.args, kwargs=ba.kwargs,
                                                      mode=mode)
    return benchmarking.compile_benchmark(f_std, arrays)(arrays)


def vjp_arg_spec(ba: BoundArguments) -> dict[str, Any]:
    f_std, arrays = benchmarking.standardize_function(
        ba.op, *ba.args, kwargs={**ba.kwargs, "return_residuals": True}, seed=None)
    out, residuals = jax.eval_shape(f_std, arrays)
    return {**ba.arguments, "residuals": residuals, "out": out, "dout": out}


def _same_op(a: Op, b: Op) -> bool:
    return type(a) is type(b) and a.replace(config=None, vjp=None) == b.replace(
        config=None, vjp=None)


class CacheSnapshot(Mapping[str, AutotuningData]):
    """What `Op.get_autotuning_cache` returns: the caches' measurements when it was called,
    read-only, each call's `{config: Measurement}` too (an `AutotuningData`, as upstream's).
    Upstream Tokamax hands out its in-memory cache, which a write changes; a write here
    would change nothing the op reads, so it raises and names what does."""

    def __init__(self, found: dict[str, AutotuningData]) -> None:
        self._found = found

    def __getitem__(self, key: str) -> AutotuningData:
        return self._found[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._found)

    def __len__(self) -> int:
        return len(self._found)

    def __repr__(self) -> str:
        return f"CacheSnapshot({self._found!r})"

    def __setitem__(self, key: str, value: Any) -> None:
        raise TypeError(_READ_ONLY)

    def __delitem__(self, key: str) -> None:
        raise TypeError(_READ_ONLY)


_READ_ONLY = ("get_autotuning_cache() returns a read-only snapshot of the caches: a write "
              "would not change the configs ops run; tune with "
              "BoundArguments.autotune(cache_results=True), or run under an "
              "AutotuningResult (`with result:`)")


def cached_measurements(op: Op, device_kind: str | None) -> CacheSnapshot:
    """`op`'s measurements in the caches (see `Op.get_autotuning_cache`)."""
    if device_kind is None:
        device_kind = device.current_target().device_kind
    found: dict[str, AutotuningData] = {}
    for layer in reversed(cache.layers(device_kind)):
        if layer.label == "autotuning result":
            continue
        for entry in layer.result.entries:
            if _same_op(entry.bound.op, op):
                found[entry.bound.cache_key] = AutotuningData(entry.data)
    return CacheSnapshot(found)


HOOKS.tune_bound = tune_bound
HOOKS.cached_measurements = cached_measurements
HOOKS.cached_data = cached_data
HOOKS.benchmark_bound = benchmark_bound
HOOKS.vjp_arg_spec = vjp_arg_spec
