"""Benchmarking: standardize a function, compile it, time it on the device.

    f_std, args = standardize_function(f, kwargs={"x": x, "scale": scale})
    run = compile_benchmark(f_std, args)
    data = run(args, iterations=10)     # BenchmarkData

The timers are `tokamax_pass.device_timers`'s; the random inputs for abstract arguments
are `tokamax_pass.random_inputs`'s.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_pass import batching, device_timers
from tokamax_pass.core import checks, spec
from tokamax_pass.core.bound_arguments import NullConfig
from tokamax_pass.device_timers import (
    CUPTI_RUNS_A_SESSION,
    METHOD_ALIASES,
    METHODS,
    canonical_method,
    check_method,
    traced_hlo_ops,
)
from tokamax_pass.random_inputs import compile_random_initialize, random_array, random_initialize

__all__ = [
    "CUPTI_RUNS_A_SESSION", "DEFAULT_ITERATIONS", "MAX_SEED", "METHODS", "METHOD_ALIASES",
    "MODES", "BenchmarkData", "Mode", "benchmark", "canonical_method", "check_method",
    "compile_benchmark", "compile_random_initialize", "get_benchmark_registrar",
    "random_array", "random_initialize", "register_benchmark", "standardize_function",
    "traced_hlo_ops",
]

Mode = Literal["forward", "forward_res", "vjp", "forward_and_vjp"]
MODES = ("forward", "forward_res", "vjp", "forward_and_vjp")
DEFAULT_ITERATIONS = 5
# The largest `seed`: it reaches the random-input program as an int32 argument (a larger
# one overflowed there, deep in JAX's argument parsing).
MAX_SEED = 2**31 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class BenchmarkData:
    """Timings of one compiled function, in milliseconds (memory in MB).

    The first five fields are upstream Tokamax's, in its order. `metadata`: what the
    timer reports beside the times (the timing method's name). `peak_memory_mb`: the
    compiled program's peak device memory; `method`: the timer (`None` takes
    `metadata["method"]`); `temp_memory_mb`: the program's temporaries alone, the memory
    beyond its inputs and outputs (XLA's memory analysis).
    """

    compile_time_ms: float
    lower_time_ms: float
    evaluation_times_ms: tuple[float, ...]
    metadata: dict[str, Any] = dataclasses.field(hash=False)
    peak_memory_mb: float | None = None
    method: str | None = None
    temp_memory_mb: float | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", self.metadata.get("method"))

    @property
    def median_evaluation_time_ms(self) -> float:
        return statistics.median(self.evaluation_times_ms)

    @property
    def min_evaluation_time_ms(self) -> float:
        return min(self.evaluation_times_ms)

    def asdict(self) -> dict[str, Any]:
        """The fields and the median evaluation time, as a plain dict (for logs, JSON)."""
        return {**dataclasses.asdict(self),
                "median_evaluation_time_ms": self.median_evaluation_time_ms}


def _bind_signature(f: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    try:
        signature = inspect.signature(f)
    except (TypeError, ValueError):
        return args, kwargs
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"standardize_function: {e}") from None
    bound.apply_defaults()
    return bound.args, bound.kwargs


def standardize_function(
    f: Callable[..., Any], *args: Any, kwargs: dict[str, Any] | None = None,
    mode: Mode = "forward", seed: int | None = 0,
) -> tuple[Callable[[list[Any]], Any], list[Any]]:
    """`(f_std, arrays)`: `f_std(arrays)` calls `f` with every non-array argument baked in.

    Array leaves of `args`/`kwargs` become the list `arrays`; `ShapeDtypeStruct`s are
    filled with random values from `seed` (`seed=None` keeps them abstract).
    `BatchedShapeDtype` arguments (all arrays then) run under their `jax.vmap`s, and
    their random values have the batched shapes (`vmap_shape`).
    `mode="forward_res"` times the forward pass as differentiation runs it (saving its
    residuals: custom VJP forward rules), returning its output only.
    `mode="vjp"` times the backward pass alone: the forward runs here, its residuals
    become inputs of `f_std` together with a random cotangent. `"forward_and_vjp"`
    times both, with the output as its own cotangent behind an optimization barrier (as
    upstream Tokamax does): without it XLA fuses the backward with the expression that
    made the cotangent, which no training step allows (a jnp expression timed without it
    can rank ahead of an op it trails inside `jax.grad`:
    `benchmarks/probes/glu_vjp_variants_probe.py`). It returns upstream's structure,
    `(out, (gradients,))`, a gradient for every array.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be 'forward', 'forward_res', 'vjp' or 'forward_and_vjp', "
                         f"got {mode!r}")
    checks.require_callable("standardize_function", "f", f)
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"standardize_function: kwargs must be a dict of keyword arguments "
                        f"or None, got {type(kwargs).__name__}")
    checks.require_int("standardize_function", "seed", seed, minimum=0, allow_none=True)
    if seed is not None and seed > MAX_SEED:
        raise ValueError(f"standardize_function: seed must be an int in [0, {MAX_SEED}] or "
                         f"None, got {seed!r}")
    args, kwargs = _bind_signature(f, args, dict(kwargs or {}))
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=lambda v: v is None)
    array_index = [i for i, leaf in enumerate(leaves) if spec.is_array(leaf)]
    arrays = [leaves[i] for i in array_index]

    def forward(*xs: Any) -> Any:
        new_leaves = list(leaves)
        for i, x in zip(array_index, xs, strict=True):
            new_leaves[i] = x
        call_args, call_kwargs = jax.tree.unflatten(treedef, new_leaves)
        return f(*call_args, **call_kwargs)

    if any(isinstance(a, batching.BatchedShapeDtype) for a in arrays):
        for in_axes in reversed(batching.vmap_levels(arrays)):
            forward = jax.vmap(forward, in_axes=in_axes)
        arrays = [jax.ShapeDtypeStruct(a.vmap_shape, a.dtype) for a in arrays]
    if seed is not None:
        arrays = random_initialize(arrays, seed)

    if mode == "forward":
        return (lambda xs: forward(*xs)), arrays
    diff = [i for i, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.inexact)]
    if not diff:
        raise ValueError(f"mode={mode!r} needs at least one floating-point array argument")

    def forward_diff(xs: list[Any], *diff_xs: Any) -> Any:
        full = list(xs)
        for i, x in zip(diff, diff_xs, strict=True):
            full[i] = x
        return forward(*full)

    if mode == "forward_res":
        # The forward pass as differentiation runs it (custom VJP forward rules, which
        # save residuals), its output only.
        return (lambda xs: jax.vjp(lambda *d: forward_diff(xs, *d),
                                   *(xs[i] for i in diff))[0]), arrays
    if mode == "forward_and_vjp":
        def f_std(xs: list[Any]) -> Any:
            out, pullback = jax.vjp(lambda *d: forward_diff(xs, *d), *(xs[i] for i in diff))
            out = jax.lax.optimization_barrier(out)
            grads = dict(zip(diff, pullback(out), strict=True))
            # Upstream's structure, `jax.vjp` of `f_std`'s one argument: `(out,
            # (gradients,))`, a gradient for every array (float0 zeros for integers).
            return out, (tuple(grads.get(i, _no_gradient(x)) for i, x in enumerate(xs)),)

        return f_std, arrays
    if any(isinstance(a, jax.ShapeDtypeStruct) for a in arrays):
        raise ValueError("mode='vjp' needs concrete inputs (seed=None is not supported)")
    out, pullback = jax.vjp(lambda *d: forward_diff(arrays, *d), *(arrays[i] for i in diff))
    dout = jax.tree.map(
        lambda o, k: random_array(k, o.shape, o.dtype), out,
        _split_like(out, 0 if seed is None else seed + 1),
    )
    residuals, pullback_tree = jax.tree.flatten(pullback)
    return (
        lambda xs: jax.tree.unflatten(pullback_tree, xs[: len(residuals)])(
            jax.tree.unflatten(jax.tree.structure(out), xs[len(residuals):])
        ),
        [*residuals, *jax.tree.leaves(dout)],
    )


