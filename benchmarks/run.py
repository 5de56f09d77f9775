"""The benchmark suite: every workload, every implementation and peer, in one run.

    python -m benchmarks.run [--only SUBSTRING ...] [--modes fwd,fwd+bwd] [--iterations N]

Times each candidate on the device (CUPTI on a GPU, the profiler elsewhere;
median after warm-up), checks its forward output against a float32 reference,
prints a table (ms, TFLOP/s or TB/s, % of the H200's nominal ceiling, ratio to the
best peer, % of the workload's measured ceiling: a copy for the norms, a dense matmul
for the ragged dot), and writes JSON and a PNG chart named after the benchmark to
`benchmarks/results/<device_kind>/` (`--name`; `ops`, or `ops_` and the `--only` words),
replacing the benchmark's previous run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import sys
import traceback
from typing import Any

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from benchmarks import workloads as wl
from benchmarks.sweep import source_commit
from tokamax_pass import benchmarking
from tokamax_pass.core.atomic_io import write_atomic
from tokamax_pass.core.device import device_kind_key
from tokamax_pass.tables import render_table

RESULTS = pathlib.Path(__file__).parent / "results"
MODES = {"fwd": "forward", "fwd+bwd": "forward_and_vjp"}


def _relative_error(out: Any, ref: jax.Array) -> float:
    out = jnp.asarray(out, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def measure(workload: wl.Workload, modes: list[str], iterations: int) -> list[dict[str, Any]]:
    args = workload.make()
    ref = jnp.asarray(jax.jit(workload.reference)(*args), jnp.float32)
    rows = []
    # Ceilings and peers first: each of our rows then prints with its ratios to them.
    candidates = [("ceiling", n, f) for n, f in workload.ceilings.items()] + [
        ("peer", n, f) for n, f in workload.peers.items()] + [
        ("ours", n, f) for n, f in workload.ours.items()]
    for kind, name, fn in candidates:
        row: dict[str, Any] = {"workload": workload.name, "kind": kind, "implementation": name}
        for mode in modes if kind != "ceiling" else [m for m in modes if m == "fwd"]:
            mode_row = {**row, "mode": mode}
            try:
                inputs = fn.prepare(*args) if isinstance(fn, wl.Prepared) else args
                f_std, arrays = benchmarking.standardize_function(fn, *inputs, mode=MODES[mode])
                run = benchmarking.compile_benchmark(f_std, arrays)
                if mode == "fwd" and kind != "ceiling":
                    mode_row["relative_error"] = _relative_error(run.compiled(arrays), ref)
                data = run(arrays, iterations=iterations)
            except Exception as e:  # noqa: BLE001 - a failing candidate is a result, not a crash
                mode_row["error"] = _short_error(e)
            else:
                ms = data.median_evaluation_time_ms
                rate = workload.work(mode) / (ms * 1e-3) / 1e12
                mode_row.update(ms=ms, rate=rate, unit=workload.unit, method=data.method,
                                compile_s=data.compile_time_ms / 1e3,
                                temp_memory_mb=data.temp_memory_mb)
            rows.append(mode_row)
            _add_ratios(rows)
            print(_progress_line(mode_row), flush=True)
    return rows


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """`vs_best_peer` (the best peer's time over this row's) and `of_ceiling` (this row's
    rate over the best ceiling's, forward only) on every timed row but the ceilings."""
    for mode in {r["mode"] for r in rows}:
        timed = [r for r in rows if r["mode"] == mode and "ms" in r]
        peers = [r["ms"] for r in timed if r["kind"] == "peer"]
        ceiling = max((r["rate"] for r in timed if r["kind"] == "ceiling"), default=None)
        for r in timed:
            if r["kind"] == "ceiling":
                continue
            if peers:
                r["vs_best_peer"] = min(peers) / r["ms"]
            if ceiling:
                r["of_ceiling"] = r["rate"] / ceiling


def _ceiling(unit: str) -> float:
    return wl.H200_BF16_TFLOPS if unit == "TFLOP/s" else wl.H200_COPY_TBPS


COLUMNS = ("workload", "mode", "kind", "implementation", "ms", "rate", "unit", "%nominal",
           "vs best peer", "error", "of ceiling")
_NUMBER_COLUMNS = ("ms", "rate", "%nominal", "vs best peer", "error", "of ceiling")


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    """A result row's cells under `COLUMNS` (a failure's message in its `ms` cell)."""
    head = (r["workload"], r["mode"], r["kind"], r["implementation"])
    if "error" in r:
        return (*head, f"FAILED {r['error']}", *[""] * (len(COLUMNS) - len(head) - 1))
    return (*head, f"{r['ms']:.3f}", f"{r['rate']:.1f}", r["unit"],
            f"{100 * r['rate'] / _ceiling(r['unit']):.1f}%",
            f"{r['vs_best_peer']:.2f}x" if "vs_best_peer" in r else "-",
            f"{r['relative_error']:.1e}" if "relative_error" in r else "",
            f"{100 * r['of_ceiling']:.0f}%" if "of_ceiling" in r else "")


def _progress_line(r: dict[str, Any]) -> str:
    return " ".join(f"{name}={cell}" for name, cell in zip(COLUMNS, _cells(r), strict=True)
                    if cell)


def _chart(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart", file=sys.stderr)
        return
    groups = sorted({(r["workload"], r["mode"]) for r in rows if "ms" in r})
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 2.2 * len(groups)), squeeze=False)
    for ax, (workload, mode) in zip(axes[:, 0], groups, strict=True):
        sel = [r for r in rows if r["workload"] == workload and r["mode"] == mode and "ms" in r]
        colors = [{"ours": "tab:blue", "ceiling": "tab:olive"}.get(r["kind"], "tab:gray")
                  for r in sel]
        ax.barh([r["implementation"] for r in sel], [r["rate"] for r in sel], color=colors)
        ax.set_title(f"{workload} {mode} ({sel[0]['unit']}, higher is better)", fontsize=9)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def benchmark_name(only: list[str]) -> str:
    """The default name of a run's results: `ops` for every workload, else `ops_` and the
    `--only` words (`["rms norm"]` -> `ops_rms_norm`)."""
    words = re.sub(r"[^a-z0-9]+", "_", "_".join(only).lower()).strip("_")
    return f"ops_{words}" if words else "ops"


