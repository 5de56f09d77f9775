"""The calibration fit: sweep measurements in, a calibration file out.

Each timed row of our implementations becomes a point: the op (`prediction.op_name`:
the implementation for a forward row, its VJP op for a VJP row), the call's dtype, the
work the op performs there and its efficiency, the roofline time of that work over the
measured ceilings divided by the measured time. Before writing the file, the fit
predicts a held-out share of the calls from the rest and prints how close it came.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import pathlib
import random
import statistics
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import jax

from benchmarks import shapes, sweep
from tokamax_pass.core import atomic_io, options, prediction, registry, selection
from tokamax_pass.core import calibration as calibration_lib
from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.core.device import Target, device_kind_key, platform_of_kind
from tokamax_pass.core.op import CannotLowerHere
from tokamax_pass.core.roofline import Ceilings

PACKAGE_FOLDER = (pathlib.Path(__file__).parents[1] / "src" / "tokamax_pass" / "data" /
                  "calibration")
# A predicted-best implementation within this of the measured best counts as right.
RIGHT_WITHIN = 0.10


def read_rows(paths: Iterable[pathlib.Path]) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a killed run
    return rows


def measured_ceilings(rows: list[dict[str, Any]]) -> Ceilings:
    """The best rate each ceiling program reached, in TFLOP/s and TB/s."""
    best: dict[str, float] = {}
    for row in rows:
        if row.get("kind") == "ceiling" and "ms" in row:
            per_second = 1e3 / row["ms"]
            name = row["implementation"]
            rate = (row["params"]["bytes"] if name == "copy" else row["params"]["flops"]) \
                * per_second / 1e12
            best[name] = max(best.get(name, 0.0), rate)
    missing = {"matmul bfloat16", "matmul float32", "copy"} - set(best)
    if missing:
        raise ValueError(f"the results hold no measured ceilings {sorted(missing)}: run "
                         f"`python -m benchmarks.sweep run` on the device first")
    return Ceilings(best["matmul bfloat16"], best["matmul float32"], best["copy"])


def bound_call(row: dict[str, Any]) -> BoundArguments:
    """The op call a row timed: the implementation's forward call, or its VJP op's call
    (with the family's residuals, as the XLA reference returns them: a VJP op that reads
    them refuses a call without)."""
    family = row["family"]
    sweep.ours(family)  # registers the family
    implementation = registry.families()[family].implementations[row["implementation"]]()
    args, kwargs = shapes.build(family, row["params"])
    forward = implementation.bind(*args, **kwargs)
    if row["direction"] == "forward":
        return forward
    reference = registry.families()[family].implementations["xla"]()
    out, residuals = jax.eval_shape(
        lambda *a: reference(*a, return_residuals=True, **kwargs), *args)
    return implementation.vjp_op().bind(residuals, out, out, **forward.arguments)


def points(rows: list[dict[str, Any]], ceilings: Ceilings) -> list[calibration_lib.Point]:
    """A calibration point per timed row of ours whose op predicts work."""
    found = []
    for row in rows:
        if row.get("kind") != "ours" or "ms" not in row or row["ms"] <= 0:
            continue
        ba = bound_call(row)
        work, dtype = prediction.call_work(ba), prediction.call_dtype(ba)
        roofline = None if work is None or dtype is None else \
            ceilings.roofline_seconds(work, dtype)
        if roofline is None or work.flops <= 0 or work.bytes <= 0:
            continue
        efficiency = roofline / (row["ms"] * 1e-3)
        if efficiency > calibration_lib.MAX_EFFICIENCY:
            continue  # faster than the roofline allows: a timing fault, not data
        found.append(calibration_lib.Point(prediction.op_name(ba.op), dtype, work.flops,
                                           work.bytes, efficiency,
                                           prediction.call_features(ba)))
    return found


def _calibration(device_kind: str, ceilings: Ceilings,
                 found: list[calibration_lib.Point]) -> calibration_lib.Calibration:
    return calibration_lib.Calibration(device_kind, ceilings, tuple(found))


def _file_data(calibration: calibration_lib.Calibration) -> dict[str, Any]:
    """A calibration file's fields (all but its provenance)."""
    return {
        "schema": calibration_lib.SCHEMA, "version": calibration_lib.VERSION,
        "device_kind": calibration.device_kind, "ceilings": vars(calibration.ceilings),
        "points": [{**vars(p), "features": list(p.features)} for p in calibration.points],
    }