def _no_gradient(x: Any) -> Any:
    """The cotangent `jax.vjp` gives an integer array: float0 zeros of its shape."""
    return np.zeros(np.shape(x), jax.dtypes.float0)


def _split_like(tree: Any, seed: int) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, list(jax.random.split(jax.random.key(seed), len(leaves))))


def compile_benchmark(f_std: Callable[[list[Any]], Any] = checks.NOT_GIVEN,
                      args: list[Any] = checks.NOT_GIVEN, *,
                      f: Callable[[list[Any]], Any] = checks.NOT_GIVEN,
                      x: list[Any] = checks.NOT_GIVEN) -> Callable[..., BenchmarkData]:
    """Jits, lowers and compiles `f_std` for `args`; returns `run(args, *, method, iterations)`.

    `f=`, `x=`: upstream Tokamax's names for `f_std` and `args` (`run` takes `x=` too)."""
    f_std = checks.one_of("compile_benchmark", "f_std", f_std, "f", f)
    args = checks.one_of("compile_benchmark", "args", args, "x", x)
    checks.require_callable("compile_benchmark", "f_std", f_std)
    if not isinstance(args, (list, tuple)):
        raise TypeError(f"compile_benchmark: args must be the list of arrays "
                        f"standardize_function returned, got {type(args).__name__}")
    start = time.perf_counter()
    lowered = jax.jit(f_std).lower(args)
    lower_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_ms = (time.perf_counter() - start) * 1e3
    memory = compiled.memory_analysis()
    peak = getattr(memory, "peak_memory_in_bytes", None) if memory is not None else None
    temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
    match = re.search(r"HloModule (\S+?),", compiled.as_text() or "")
    module = match.group(1) if match else ""

    def run(args: list[Any] = checks.NOT_GIVEN, *, method: str | None = None,
            iterations: int = DEFAULT_ITERATIONS, x: list[Any] = checks.NOT_GIVEN
            ) -> BenchmarkData:
        """Times `iterations` runs after a warm-up; `method=None` picks the best available."""
        args = checks.one_of("benchmark", "args", args, "x", x)
        checks.require_int("benchmark", "iterations", iterations, minimum=1)
        if not isinstance(args, (list, tuple)):  # `None` failed as "not iterable"
            raise TypeError(f"benchmark: args must be the list of arrays compile_benchmark "
                            f"compiled for, got {type(args).__name__}")
        abstract = [i for i, a in enumerate(args) if isinstance(a, jax.ShapeDtypeStruct)]
        if abstract:  # JAX's "is not a valid JAX type", from inside the executable's call
            raise ValueError(
                f"benchmark: args[{abstract[0]}] is a jax.ShapeDtypeStruct; timing needs "
                f"arrays: make them with benchmarking.random_initialize(args, seed) "
                f"(standardize_function with seed=None keeps its inputs abstract)")
        times, method = device_timers.time_runs(compiled, args, iterations, method, module)
        return BenchmarkData(
            lower_time_ms=lower_ms, compile_time_ms=compile_ms,
            evaluation_times_ms=tuple(times),
            peak_memory_mb=None if peak is None else peak / 1e6, method=method,
            temp_memory_mb=None if temp is None else temp / 1e6, metadata={"method": method},
        )

    run.compiled = compiled  # type: ignore[attr-defined]
    return run