def _write(out: pathlib.Path, device: Any, rows: list[dict[str, Any]]) -> None:
    write_atomic(out, json.dumps({
        "provenance": {"commit": source_commit()},
        "device_kind": device.device_kind,
        "jax_version": jax.__version__,
        "tokamax_pass_version": tokamax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "rows": rows,
    }, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--only", nargs="*", default=[], help="run workloads whose name has these")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--name", default=None,
                        help="the benchmark's name: results/<device>/NAME.json and .png, replaced "
                        "when re-run (default: `ops`, or `ops_` and the --only words)")
    parser.add_argument("--output", default=None, help="JSON path (default: from --name)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the suite")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    device = jax.devices()[0]
    candidates = wl.smoke_workloads() if args.smoke else wl.all_workloads()
    selected = [w for w in candidates
                if not args.only or any(s in w.name for s in args.only)]
    out = pathlib.Path(args.output) if args.output else (
        RESULTS / device_kind_key(device.device_kind)
        / f"{args.name or benchmark_name(args.only)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for workload in selected:
        try:
            rows.extend(measure(workload, modes, args.iterations))
        except Exception:  # noqa: BLE001 - report and go on with the next workload
            traceback.print_exc()
        _write(out, device, rows)  # after each workload, so a cut-short run keeps its rows
    print()
    print(render_table(COLUMNS, [_cells(row) for row in rows], right_aligned=_NUMBER_COLUMNS))
    _chart(rows, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
