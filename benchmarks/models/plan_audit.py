"""Audits what `implementation=None` picks on the H200 at model sizes nobody benchmarked.

    python -m benchmarks.models.plan_audit [--only NAME ...] [--limit N] [--output FILE]
        [--dtypes bfloat16 float16 float32]

Every model of the suite is resized over a grid (widths, head dims, GQA ratios, sequence
lengths, batches; two layers) in each dtype (bfloat16, the suite's: every grid point;
float16 and float32: the one-at-a-time points and a smaller sample, `SAMPLED`) and its
training step planned for an H200 from this CPU machine (`core.targeting` +
`optimize(...).plan`: trace only, nothing compiled). For each op call the audit prints
the implementation chosen and the measurement that justifies it, found here
independently of the lookup the library runs: the exact call measured in a cache layer,
or a neighbouring measured shape of the same similarity category
(`autotuning.keys.similarity`: the same op, static arguments, dtypes, ranks and head dim)
whose every size is within `neighbours.MAX_RATIO` of the call's (or `FAR_RATIO` where the
kernel won by `DOMINANT_WIN`), where the chosen kernel beat every plain-JAX candidate (but
one that a device sweep showed slower than another, XLA's attention than cuDNN's). A
kernel (an implementation that does not `runs_without_evidence`) chosen without such a
measurement is flagged; so is a configuration that fails to plan. A measurement lends
only to calls in its own dtypes, so the library cache's bfloat16 timings justify no
kernel at float16 or float32. A lookup made blind to dtypes on purpose is flagged
(tests/passes/test_plan_audit.py). `--export-from-cpu` plans as `tokamax-pass export` does
on this machine, where cuDNN cannot be lowered (`CannotLowerHere`): a kernel is then
justified by beating the plain paths lowered here, or cuDNN's measurement on the target,
or by standing in for the plain path the target itself runs, cuDNN's attention (the
export's documented fallback, `Choice.fallback_from`, which its manifest lists).

Output: one JSON line per distinct op call per configuration (its `dtype` named), and a
summary, overall and per dtype. `--smoke` instead runs the suite's CPU smoke check (ours
against plain JAX, loss and gradients, within the dtype's tolerance) at tiny sizes it
does not hold (`SMOKE_SIZES`: odd sequence lengths and head dims), in each of `--dtypes`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import pathlib
import random
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax

import tokamax_pass as tokamax
from benchmarks.models import MODELS, Model, blocks, ops, run
from tokamax_pass import core
from tokamax_pass.autotuning import cache, keys, neighbours
from tokamax_pass.core import selection, spec
from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.core.op import CannotLowerHere
from tokamax_pass.passes.plan import PlanRow

DEVICE_KIND = "NVIDIA H200"
WIDTHS = (1024, 3072, 4096)
HEAD_DIMS = (64, 80, 96, 128, 256)
GROUPS = (1, 2, 4, 8)
SEQS = (1024, 2048, 3000, 8192)
BATCHES = (1, 2, 8)
DTYPES = blocks.DTYPES
# Configurations per model and dtype drawn from the full product, beside the one-at-a-time
# ones: the suite's bfloat16 most, the others enough to keep the audit under a minute.
SAMPLED = {"bfloat16": 24, "float16": 6, "float32": 6}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One grid point: the model fields it overrides."""

    width: int
    head_dim: int
    group: int
    seq: int
    batch: int
    dtype: str = "bfloat16"

    def overrides(self, model: Model) -> list[str]:
        """`FIELD=VALUE` overrides for `run.resized`: heads as many as fit the width, a
        multiple of the GQA group (which only decoders have); only the fields the model's
        config has (the LM head model has no layers, heads or MLP)."""
        decoder = hasattr(model.config, "kv_heads")
        group = self.group if decoder else 1
        heads = max(group, (self.width // self.head_dim) // group * group)
        found = ["layers=2", f"width={self.width}", f"head_dim={self.head_dim}",
                 f"heads={heads}", f"seq={self.seq}", f"batch={self.batch}",
                 f"dtype={self.dtype}"]
        if decoder:
            found.append(f"kv_heads={heads // group}")
            found.append(f"mlp={self.width * 8 // 3 // 128 * 128}")
        else:
            found.append(f"mlp={self.width * 4}")
        fields = {f.name for f in dataclasses.fields(model.config)}
        return [o for o in found if o.partition("=")[0] in fields]


def grid(limit: int | None = None, seed: int = 0,
         dtypes: Sequence[str] = DTYPES) -> list[Shape]:
    """For each dtype: one-at-a-time variations around a base, then a fixed sample of the
    full product (`SAMPLED[dtype]` points, each dtype its own); `limit` per dtype."""
    shapes = []
    for i, dtype in enumerate(dtypes):
        base = Shape(3072, 128, 4, 3000, 2, dtype)
        found = [base]
        for field, values in (("width", WIDTHS), ("head_dim", HEAD_DIMS), ("group", GROUPS),
                              ("seq", SEQS), ("batch", BATCHES)):
            found += [dataclasses.replace(base, **{field: v}) for v in values]
        product = [Shape(*p, dtype) for p in
                   itertools.product(WIDTHS, HEAD_DIMS, GROUPS, SEQS, BATCHES)]
        found += random.Random(seed + i).sample(product, SAMPLED[dtype])
        unique = list(dict.fromkeys(found))
        shapes += unique[:limit] if limit else unique
    return shapes


# --- evidence, found independently of `neighbours.nearest_times` ---------------------

@dataclasses.dataclass(frozen=True)
class _Measured:
    """A cache layer's fresh entries: by exact key, and by similarity category."""

    label: str
    exact: dict[tuple[str, str], float]
    by_category: dict[str, dict[tuple[int, ...], tuple[float, BoundArguments]]]


_MEASURED: dict[tuple[str, int], _Measured] = {}


def _measured(layer: cache.Layer) -> _Measured:
    key = (layer.label, id(layer.result))
    if key not in _MEASURED:
        exact: dict[tuple[str, str], float] = {}
        by_category: dict[str, dict[tuple[int, ...], tuple[float, BoundArguments]]] = {}
        for entry in layer.result.entries:
            if layer.label != "autotuning result" and keys.stale_reason(
                    entry.bound.op, entry.provenance) is not None:
                continue
            exact[entry.key] = entry.best_time_ms
            try:
                category, sizes = keys.similarity(entry.bound)
            except Exception:  # noqa: BLE001 - such an entry lends nothing
                continue
            by_category.setdefault(category, {})[sizes] = (entry.best_time_ms, entry.bound)
        _MEASURED[key] = _Measured(layer.label, exact, by_category)
    return _MEASURED[key]


def _ratio(a: Sequence[int], b: Sequence[int]) -> float:
    """The largest size ratio between two shapes of one category (`inf` on a rank change)."""
    if len(a) != len(b):
        return math.inf
    worst = 1.0
    for x, y in zip(a, b, strict=True):
        if x != y:
            worst = max(worst, math.inf if min(x, y) <= 0 else max(x, y) / min(x, y))
    return worst


def structure(ba: BoundArguments) -> Any:
    """What a neighbour must share with a call, whatever the op's `similarity_arguments`
    say: every array's dtype and rank, an attention call's head dim, which optional
    arguments are present, and every static argument other than a number (`is_causal`,
    `subtract_mean`, an activation); numbers may differ (sizes, an epsilon, a soft cap),
    and so may an attention window's reach (`None` reaches the whole key sequence, as a
    window that long does: the attention family compares the reach as a size)."""

    def strip(value: Any) -> Any:
        if spec.is_array(value):
            return (jax.numpy.dtype(value.dtype).name, len(value.shape))
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, (int, float)):
            return "number"
        if isinstance(value, (tuple, list)):
            return tuple(strip(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, strip(v)) for k, v in sorted(value.items()))
        return spec.dumps(spec.encode(value))

    found = {name: "reach" if name == "local_window_size" else strip(value)
             for name, value in ba.arguments.items()}
    query = ba.arguments.get("query")
    if spec.is_array(query):
        found["head_dim"] = int(query.shape[-1])
    return keys.op_key(ba.op), tuple(sorted(found.items())), tuple(level.axes for level in ba.vmap)


def _exact_times(ba: BoundArguments, stack: Sequence[_Measured]) -> tuple[float, str] | None:
    key = keys.entry_key(ba)
    for measured in stack:
        if key in measured.exact:
            return measured.exact[key], measured.label
    return None


def _slot_evidence(kernel: BoundArguments, plain: Sequence[BoundArguments],
                   stack: Sequence[_Measured]) -> dict[str, Any] | None:
    """What shows `kernel` beating every plain candidate on one evidence slot: an exact
    measurement, else the nearest acceptable neighbour; `None` when nothing does."""
    exact = [_exact_times(ba, stack) for ba in (kernel, *plain)]
    if all(e is not None for e in exact):
        mine, others = exact[0][0], [e[0] for e in exact[1:]]
        if mine < min(others):
            return {"kind": "exact", "layer": exact[0][1], "kernel_ms": mine,
                    "plain_ms": min(others)}
        return None
    keyed = [keys.similarity(ba) for ba in (kernel, *plain)]
    found: list[dict[tuple[int, ...], float]] = []
    for (category, _), call in zip(keyed, (kernel, *plain), strict=True):
        times: dict[tuple[int, ...], float] = {}
        for measured in stack:
            for sizes, (t, bound) in measured.by_category.get(category, {}).items():
                if structure(bound) == structure(call):
                    times.setdefault(sizes, t)
        found.append(times)
    best = None
    for sizes in set.intersection(*(set(f) for f in found)):
        mine, others = found[0][sizes], min(f[sizes] for f in found[1:])
        ratio = max(_ratio(k[1], sizes) for k in keyed)
        near = ratio <= neighbours.MAX_RATIO and mine < others
        far = ratio <= neighbours.FAR_RATIO and mine * neighbours.DOMINANT_WIN <= others
        if (near or far) and (best is None or ratio < best["ratio"]):
            best = {"kind": "neighbour" if near else "far neighbour", "ratio": ratio,
                    "sizes": list(sizes), "call_sizes": list(keyed[0][1]),
                    "kernel_ms": mine, "plain_ms": others}
    return best


def evidence(decision: Any) -> dict[str, Any]:
    """Why `decision`'s implementation may run: `{"kind": "plain path" | "explicit" |
    "stands in" | "exact" | "neighbour" | "far neighbour" | "none", ...}` ("stands in": for
    the plain path the target runs, which this machine cannot lower)."""
    op = decision.choice.op
    if op.runs_without_evidence:
        return {"kind": "plain path"}
    if decision.choice.fallback_from is not None:
        return {"kind": "stands in", "for": decision.choice.fallback_from}
    if not decision.alternatives:
        return {"kind": "explicit"}
    target = decision.target
    supported, unlowerable = [], []
    for ba in decision.alternatives:
        try:
            ba.op.check_supported(ba, target)
        except CannotLowerHere:
            unlowerable.append(ba)
            continue
        except NotImplementedError:
            continue
        supported.append(ba)
    chosen_key = keys.op_key(op)
    kernel = next((ba for ba in supported if keys.op_key(ba.op) == chosen_key), None)
    plain = [ba for ba in supported if ba.op.runs_without_evidence]
    if kernel is None or not plain:
        return {"kind": "none", "why": "the chosen kernel or every plain path is unsupported"}
    stack = [_measured(layer) for layer in cache.layers(target.device_kind)]
    found = _kernel_evidence(kernel, plain, stack)
    bounds = [ba for ba in unlowerable if ba.op.runs_without_evidence]
    if found is None and bounds:
        # A plain path this machine cannot lower (cuDNN, exporting from a CPU) still
        # stands for those that yield to it: beating it on the target beats them.
        found = _kernel_evidence(kernel, [*plain, *bounds], stack)
    return found or {"kind": "none", "why": "no measurement at this shape or a neighbour "
                     "shows the kernel beating the plain-JAX paths"}


def _kernel_evidence(kernel: BoundArguments, plain: Sequence[BoundArguments],
                     stack: Sequence[_Measured]) -> dict[str, Any] | None:
    """The measurements, slot by slot, that show `kernel` beating every plain path of
    `plain` but those that yield to another of them; `None` when a slot has none."""
    # A plain path known slower than another (`Op.yields_unmeasured_to`, fitted to a device
    # sweep) need not be beaten separately: the other stands for it.
    plain = [ba for i, ba in enumerate(plain)
             if not selection.yields(plain, i, range(len(plain)))]
    slots = [ba.op.evidence_calls(ba) or [ba] for ba in (kernel, *plain)]
    if len({len(s) for s in slots}) != 1:
        slots = [[ba] for ba in (kernel, *plain)]
    found = []
    for calls in zip(*slots, strict=True):
        slot = _slot_evidence(calls[0], calls[1:], stack)
        if slot is None:
            return None
        found.append(slot)
    kinds = [s["kind"] for s in found]
    worst = max(kinds, key=["exact", "neighbour", "far neighbour"].index)
    return {"kind": worst, "slots": found}


# --- the audit ----------------------------------------------------------------------

def _decisions(model: Model) -> list[Any]:
    """The step's decisions for the H200 (`Optimized._trace`: the plan's rows with each
    call's candidates kept), from shapes only."""
    params, batch = jax.eval_shape(lambda: run._inputs(model, smoke=False))
    step = model.step_fn(ops.variants()["ours"], smoke=False)
    with core.targeting(DEVICE_KIND):
        decisions, _ = tokamax.optimize(step)._trace((params, batch), {}, platforms=None)
        return decisions


def audit_model(name: str, overrides: list[str]) -> Iterator[dict[str, Any]]:
    """One row per distinct op call of `name` resized by `overrides` (or one error row)."""
    fields = dict(o.partition("=")[::2] for o in overrides)
    base = {"model": name, "dtype": fields.get("dtype", MODELS[name].config.dtype),
            "overrides": overrides}

    try:
        model = run.resized(MODELS[name], overrides, _raise)
        decisions = _decisions(model)
    except Exception as e:  # noqa: BLE001 - a configuration that fails is a finding
        yield {**base, "error": f"{type(e).__name__}: {str(e)[:500]}", "flagged": True}
        return
    seen: dict[tuple[str, str, str], dict[str, Any]] = {}
    for decision in decisions:
        row = PlanRow.from_decision(decision)
        key = (row.path, row.arguments, row.implementation)
        if key in seen:
            seen[key]["count"] += 1
            continue
        found = evidence(decision)
        seen[key] = {**base, "path": row.path, "arguments": row.arguments,
                     "implementation": row.implementation, "op": row.op,
                     "config": row.config, "config_source": row.source, "evidence": found,
                     "flagged": found["kind"] == "none", "count": 1}
    yield from seen.values()


@contextlib.contextmanager
def _cudnn_assumed() -> Iterator[None]:
    """cuDNN taken as installed, as on the H200, while planning from this machine (its
    library check would otherwise drop the cuDNN attention, a plain-JAX path there)."""
    from tokamax_kernels.attention import cudnn

    original = cudnn._require_cudnn_library
    cudnn._require_cudnn_library = lambda: None
    try:
        yield
    finally:
        cudnn._require_cudnn_library = original


def audit(names: Iterable[str], shapes: Sequence[Shape],
          cudnn: bool = True) -> Iterator[dict[str, Any]]:
    """`audit_model` rows for every model in `names` at every grid point; `cudnn=False`
    plans as an export from this CPU machine for the H200 does (`tokamax-pass export`),
    where cuDNN cannot be lowered."""
    with _cudnn_assumed() if cudnn else contextlib.nullcontext():
        for name in names:
            for shape in shapes:
                yield from audit_model(name, shape.overrides(MODELS[name]))


# Tiny sizes the smoke check does not hold: odd sequence lengths and head dims, other
# GQA groups and batches (decoder fields; the encoder takes those it has).
SMOKE_SIZES: tuple[tuple[str, ...], ...] = (
    ("seq=37", "head_dim=24", "heads=6", "kv_heads=2", "batch=1"),
    ("seq=50", "head_dim=40", "heads=3", "kv_heads=3", "batch=3", "width=96"),
    ("seq=129", "head_dim=8", "heads=8", "kv_heads=1", "mlp=40"),
)


def smoke_unseen(names: Iterable[str], sizes: Sequence[Sequence[str]] = SMOKE_SIZES,
                 dtypes: Sequence[str] = ("bfloat16",)) -> list[str]:
    """`run.smoke` (ours against plain JAX, loss and gradients, on this machine) with each
    model's tiny config resized by each of `sizes`, in each of `dtypes`; returns the
    failures."""
    failures = []
    for overrides in sizes:
        models = {}
        for name in names:
            model = MODELS[name]
            fields = {f.name for f in dataclasses.fields(model.smoke_config)}
            changes = [o for o in overrides if o.partition("=")[0] in fields]
            tiny = run.resized(dataclasses.replace(model, config=model.smoke_config), changes,
                               _raise)
            models[name] = dataclasses.replace(model, smoke_config=tiny.config)
        print(f"smoke at {' '.join(overrides)}:", flush=True)
        failures += [f"{' '.join(overrides)}: {f}"
                     for f in run.smoke(list(models), models, dtypes)]
    return failures


def _raise(message: str) -> None:
    raise ValueError(message)


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts over all rows (configurations, errors, distinct op calls, flags, evidence
    kinds, implementations chosen), and the same for each dtype under `by_dtype`."""
    dtypes = dict.fromkeys(r["dtype"] for r in rows)
    return {**_counts(rows), "by_dtype": {
        d: _counts([r for r in rows if r["dtype"] == d]) for d in dtypes}}


def _counts(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    configs = {(r["model"], tuple(r["overrides"])) for r in rows}
    calls = [r for r in rows if "error" not in r]
    kinds: dict[str, int] = {}
    for r in calls:
        kinds[r["evidence"]["kind"]] = kinds.get(r["evidence"]["kind"], 0) + 1
    chosen: dict[str, int] = {}
    for r in calls:
        chosen[f"{r['path']}: {r['implementation']}"] = (
            chosen.get(f"{r['path']}: {r['implementation']}", 0) + 1)
    return {"configs": len(configs), "errors": sum("error" in r for r in rows),
            "distinct_calls": len(calls), "flagged": sum(r["flagged"] for r in rows),
            "evidence": kinds, "chosen": dict(sorted(chosen.items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.models.plan_audit",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS), help="models to audit")
    parser.add_argument("--limit", type=int,
                        help="grid points per model and dtype (default: all)")
    parser.add_argument("--dtypes", nargs="*", choices=DTYPES, default=list(DTYPES),
                        help="dtypes to plan the grid in (or to smoke in)")
    parser.add_argument("--output", default="plan_audit.jsonl", help="JSON-lines file")
    parser.add_argument("--quiet", action="store_true", help="print only flags and the summary")
    parser.add_argument("--export-from-cpu", action="store_true",
                        help="plan as an export from this CPU machine does (no cuDNN)")
    parser.add_argument("--smoke", action="store_true",
                        help="instead: ours against plain JAX here at unseen tiny sizes")
    args = parser.parse_args(argv)
    if args.smoke:
        failures = smoke_unseen(args.only or list(MODELS), dtypes=args.dtypes)
        for failure in failures:
            print(f"FAILED {failure}", file=sys.stderr)
        return 1 if failures else 0
    start, rows = time.perf_counter(), []
    with open(args.output, "w") as out:
        for row in audit(args.only or list(MODELS), grid(args.limit, dtypes=args.dtypes),
                         cudnn=not args.export_from_cpu):
            rows.append(row)
            out.write(json.dumps(row, default=str) + "\n")
            if row["flagged"] or not args.quiet:
                what = row.get("error") or (
                    f"{row['path']} {row['arguments']}: {row['implementation']} "
                    f"({row['evidence']['kind']})")
                print(f"{'FLAG ' if row['flagged'] else ''}{row['model']} "
                      f"{' '.join(row['overrides'])}: {what}", flush=True)
    found = summary(rows)
    print(json.dumps(found, indent=1))
    for dtype, counts in found["by_dtype"].items():
        print(f"{dtype}: {counts['configs']} configurations, {counts['distinct_calls']} "
              f"distinct op calls, {counts['flagged']} flagged")
    print(f"{found['configs']} configurations, {found['distinct_calls']} distinct op calls, "
          f"{found['flagged']} flagged, {time.perf_counter() - start:.0f} s; rows in "
          f"{pathlib.Path(args.output)}")
    return 1 if found["flagged"] else 0


if __name__ == "__main__":
    sys.exit(main())