def _call_key(row: dict[str, Any]) -> str:
    return json.dumps([row["family"], row["params"]], sort_keys=True)


def rule_choice(family: str, params: dict[str, Any], direction: str,
                calibration: calibration_lib.Calibration) -> tuple[str, ...]:
    """The implementation `implementation=None` runs at a sweep call on the calibration's
    device with nothing measured (caches ignored): the rule itself, its margins and
    plain-JAX preference included, deciding from `calibration`'s predictions. Named by
    every implementation whose op (for a VJP, whose VJP op) it is, in the family's order:
    implementations may share their VJP op."""
    sweep.ours(family)  # registers the family
    target = Target(platform_of_kind(calibration.device_kind), calibration.device_kind)
    candidates: list[tuple[str, BoundArguments]] = []
    for name in registry.families()[family].automatic:
        ba = bound_call({"family": family, "params": params, "implementation": name,
                         "direction": direction})
        try:
            ba.op.check_supported(ba, target)
        except CannotLowerHere:
            pass  # the target runs it; only this machine cannot lower it
        except NotImplementedError:
            continue
        candidates.append((name, ba))
    unique = [ba for i, (_, ba) in enumerate(candidates)
              if all(ba.op != other.op for _, other in candidates[:i])]
    with tempfile.TemporaryDirectory() as folder, _calibration_folder(folder, calibration), \
            options.ignore_autotuning_cache(True):
        first = selection.rank_on_target(unique, target)[0]
    return tuple(name for name, ba in candidates if ba.op == first.op)


@contextlib.contextmanager
def _calibration_folder(folder: str, calibration: calibration_lib.Calibration
                        ) -> Iterator[None]:
    """Predictions read `calibration` while inside (written to `folder`)."""
    path = pathlib.Path(folder) / f"{device_kind_key(calibration.device_kind)}.json"
    path.write_text(json.dumps(_file_data(calibration)))
    saved = os.environ.get(calibration_lib.ENV_DIR)
    os.environ[calibration_lib.ENV_DIR] = folder
    try:
        yield
    finally:
        if saved is None:
            del os.environ[calibration_lib.ENV_DIR]
        else:
            os.environ[calibration_lib.ENV_DIR] = saved


def quality(rows: list[dict[str, Any]], ceilings: Ceilings, device_kind: str,
            holdout: float, seed: int) -> dict[str, Any]:
    """Fit on all calls but a held-out share; on those, the predicted-over-measured time
    ratios, how often the predicted-fastest implementation is within `RIGHT_WITHIN` of
    the measured fastest of ours (per call and direction), and how often what
    `implementation=None` runs there (`rule_choice`) is within `RIGHT_WITHIN` of the
    fastest measured implementation or peer, per family."""
    ours = [r for r in rows if r.get("kind") == "ours" and "ms" in r]
    calls = sorted({_call_key(r) for r in ours})
    held = set(random.Random(seed).sample(calls, max(1, int(len(calls) * holdout)))) \
        if calls else set()
    fitted = _calibration(device_kind, ceilings,
                          points([r for r in ours if _call_key(r) not in held], ceilings))
    ratios: list[float] = []
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for row in ours:
        if _call_key(row) not in held:
            continue
        predicted = prediction.predict(bound_call(row), fitted)
        if predicted is None:
            continue
        measured = row["ms"] * 1e-3
        ratios.append(predicted.seconds / measured)
        groups.setdefault((_call_key(row), row["direction"]), []).append(
            (predicted.seconds, measured))
    compared = [g for g in groups.values() if len(g) > 1]
    right = sum(min(g)[1] <= min(m for _, m in g) * (1 + RIGHT_WITHIN) for g in compared)
    logs = sorted(abs(math.log(r)) for r in ratios)
    return {
        "held_out_calls": len(held), "predicted_rows": len(ratios),
        "median_ratio": statistics.median(ratios) if ratios else None,
        "median_abs_log_ratio": statistics.median(logs) if logs else None,
        "p90_abs_log_ratio": logs[int(0.9 * (len(logs) - 1))] if logs else None,
        "compared_choices": len(compared),
        "best_within_10pct": right / len(compared) if compared else None,
        "rule": _rule_quality([r for r in rows if _call_key(r) in held], fitted),
    }


