"""The generalization benchmark: how far `implementation=None` is from the fastest
implementation (ours or a peer) at random shapes inside each op's documented range.

    python -m benchmarks.generalize [--families ragged_dot,layer_norm] [--shapes 6]
        [--seed N] [--max-seconds 480] [--workers 4] [--append] [--out FILE.json]

Each run draws new shapes (`benchmarks.shapes.draw`; the seed defaults to a fresh one and
is recorded), times `None`, every implementation of ours and the cheap peers forward
and forward+backward on the device, and reports per op and mode the share of shapes
where `None` is within 10% of the fastest and the worst ratio. `None` and the fastest
other candidate are then timed again, taking turns in the order A B B A
(`CONFIRM_ROUNDS` pairs), and the ratio is read from those paired timings
(`confirmed_ms`): timings taken minutes apart on the device drift by more than 10% (one
program timed as `None` and as its own implementation has measured that far apart), and
the fastest of several first timings is biased low. The JSON (default
`benchmarks/results/<device>/generalization.json`, replaced on each run) holds every
timing, the summary and the provenance (commit, date, jax version, seed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax

import tokamax_pass as tokamax
from benchmarks import shapes, sweep
from tokamax_pass import benchmarking
from tokamax_pass.core import registry
from tokamax_pass.core.device import device_kind_key

MODES = {"fwd": "forward", "fwd+bwd": "forward_and_vjp"}
WITHIN = 0.10
# Paired re-timings of `None` and the fastest other candidate (A B B A per two pairs).
CONFIRM_ROUNDS = 2


def _none(family: str) -> Any:
    sweep.ours(family)  # registers the family
    fam = registry.families()[family]
    return lambda *args, **kwargs: fam(None, *args, **kwargs)


def _chosen(family: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The implementation `None` runs for the forward call here (the plan's row)."""
    try:
        rows = tokamax.optimize(lambda *a: _none(family)(*a, **kwargs)).plan(*args)
    except Exception as e:  # noqa: BLE001 - the timing below reports the failure itself
        return f"unknown ({type(e).__name__})"
    return rows[0].op if len(rows) else "none"


def measure_shape(family: str, params: dict[str, Any], *, seed: int, iterations: int,
                  call_seconds: float, method: str | None,
                  lock: pathlib.Path | None = None) -> list[dict[str, Any]]:
    """One row per candidate and mode: `None`, ours, the peers."""
    args, kwargs = shapes.build(family, params, seed)
    candidates = [("none", "None", _none(family))] + [
        ("ours", n, fn) for n, fn in sweep.ours(family).items()] + [
        ("peer", n, fn) for n, fn in sweep.peers(family).items()]
    chosen = _chosen(family, args, kwargs)

    def timed(fn: Any, mode: benchmarking.Mode) -> dict[str, Any]:
        return sweep.time_call(fn, args, kwargs, mode, seed=seed, iterations=iterations,
                               budget_s=call_seconds, method=method, lock=lock)

    rows = []
    for mode, std_mode in MODES.items():
        mode_rows, functions = [], {}
        for kind, name, fn in candidates:
            row = {"family": family, "params": params, "mode": mode, "kind": kind,
                   "implementation": name}
            if kind == "none":
                row["chosen"] = chosen
            row.update(timed(fn, std_mode))
            mode_rows.append(row)
            functions[id(row)] = fn
        pair = _none_and_fastest(mode_rows)
        if pair is not None:
            for row in _confirmation_order(pair):
                row.setdefault("confirmed_ms", []).append(
                    timed(functions[id(row)], std_mode).get("ms"))
        rows.extend(mode_rows)
    return rows