def benchmark(f: Callable[..., Any], *args: Any, kwargs: dict[str, Any] | None = None,
              mode: Mode = "forward", method: str | None = None,
              iterations: int = DEFAULT_ITERATIONS) -> BenchmarkData:
    """`standardize_function` + `compile_benchmark` + one run."""
    # The options first: `run` checks them too, but only after `f` is compiled.
    checks.require_int("benchmark", "iterations", iterations, minimum=1)
    method = device_timers.canonical_method(method)
    device_timers.check_method(method, device_timers.platform_of(jax.tree.leaves((args, kwargs))))
    f_std, arrays = standardize_function(f, *args, kwargs=kwargs, mode=mode)
    return compile_benchmark(f_std, arrays)(arrays, method=method, iterations=iterations)


def _google_benchmark() -> Any:
    """The `google_benchmark` module, or an `ImportError` naming the package to install."""
    try:
        import google_benchmark  # type: ignore[import-not-found]
    except ImportError as e:
        raise ImportError(
            "register_benchmark registers a Google Benchmark, which needs the "
            "google_benchmark package (`pip install google-benchmark`); it is not installed. "
            "benchmarking.benchmark(f, *args) times a function without it") from e
    return google_benchmark


def register_benchmark(name: str, impl_name: str, impl: Callable[..., Any],
                       kwargs: dict[str, Any] | Callable[[], dict[str, Any]] | None = None, *,
                       mode: Mode = "forward",
                       items_processed_fn: Callable[..., int] | None = None,
                       raise_on_error: bool = True, metadata: dict[str, Any] | None = None,
                       **run_kwargs: Any) -> None:
    """Registers `impl(**kwargs)` as the Google Benchmark `{name}_{mode}_{impl_name}`, as
    upstream Tokamax's `register_benchmark`: each run reports the median device time (the
    manual time) and a label with the min, max, spread and `metadata`.

    `kwargs` (or a function returning them, called when the benchmark runs) are `impl`'s
    arguments; `run_kwargs` go to the timer (`method=`, `iterations=`). A
    `NotImplementedError` skips the benchmark with its message; another error does too
    when `raise_on_error=False`. Needs the `google_benchmark` package (`ImportError`
    naming it otherwise).
    """
    google_benchmark = _google_benchmark()
    full_name = f"{name}_{mode}_{impl_name}"
    labels = dict(metadata or {})

    @google_benchmark.option.unit(google_benchmark.kMicrosecond)
    @google_benchmark.option.use_manual_time()
    @google_benchmark.option.iterations(1)
    def timed(state: Any) -> None:
        arguments = kwargs() if callable(kwargs) else dict(kwargs or {})
        f_std, arrays = standardize_function(impl, kwargs=arguments, mode=mode)
        try:
            data = compile_benchmark(f_std, arrays)(arrays, **run_kwargs)
        except Exception as e:
            if raise_on_error and not isinstance(e, NotImplementedError):
                raise RuntimeError(f"benchmark {full_name} failed") from e
            state.skip_with_error((str(e).strip().splitlines() or [type(e).__name__])[0])
            return
        times = data.evaluation_times_ms
        median = data.median_evaluation_time_ms
        label = (f"min={min(times):.3f}, max={max(times):.3f}, "
                 f"std/median={float(np.std(times)) / median:.3f}")
        shown = {**labels, **data.metadata}
        if shown:
            label += f", {shown}"
        while state:
            state.set_iteration_time(median / 1e3)
        state.set_label(label)
        if items_processed_fn is not None:
            state.items_processed = items_processed_fn(**arguments)

    google_benchmark.register(timed, name=full_name)


def get_benchmark_registrar(impls: dict[str, Callable[..., Any]]) -> Callable[..., None]:
    """`registrar(name, impl_name, kwargs, **options)`: `register_benchmark` for
    `impls[impl_name]`, as upstream Tokamax's. An op (it has `bind` and `replace`) is
    registered with the config it would run these arguments with pinned, and that config
    shown in the label (unless it is a `NullConfig`)."""

    def registrar(name: str, impl_name: str,
                  kwargs: dict[str, Any] | Callable[[], dict[str, Any]],
                  **options: Any) -> None:
        impl = impls[impl_name]
        metadata = None
        if hasattr(impl, "bind") and hasattr(impl, "replace"):
            arguments = kwargs() if callable(kwargs) else kwargs
            try:
                config = impl.bind(**arguments).default_config
            except NotImplementedError:
                pass
            else:
                impl = impl.replace(config=config)
                if not isinstance(config, NullConfig):
                    metadata = {"config": config}
        register_benchmark(name, impl_name, impl, kwargs, metadata=metadata, **options)

    return registrar