def _rule_quality(rows: list[dict[str, Any]],
                  calibration: calibration_lib.Calibration) -> dict[str, Any]:
    """Per family and direction (`"layer_norm vjp"`), at the rows' calls: how many
    `rule_choice` ran within `RIGHT_WITHIN` of the fastest row (implementation or peer),
    how many it chose an implementation that failed there (an error row: counted among
    the calls, not within), and the worst ratio of those that ran. A choice the rows
    never tried is left out. The sweep times each VJP op alone, so an XLA gradient that
    reruns its forward's products (`Op.reruns_forward`), which XLA merges with the
    forward's inside a training step, is timed whole here: a VJP miss of the plain path
    can be none in a model (the generalization benchmark times both)."""
    timed: dict[tuple[str, str], dict[str, float]] = {}
    for row in rows:
        if row.get("kind") in ("ours", "peer"):
            timed.setdefault((_call_key(row), row["direction"]), {})[row["implementation"]] = \
                row.get("ms", math.inf)
    report: dict[str, dict[str, Any]] = {}
    for (key, direction), times in sorted(timed.items()):
        family, params = json.loads(key)
        tried = [times[name] for name in rule_choice(family, params, direction, calibration)
                 if name in times]
        fastest = min(times.values())
        if not tried or math.isinf(fastest):
            continue
        entry = report.setdefault(f"{family} {direction}", {
            "calls": 0, "within": 0, "failed": 0, "worst_ratio": 1.0})
        entry["calls"] += 1
        if math.isinf(min(tried)):
            entry["failed"] += 1
            continue
        ratio = min(tried) / fastest
        entry["within"] += ratio <= 1 + RIGHT_WITHIN
        entry["worst_ratio"] = max(entry["worst_ratio"], ratio)
    return report


def fit(results: list[pathlib.Path], out: pathlib.Path | None, *, holdout: float = 0.2,
        seed: int = 0) -> int:
    """Writes the calibration of the results' device to `out` (default: the package's
    file for that device kind) and prints the fit's quality on held-out calls."""
    rows = read_rows(results)
    kinds = {r["device_kind"] for r in rows if "device_kind" in r}
    if len(kinds) != 1:
        raise ValueError(f"the results must come from one device kind, got {sorted(kinds)}")
    (device_kind,) = kinds
    ceilings = measured_ceilings(rows)
    report = quality(rows, ceilings, device_kind, holdout, seed)
    print(json.dumps({"ceilings": vars(ceilings), "held_out": report}, indent=1))
    found = points(rows, ceilings)
    data = {
        **_file_data(_calibration(device_kind, ceilings, found)),
        "provenance": {"commit": sweep.source_commit(), "jax": jax.__version__,
                       "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")},
    }
    text = json.dumps(data, indent=0)
    calibration_lib.parse(text)  # the file must load as it will be read
    out = out or PACKAGE_FOLDER / f"{device_kind_key(device_kind)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_io.write_atomic(out, text + "\n")
    print(f"wrote {len(found)} points to {out}")
    return 0
