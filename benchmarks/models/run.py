"""Times one training step of each model for every variant, or checks them on CPU.

Variants: `plain` (plain JAX), `ours` (our ops, `implementation=None`, under `jax.jit`),
`optimize` (`tokamax_pass.optimize`), `tuned` (after `autotune(..., all_implementations=True,
ignore_cache=True)`, its wall time recorded), and `upstream` (the Tokamax wheel, where
installed). Device time (CUPTI on a GPU), median of `--iterations` runs after warm-up;
every variant of a model in one process, its ratio to plain JAX beside it. Results go to
`benchmarks/results/<device_kind>/NAME.json` (and `.png`; `--name`, by default `models_`
and the models run, with the `--set` fields), replacing the benchmark's previous run,
written after every number so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import tokamax_pass as tokamax
from benchmarks.models import MODELS, Model, blocks, ops
from benchmarks.sweep import source_commit
from tokamax_pass import benchmarking
from tokamax_pass.autotuning import cache
from tokamax_pass.core.device import device_kind_key

RESULTS = pathlib.Path(__file__).parent.parent / "results"
VARIANTS = ("plain", "ours", "optimize", "rewrite", "tuned", "upstream")
# Smoke tolerance by the model's dtype: the relative norm of the difference, per gradient
# leaf and for the loss, of two programs whose roundings differ in place (about 1.5x the
# worst difference seen at bfloat16, 2.5x at float16, 10x at float32).
SMOKE_TOLERANCE = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 1e-5}


def _inputs(model: Model, smoke: bool) -> tuple[Any, Any]:
    config = model.sized(smoke)
    return (model.init(jax.random.key(0), config),
            model.make_batch(jax.random.key(1), config))


def _relative(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (scale if scale > 0 else 1.0))


def in_dtype(model: Model, dtype: str) -> Model:
    """`model` with both its configs in `dtype` (one of `blocks.DTYPES`)."""
    return dataclasses.replace(model, config=dataclasses.replace(model.config, dtype=dtype),
                               smoke_config=dataclasses.replace(model.smoke_config,
                                                                dtype=dtype))


def smoke(names: list[str], models: dict[str, Model] | None = None,
          dtypes: Sequence[str] | None = None) -> list[str]:
    """Runs each model tiny on this machine; our loss and gradients must match plain JAX's
    (within `SMOKE_TOLERANCE` of the dtype; with `discrete_routing`, the gradients in
    float32 only).

    `models` replaces the suite's (the same names at other tiny sizes); `dtypes` runs each
    model in each of them (default: the model's own). Returns the failures (empty when
    all match).
    """
    variants = ops.variants()
    failures = []
    for name, dtype_name in itertools.product(names, dtypes or [None]):
        model = (models or MODELS)[name]
        model = model if dtype_name is None else in_dtype(model, dtype_name)
        dtype = model.smoke_config.dtype
        params, batch = _inputs(model, smoke=True)
        outputs = {}
        for variant in ("plain", "ours"):
            step = jax.jit(jax.value_and_grad(model.loss_fn(variants[variant], smoke=True)))
            outputs[variant] = step(params, batch)
        (loss_plain, grad_plain), (loss_ours, grad_ours) = outputs["plain"], outputs["ours"]
        errors = {"loss": _relative(loss_ours, loss_plain)}
        for (path, g_ours), g_plain in zip(jax.tree_util.tree_leaves_with_path(grad_ours),
                                           jax.tree.leaves(grad_plain), strict=True):
            if dtype == "float32" or not model.discrete_routing:
                errors[jax.tree_util.keystr(path)] = _relative(g_ours, g_plain)
        worst = max(errors, key=errors.get)
        finite = all(math.isfinite(e) for e in errors.values())
        ok = finite and errors[worst] <= SMOKE_TOLERANCE[dtype]
        what = "worst difference" if len(errors) > 1 else "difference (gradients: float32)"
        print(f"{name} {dtype}: loss {float(loss_plain):.4f} (plain) vs "
              f"{float(loss_ours):.4f} (ours); {what} "
              f"{errors[worst]:.2e} at {worst}: {'ok' if ok else 'MISMATCH'}", flush=True)
        if not ok:
            failures.append(f"{name} {dtype}: {worst} differs by {errors[worst]:.2e}")
    return failures


def _device_ms(step: Any, params: Any, batch: Any, iterations: int) -> dict[str, Any]:
    """The step's median device time, compile time, timing method and its compiled
    program's temporary memory (beyond inputs and outputs, XLA's memory analysis)."""
    data = benchmarking.benchmark(step, params, batch, iterations=iterations)
    return {"ms": data.median_evaluation_time_ms, "compile_s": data.compile_time_ms / 1e3,
            "method": data.method, "temp_memory_mb": data.temp_memory_mb}


def time_model(model: Model, variants: list[str], iterations: int, record: Any, *,
               tuned_dir: str | None = None, ship_dir: str | None = None,
               tiny: bool = False) -> None:
    """Times each variant's step (a training step, or the forward of a `forward_only`
    model), in the order given; `record(key, value)` stores each number.

    `tuned_dir`: where the `tuned` variant's autotuning result is dumped
    (`<model>_tuned.json`). `ship_dir`: a `data/autotuning` folder the tuned result is
    also written to as library-cache files, so the variants timed after `tuned` run
    with the cache that ships. `tiny`: the smoke sizes.
    """
    switch = ops.variants(upstream="upstream" in variants)
    params, batch = _inputs(model, smoke=tiny)
    step_of = {name: model.step_fn(lib, smoke=tiny) for name, lib in switch.items()}
    steps = {"plain": lambda: jax.jit(step_of["plain"]),
             "ours": lambda: jax.jit(step_of["ours"]),
             "optimize": lambda: tokamax.optimize(step_of["ours"]),
             # The plain twin, unmodified, through the pass: its patterns become our ops.
             "rewrite": lambda: tokamax.optimize(step_of["plain"])}
    if "upstream" in switch:
        steps["upstream"] = lambda: jax.jit(step_of["upstream"])
    for variant in variants:
        try:
            if variant == "tuned":
                _time_tuned(model, step_of["ours"], params, batch, iterations, record, tuned_dir,
                            ship_dir)
            elif variant not in steps:
                record(variant, {"skipped": "not importable (stderr says why)"})
            else:
                record(variant, _device_ms(steps[variant](), params, batch, iterations))
            if variant == "optimize":
                record("optimize_plan", str(tokamax.optimize(step_of["ours"]).plan(params, batch)))
            if variant == "rewrite":
                matches = tokamax.optimize(step_of["plain"]).plan(params, batch).matches
                record("rewrite_matches", [f"{m.pattern} {m.path}: "
                                           f"{dict(m.implementation) or m.reason}"
                                           for m in matches])
        except Exception as e:  # noqa: BLE001 - a failing variant is a result
            traceback.print_exc()
            record(variant, {"error": f"{type(e).__name__}: {str(e)[:300]}"})


def _time_tuned(model: Model, step: Any, params: Any, batch: Any, iterations: int,
                record: Any, tuned_dir: str | None, ship_dir: str | None) -> None:
    """`autotune(..., all_implementations=True)` from an empty user cache (its wall time
    recorded), then the step under the result."""
    with tempfile.TemporaryDirectory() as empty:
        previous = os.environ.get(cache.ENV_CACHE_DIR)
        os.environ[cache.ENV_CACHE_DIR] = empty
        try:
            start = time.perf_counter()
            result = tokamax.autotune(step, params, batch, all_implementations=True,
                                      ignore_cache=True, progress=False)
            record("autotune_s", time.perf_counter() - start)
            record("autotune_op_calls", len(result))
            if tuned_dir:
                path = pathlib.Path(tuned_dir) / f"{model.name}_tuned.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                result.dump(path)
            if ship_dir:
                cache.write_library_cache(result.without_errors(), ship_dir)
            with result:
                record("tuned", _device_ms(jax.jit(step), params, batch, iterations))
            record("tuned_plan_changes", plan_changes(step, params, batch, result))
            record("tuned_alternated", alternated(step, params, batch, result, iterations))
        finally:
            if previous is None:
                os.environ.pop(cache.ENV_CACHE_DIR, None)
            else:
                os.environ[cache.ENV_CACHE_DIR] = previous


ALTERNATED_ROUNDS = 4


def alternated(step: Any, params: Any, batch: Any, result: Any, iterations: int,
               rounds: int = ALTERNATED_ROUNDS) -> dict[str, Any]:
    """The step untuned and under `result`, timed in alternating rounds (each round a
    median of `iterations`), and untuned's median over tuned's (above 1: tuning won).

    The `tuned` variant alone is timed once, right after the tuning's device work, which
    leaves the device in another state than the untuned run found it: even two identical
    programs differ that way. Alternating takes the order out of the comparison, and each
    round swaps which goes first (untuned, tuned; tuned, untuned; ...): times drift within
    a process, so the one always first would look faster. Over an even number of rounds a
    steady drift cancels."""
    untuned = _runner(jax.jit(step), params, batch)
    with result:
        tuned = _runner(jax.jit(step), params, batch)
    times: dict[str, list[float]] = {"untuned_ms": [], "tuned_ms": []}
    runners = [("untuned_ms", untuned), ("tuned_ms", tuned)]
    for round_ in range(rounds):
        for key, runner in runners if round_ % 2 == 0 else runners[::-1]:
            times[key].append(runner(iterations))
    return {**times, "tuned_speedup": (statistics.median(times["untuned_ms"])
                                       / statistics.median(times["tuned_ms"]))}


def _runner(step: Any, params: Any, batch: Any) -> Any:
    """`step` compiled once for `(params, batch)`: a function of `iterations` giving its
    median device ms."""
    f_std, arrays = benchmarking.standardize_function(step, params, batch)
    compiled = benchmarking.compile_benchmark(f_std, arrays)
    return lambda iterations: compiled(arrays, iterations=iterations).median_evaluation_time_ms


def plan_changes(step: Any, params: Any, batch: Any, result: Any) -> list[str]:
    """The op calls whose implementation or config `result` changes from what `None`
    runs untuned (one line each, a call repeated across layers once). Empty when the tuned
    program runs the untuned program's kernels and configs: a time difference between the
    two is then run-to-run variance, not tuning."""
    untuned = tokamax.optimize(step).plan(params, batch)
    tuned = tokamax.optimize(step, results=result).plan(params, batch)
    changes = {}
    for before, after in zip(untuned, tuned, strict=True):
        if (before.implementation, before.config) != (after.implementation, after.config):
            line = (f"{before.path} {before.arguments}: {before.implementation} "
                    f"{before.config} -> {after.implementation} {after.config}")
            changes[line] = None
    return list(changes)


def resized(model: Model, overrides: list[str], error: Any) -> Model:
    """`model` with `FIELD=VALUE` overrides of its benchmark config, each value parsed as
    the field's current value's type (`None` allowed; `dtype=float16` a string the config
    checks); `error(message)` on a bad one."""
    changes: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(model.config)}
    for item in overrides:
        field, sep, text = item.partition("=")
        if not sep or field not in fields:
            error(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        current = getattr(model.config, field)
        if text == "None":
            changes[field] = None
            continue
        kind = float if current is None else type(current)
        try:
            changes[field] = kind(text)
        except ValueError:
            error(f"--set {item!r}: {field} takes a {kind.__name__}")
    try:
        return dataclasses.replace(model, config=dataclasses.replace(model.config, **changes))
    except ValueError as e:
        error(f"--set {' '.join(overrides)}: {e}")
        raise


def _chart(results: dict[str, Any], path: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(results["models"])
    fig, ax = plt.subplots(figsize=(2 + 2.2 * len(names), 4))
    width = 0.8 / len(VARIANTS)
    for j, variant in enumerate(VARIANTS):
        speedups = []
        for name in names:
            row = results["models"][name]
            plain, this = row.get("plain", {}).get("ms"), row.get(variant, {}).get("ms")
            speedups.append(plain / this if plain and this else 0.0)
        ax.bar([i + j * width for i in range(len(names))], speedups, width, label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("training step speed vs plain JAX (x)")
    ax.set_title(f"Model suite, {results['device_kind']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _summary(results: dict[str, Any]) -> str:
    lines = [f"{'model':10s} " + " ".join(f"{v:>16s}" for v in VARIANTS)]
    for name, row in results["models"].items():
        plain = row.get("plain", {}).get("ms")
        cells = []
        for variant in VARIANTS:
            ms = row.get(variant, {}).get("ms")
            cells.append(f"{ms:8.2f} ({plain / ms:4.2f}x)" if ms and plain else f"{'-':>16s}")
        lines.append(f"{name:10s} " + " ".join(cells))
    return "\n".join(lines)


def benchmark_name(names: Sequence[str], overrides: Sequence[str]) -> str:
    """The default name of a run's results: `models_` and the models, then each `--set`
    field and value (`["llama"], ["width=4096"]` -> `models_llama_width4096`), so a resized
    run never replaces the suite's."""
    words = [*names, *(item.replace("=", "") for item in overrides)]
    return "_".join(["models", *(re.sub(r"[^A-Za-z0-9_]+", "", w) for w in words)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.models",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS), help="models to run")
    parser.add_argument("--list", action="store_true", help="print the model names and exit")
    parser.add_argument("--smoke", action="store_true",
                        help="run every model tiny here and check ours against plain JAX, in "
                        "each of --dtypes (--set resizes the tiny configs)")
    parser.add_argument("--dtypes", default=",".join(blocks.DTYPES),
                        help="--smoke: the dtypes to check each model in (over a --set dtype)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--name", help="the benchmark's name: results/<device>/NAME.json and "
                        ".png, replaced when re-run (default: `models_` and the models run, with "
                        "the --set fields)")
    parser.add_argument("--output", help="results JSON (default: from --name)")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="override config fields of every model run (`width=4096 "
                        "mlp=14336`, `dtype=float16`): the same models at sizes and dtypes "
                        "the suite does not hold")
    parser.add_argument("--tiny", action="store_true",
                        help="time the smoke sizes (to check the timing path on any machine)")
    parser.add_argument("--ship-tuned", metavar="DIR",
                        help="also write each `tuned` result into this data/autotuning "
                        "folder (the package's: variants after `tuned` then use it)")
    parser.add_argument("--tuned-dir", metavar="DIR",
                        help="dump each model's `tuned` autotuning result here "
                        "(`python -m benchmarks.tune_library_cache --merge` ships them)")
    args = parser.parse_args(argv)
    names = args.only or list(MODELS)
    if args.list:
        for name in MODELS:
            print(f"{name}: {MODELS[name].description}")
        return 0
    if args.smoke:
        dtypes = [d for d in args.dtypes.split(",") if d]
        if set(dtypes) - set(blocks.DTYPES):
            parser.error(f"--dtypes {args.dtypes}: choose from {blocks.DTYPES}")
        tiny = {name: dataclasses.replace(MODELS[name], smoke_config=resized(
            dataclasses.replace(MODELS[name], config=MODELS[name].smoke_config), args.set,
            parser.error).config) for name in names}
        failures = smoke(names, tiny, dtypes)
        for failure in failures:
            print(f"FAILED {failure}", file=sys.stderr)
        return 1 if failures else 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    device_kind = jax.devices()[0].device_kind
    output = pathlib.Path(args.output) if args.output else (
        RESULTS / device_kind_key(device_kind)
        / f"{args.name or benchmark_name(names, args.set)}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "provenance": {"commit": source_commit()}, "device_kind": device_kind,
        "jax": jax.__version__, "date": datetime.date.today().isoformat(),
        "iterations": args.iterations,
        "timer": "device time (CUPTI on a GPU), median after warm-up", "models": {}}
    models = {name: resized(MODELS[name], args.set, parser.error) for name in names}
    for name, model in models.items():
        row: dict[str, Any] = {"description": model.description, "config": repr(model.config)}
        results["models"][name] = row

        def record(key: str, value: Any, row: dict[str, Any] = row, name: str = name) -> None:
            row[key] = value
            _ratios_to_plain(row)
            shown = value if not isinstance(value, str) else value[:2000]
            print(f"{name} {key}: {shown}", flush=True)
            output.write_text(json.dumps(results, indent=1, default=str))

        time_model(model, variants, args.iterations, record, tuned_dir=args.tuned_dir,
                   ship_dir=args.ship_tuned, tiny=args.tiny)
        jax.clear_caches()
    _chart(results, output.with_suffix(".png"))
    print(_summary(results))
    return 0


def _ratios_to_plain(row: dict[str, Any]) -> None:
    """Each timed variant's `vs_plain` (plain's time over its own), whichever order the
    variants ran in: a variant timed before plain gets its ratio when plain's comes."""
    plain = row.get("plain", {}).get("ms") if isinstance(row.get("plain"), dict) else None
    for value in row.values():
        if isinstance(value, dict) and "ms" in value and plain:
            value["vs_plain"] = plain / value["ms"]


if __name__ == "__main__":
    sys.exit(main())