def _none_and_fastest(rows: list[dict[str, Any]]
                      ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """`(None's row, the fastest other candidate's)` among one shape's and mode's timed
    rows, or `None` where either did not run."""
    none = [r for r in rows if r["kind"] == "none" and "ms" in r]
    others = [r for r in rows if r["kind"] != "none" and "ms" in r]
    if not none or not others:
        return None
    return none[0], min(others, key=lambda r: r["ms"])


def _confirmation_order(pair: tuple[Any, Any]) -> list[Any]:
    """The two candidates taking turns, A B B A for each two pairs, so that a steady drift
    of the device's speed weighs on both alike."""
    return [pair[(i + 1) // 2 % 2] for i in range(2 * CONFIRM_ROUNDS)]


def _ratio_ms(row: dict[str, Any], partner: dict[str, Any]) -> tuple[float, float]:
    """`(None's ms, the fastest's ms)`: their paired re-timings' medians where both were
    re-timed in full, else their first timings."""
    mine, theirs = row.get("confirmed_ms") or [], partner.get("confirmed_ms") or []
    if mine and theirs and None not in mine and None not in theirs:
        return statistics.median(mine), statistics.median(theirs)
    return row["ms"], partner["ms"]


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per `family mode`: shapes compared, the share with `None` within `WITHIN` of the
    fastest other candidate, and the worst ratio (None's time over the fastest; from
    their paired re-timings where `measure_shape` took them in full)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["family"], row["mode"], json.dumps(row["params"], sort_keys=True))
        groups.setdefault(key, []).append(row)
    summary: dict[str, dict[str, Any]] = {}
    for (family, mode, params), group in groups.items():
        pair = _none_and_fastest(group)
        if pair is None:
            continue
        none, fastest = pair
        none_ms, fastest_ms = _ratio_ms(none, fastest)
        ratio = none_ms / fastest_ms
        entry = summary.setdefault(f"{family} {mode}", {"shapes": 0, "within": 0,
                                                         "worst_ratio": 0.0})
        entry["shapes"] += 1
        entry["within"] += ratio <= 1 + WITHIN
        if ratio > entry["worst_ratio"]:
            entry.update(worst_ratio=ratio, worst_params=json.loads(params),
                         worst_fastest=fastest["implementation"])
    for entry in summary.values():
        entry["within_fraction"] = entry.pop("within") / entry["shapes"]
    return summary


def run_workers(workers: int, argv: list[str], rows_dir: pathlib.Path,
                deadline_s: float) -> list[dict[str, Any]]:
    """Measures the shapes `argv` draws in `workers` processes, each its share, taking
    turns on the device while the others compile; returns their rows. A worker still
    running after `deadline_s` (a compile that does not end) is stopped, keeping the
    shapes it finished."""
    parts = [rows_dir / f"worker{i}.jsonl" for i in range(workers)]
    processes = sweep.start_workers("benchmarks.generalize", argv, rows_dir / "device.lock",
                                    parts, "--rows-out")
    stop = time.monotonic() + deadline_s
    for p in processes:
        try:
            p.wait(timeout=max(0.0, stop - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            print(f"stopped a worker past the deadline: {p.args[-1]}", file=sys.stderr)
    for p in processes:
        if p.returncode not in (0, -9):
            print(f"a worker failed ({p.returncode}); its finished shapes are kept: "
                  f"{p.args[-1]}", file=sys.stderr)
    return [json.loads(line) for part in parts if part.exists()
            for line in part.read_text().splitlines() if line.strip()]


def _forwarded(argv: list[str]) -> list[str]:
    """`argv` without the options only the parent process acts on."""
    drop = {"--workers", "--out"}
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in drop:
            skip = True
        elif arg != "--append" and not any(arg.startswith(d + "=") for d in drop):
            kept.append(arg)
    return kept


def write(out: pathlib.Path, rows: list[dict[str, Any]], seed: int, append: bool) -> None:
    """Writes `rows` (after the file's own with `append`) with their summary and provenance."""
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    commit = sweep.source_commit()
    seeds, runs, commits = [seed], [now], [commit]
    if append and out.exists():
        old = json.loads(out.read_text())
        measured = {r["family"] for r in rows}  # a family measured again is replaced
        rows = [r for r in old["rows"] if r["family"] not in measured] + rows
        seeds = [*_listed(old["provenance"]["seed"]), seed]
        runs = [*_listed(old["provenance"].get("runs", old["provenance"]["date"])), now]
        commits = [*_listed(old["provenance"].get("commits", old["provenance"]["commit"])),
                   commit]
    provenance: dict[str, Any] = {
        "commit": commit, "jax": jax.__version__,
        "device_kind": jax.devices()[0].device_kind, "date": now,
        "seed": seeds if len(seeds) > 1 else seed}
    if len(runs) > 1:
        provenance.update(runs=runs, commits=commits)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": provenance, "summary": summarize(rows),
                               "rows": rows}, indent=1) + "\n")


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generalize",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(shapes.FAMILIES))
    parser.add_argument("--shapes", type=int, default=6, help="random shapes per family")
    parser.add_argument("--seed", type=int, default=None,
                        help="the draw (default: a fresh one, recorded in the output)")
    parser.add_argument("--max-seconds", type=float, default=480.0,
                        help="stop starting shapes after this long")
    parser.add_argument("--call-seconds", type=float, default=10.0,
                        help="time budget of one measurement, compile included")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--method", default=None, help="timer (default: the best available)")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU check)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes that compile side by side and time in turn")
    parser.add_argument("--grace-seconds", type=float, default=120.0,
                        help="with --workers: stop a worker this long after --max-seconds")
    parser.add_argument("--append", action="store_true",
                        help="keep the output file's rows of the families not measured now")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--shard", type=sweep.shard_argument, default=(0, 1),
                        help=argparse.SUPPRESS)
    parser.add_argument("--lock", type=pathlib.Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rows-out", type=pathlib.Path, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    families = [f for f in options.families.split(",") if f]
    unknown = set(families) - set(shapes.FAMILIES)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; known: {shapes.FAMILIES}")
    seed = options.seed if options.seed is not None else random.SystemRandom().randrange(2**31)
    out = options.out or (pathlib.Path(__file__).parent / "results" /
                          device_kind_key(jax.devices()[0].device_kind) / "generalization.json")
    if options.workers > 1:
        forwarded = [*_forwarded(list(sys.argv[1:] if argv is None else argv)),
                     "--seed", str(seed)]
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as rows_dir:
            rows = run_workers(options.workers, forwarded, pathlib.Path(rows_dir),
                               options.max_seconds + options.grace_seconds)
    else:
        rows = measure(families, options, seed)
    if options.rows_out is not None:
        return 0
    for name, entry in sorted(summarize(rows).items()):
        print(f"{name}: {entry['shapes']} shapes, None within {WITHIN:.0%} of the fastest at "
              f"{entry['within_fraction']:.0%}, worst {entry['worst_ratio']:.2f}x", flush=True)
    write(out, rows, seed, options.append)
    print(f"wrote {out}")
    return 0


def measure(families: list[str], options: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """The rows of this process's share of the shapes the seed draws."""
    rng = random.Random(seed)
    draws = [(family, shapes.draw(family, rng, options.tiny))
             for _ in range(options.shapes) for family in families]
    index, count = options.shard
    deadline = time.monotonic() + options.max_seconds
    rows: list[dict[str, Any]] = []
    for family, params in draws[index::count]:
        if time.monotonic() > deadline:
            break
        shape_rows = measure_shape(family, params, seed=seed % benchmarking.MAX_SEED,
                                   iterations=options.iterations,
                                   call_seconds=options.call_seconds, method=options.method,
                                   lock=options.lock)
        rows += shape_rows
        if options.rows_out is not None:  # a worker: each shape is kept as it is done
            with options.rows_out.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in shape_rows)
        print(f"{family} {params}: done", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
