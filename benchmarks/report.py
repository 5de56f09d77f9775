"""Writes the measured tables of README.md and docs/ from the results files, or checks them.

    python -m benchmarks.report           # rewrite the tables between the pages' markers
    python -m benchmarks.report --check   # exit 1 when a page differs (CI runs this)

The pages are README.md and every `docs/**/*.md`. Results are named by benchmark: the
results folder's `index.json` maps each benchmark to its current file. Six tables, each
between its markers (`<!-- report:NAME -->` ... `<!-- /report:NAME -->`) on exactly one
page: `models` (one benchmark of `python -m benchmarks.models` per row, `MODEL_ROWS`),
`ops` (one benchmark of `python -m benchmarks.run` per row, `OP_ROWS`: ratios only to peers
measured in that run, and the peers of the family that did not run named), `seed`
(`SEED_RUN`), `tpu` (public per-chip figures, not measurements), `generalization`
(`GENERALIZATION`) and `calibration` (`SWEEP`, the calibration sweep's rows, and
`CALIBRATION`, the calibration fitted from them).
Every number is read from the file the row names. A figure quoted in the prose is written
`<!--fig BENCHMARK PATH FORMAT-->value<!--/fig-->`: the value at PATH in the benchmark's
results file (dotted keys and list indices, `~` standing for a space; `[key=value;...]`
picks the one list item that matches), in Python's FORMAT. A number the code defines (a
threshold, a limit) is written `<!--const MODULE:NAME[/DIVISOR] FORMAT-->value<!--/const-->`:
the attribute NAME (dotted) of MODULE, divided by DIVISOR, in FORMAT. Both are rewritten
and checked with the tables, and `--check` fails on a measured-looking number written by
hand anywhere else on a page (`hand_written_figures`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import re
import sys
from typing import Any

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results" / "nvidia_h200"
CALIBRATION = ROOT / "src" / "tokamax_pass" / "data" / "calibration" / "nvidia_h200.json"
BEGIN, END = "<!-- report:models -->", "<!-- /report:models -->"


def results_file(benchmark: str) -> pathlib.Path:
    """The current results file of `benchmark`, as the results folder's index names it."""
    index = json.loads((RESULTS / "index.json").read_text())["benchmarks"]
    if benchmark not in index:
        raise SystemExit(f"{benchmark!r} is not a benchmark of {RESULTS / 'index.json'}")
    return RESULTS / index[benchmark]["file"]


# (benchmark, workload) per row of the op table, in the page's order.
OP_ROWS = (
    ("ops_llama", "glu 16384x2048x5632 (llama)"),
    ("ops_llama", "rms norm 16384x2048 f32 scale (llama)"),
    ("ops_llama", "rms norm + residual 16384x2048 f32 scale (llama)"),
    ("ops_llama", "lce 16384x2048x32000 (llama model)"),
    ("ops_lce", "lce 16384x4096x128256 (llama 3, liger)"),
    ("ops_lce", "lce 8192x2304x256000 (gemma 2 2b, cce)"),
    ("ops_attention", "attention b32 s2048 h16 d64"),
    ("ops_self_attention", "self-attention x,x,x b32 s2048 h16 d64 (seed)"),
    ("ops_attention", "attention b4 s8192 h16 d128"),
    ("ops_attention", "attention b4 s8192 h16 d128 causal"),
    ("ops_self_attention", "self-attention x,x,x b4 s8192 h16 d128"),
    ("ops_attention", "attention gqa b4 s4096 hq32 hkv8 d128 causal"),
    ("ops_attention_gqa", "attention gqa b4 s4096 hq32 hkv8 d128 causal"),
    ("ops_attention", "attention b16 s4096 h8 d256"),
    ("ops_attention_softcap",
     "attention soft cap 50 window 4096 b4 s8192 h16 d128 causal"),
    ("ops_attention_softcap",
     "attention soft cap 50 window 4096 b2 s8192 hq8 hkv4 d256 causal (gemma 2)"),
    ("ops", "ragged dot m16384 k4096 n4096 g8"),
    ("ops_norms", "layer norm 65536x4096"),
    ("ops_norms", "rms norm 65536x4096"),
    ("ops_norms", "layer norm 65536x1024"),
    ("ops_norms", "layer norm 32x2048x16x64 no offset (seed)"),
)

# model -> the benchmark that holds its row.
MODEL_ROWS = {
    "llama": "models_llama",
    "mixtral": "models_mixtral",
    "deepseek_moe": "models_moe",
    "moe_decode": "models_moe",
    "gemma2": "models_gemma2",
    "encoder": "models_encoder",
    "lm_head": "models_lm_head",
}
VARIANTS = (("ours", "ours `None`"), ("optimize", "`optimize`"),
            ("rewrite", "plain JAX through `optimize`"), ("tuned", "tuned"),
            ("upstream", "upstream Tokamax 0.0.17"))


def _cell(row: dict[str, Any], variant: str) -> str:
    value = row.get(variant)
    if not isinstance(value, dict):
        return "- (not run)"
    if "error" in value:
        return "failed (error in the results file)"
    if "ms" not in value:
        return f"- ({value.get('skipped', '').split(' (')[0]})"
    plain = row["plain"]["ms"]
    return _timed(value, f"{plain / value['ms']:.3f}x")


def _timed(value: dict[str, Any], ratio: str | None = None) -> str:
    """`ms (ratio; GB)`: the time, its ratio to plain JAX's, and the compiled program's
    temporary memory where the run recorded it."""
    notes = [] if ratio is None else [ratio]
    if "temp_memory_mb" in value:
        notes.append(f"{value['temp_memory_mb'] / 1e3:.2f} GB")
    return f"{value['ms']:.2f} ms" + (f" ({'; '.join(notes)})" if notes else "")


def model_table() -> str:
    """The markdown table (with a line naming the device and files) from `MODEL_ROWS`; a
    forward-only model (a decode step) is marked so in its row."""
    from benchmarks.models import MODELS

    header = ("| model | plain JAX | " + " | ".join(label for _, label in VARIANTS)
              + " | `autotune` (all implementations) | results file |")
    lines = [header, "|" + "---|" * (len(VARIANTS) + 4)]
    device = None
    iterations = set()
    for name, benchmark in MODEL_ROWS.items():
        file = results_file(benchmark)
        data = json.loads(file.read_text())
        device = data["device_kind"]
        iterations.add(data["iterations"])
        row = data["models"][name]
        autotune = (f"{row['autotune_s']:.1f} s, {row['autotune_op_calls']} op calls"
                    if "autotune_s" in row else "-")
        label = f"{name} (forward only)" if MODELS[name].forward_only else name
        lines.append(f"| {label} | {_timed(row['plain'])} | "
                     + " | ".join(_cell(row, v) for v, _ in VARIANTS)
                     + f" | {autotune} | `{file.name}` |")
    intro = (f"{device}, one training step (`jax.grad` of the loss over all parameters; "
             "the loss alone where the row says forward only), "
             f"device time (CUPTI), median of {' or '.join(map(str, sorted(iterations)))} after "
             "warm-up; ratios are plain JAX's time "
             "over the variant's, every variant of a row measured in one process; GB, where "
             "a run recorded it, is the compiled step's temporary device memory (XLA's "
             "memory analysis: what it allocates beyond its inputs and outputs).")
    return intro + "\n\n" + "\n".join(lines)


def _family(workload: str) -> str:
    """`attention`, `layer`, `rms`, `ragged`, `glu`, `lce`, `residual norm`: workloads
    whose peers are the same."""
    if "+ residual" in workload:
        return "residual norm"
    return workload.split(maxsplit=1)[0].removeprefix("self-")


def _rows(benchmark: str) -> list[dict[str, Any]]:
    return json.loads(results_file(benchmark).read_text())["rows"]


def _rate(row: dict[str, Any]) -> str:
    return f"{row['rate']:.{0 if row['unit'] == 'TFLOP/s' else 2}f} {row['unit']}"


def _date(benchmark: str) -> str:
    return json.loads(results_file(benchmark).read_text())["date"][:10]


def op_table() -> str:
    """Per workload and mode: ours `None`, our fastest implementation, the best peer of the
    same run and the ratio, and the family's peers that did not run in that run."""
    from benchmarks import workloads as wl

    known: dict[str, set[str]] = {}
    for benchmark, _ in OP_ROWS:
        for row in _rows(benchmark):
            if row["kind"] == "peer":
                known.setdefault(_family(row["workload"]), set()).add(row["implementation"])
    lines = ["| workload | mode | ours `None` | our fastest | best peer in the run | "
             "`None` / best peer | peers that did not run | run | file |", "|" + "---|" * 9]
    for benchmark, workload in OP_ROWS:
        rows = [r for r in _rows(benchmark) if r["workload"] == workload]
        for mode in dict.fromkeys(r["mode"] for r in rows):
            timed = [r for r in rows if r["mode"] == mode and "rate" in r]
            ours = {r["implementation"]: r for r in timed if r["kind"] == "ours"}
            peers = [r for r in timed if r["kind"] == "peer"]
            none = ours.get("tokamax None")
            if none is None:
                continue
            fastest = max((r for n, r in ours.items() if n != "tokamax None"),
                          key=lambda r: r["rate"])
            best = max(peers, key=lambda r: r["rate"]) if peers else None
            missing = sorted(known.get(_family(workload), set())
                             - {r["implementation"] for r in peers})
            lines.append(
                f"| {workload} | {mode} | {_rate(none)} | "
                f"{fastest['implementation'].removeprefix('tokamax ')} {_rate(fastest)} | "
                + (f"{best['implementation']} {_rate(best)} | {none['rate'] / best['rate']:.2f}x"
                   if best else "- | -")
                + f" | {', '.join(missing) or '-'} | {_date(benchmark)} | "
                f"`{results_file(benchmark).name}` |")
    return ("H200, bf16, device time (CUPTI), median of 10-20 after warm-up; TFLOP/s (attention "
            f"counts `4*b*h*s^2*d` forward, {wl.ATTENTION_FWD_BWD_WORK:g}x that "
            "forward+backward, half for causal; ragged dot and GLU `2*m*k*n`, "
            f"{wl.MATMUL_FWD_BWD_WORK:g}x forward+backward) or TB/s (norms: bytes read "
            "and written). The ratio compares only with peers timed in the same run; `run` is "
            "the date of that run. Rows run before 2026-12-01 measured `None` under a rule "
            "that ran kernels first, measured or not. Rows run before 2026-12-02 time "
            "forward+backward without the optimization barrier, so XLA may fuse the "
            "backward with the expression that made the cotangent.\n\n"
            + "\n".join(lines))


# The seed model end to end (`python -m benchmarks.seed_e2e --artifact DIR`).
SEED_RUN = "seed_e2e"


def seed_table() -> str:
    """The seed model end to end, from `SEED_RUN`."""
    data = json.loads(results_file(SEED_RUN).read_text())
    plain = data["plain_jax_cudnn_ms"]
    tuned_ops = data["autotune_result"].split(",", 1)[1].split(")", 1)[0].strip()
    rows = [("plain JAX (XLA norm + `jax.nn` cuDNN attention)", plain),
            ("`jax.jit`, every implementation `None`", data["tokamax_jit_none_ms"]),
            ("`optimize`", data["tokamax_optimize_ms"]),
            (f"after `autotune` ({data['autotune_s']:.1f} s; it tuned {tuned_ops}: the "
             "shipped cache held every call)", data["tokamax_tuned_ms"]),
            ("the artifact exported on a CPU machine for cuda", data["artifact_ms"])]
    lines = ["| variant | ms | vs plain JAX |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.2f} | {plain / ms:.3f}x |" for name, ms in rows]
    return ("`grad(loss)` of the seed model (bf16[32,2048,16,64], f32[64]), one run "
            f"(`{results_file(SEED_RUN).name}`, `python -m benchmarks.seed_e2e --artifact DIR`); "
            "the "
            f"artifact's output is bitwise equal to in process: "
            f"{data['artifact_bitwise_equal']}.\n\n" + "\n".join(lines))


def tpu_roofline_table() -> str:
    """What the TPU kernels should approach per generation, from the public figures in
    `tokamax_kernels._mosaic_tpu.GENERATIONS` (specifications, not measurements)."""
    from tokamax_kernels._mosaic_tpu import GENERATIONS

    flops = 2 * 16384 * 4096 * 4096  # the ragged dot m16384 k4096 n4096; = attention
    assert flops == 4 * 32 * 16 * 2048**2 * 64  # b32 s2048 h16 d64's forward
    lines = ["| TPU | device kind | bf16 peak | HBM | ridge (FLOP/byte) | ragged dot "
             "m16384 k4096 n4096 at peak | attention b32 s2048 h16 d64 fwd at peak |",
             "|" + "---|" * 7]
    for gen in GENERATIONS:
        ms = flops / (gen.bf16_tflops * 1e12) * 1e3
        lines.append(f"| {gen.name} | `{gen.device_kinds[0]}` | {gen.bf16_tflops:.0f} TFLOP/s "
                     f"| {gen.hbm_gb_per_s / 1e3:.2f} TB/s "
                     f"| {gen.bf16_tflops * 1e3 / gen.hbm_gb_per_s:.0f} | {ms:.2f} ms "
                     f"| {ms:.2f} ms |")
    return "\n".join(lines)


# The generalization benchmark (`python -m benchmarks.generalize`) and the calibration
# sweep's rows (`python -m benchmarks.sweep run`).
GENERALIZATION = "generalization"
SWEEP = "sweep"


def _shape(params: dict[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in params.items())


def generalization_table() -> str:
    """Per op family and mode: the shapes drawn, how many have `None` within
    `benchmarks.generalize.WITHIN` of the fastest candidate, the worst ratio, the
    candidate that was fastest there and its shape, from `GENERALIZATION`."""
    from benchmarks.generalize import WITHIN

    data = _load(GENERALIZATION)
    provenance = data["provenance"]
    seeds = provenance["seed"] if isinstance(provenance["seed"], list) else [provenance["seed"]]
    drawn = {(row["family"], json.dumps(row["params"], sort_keys=True)) for row in data["rows"]}
    lines = [f"| op | mode | shapes | `None` within {WITHIN:.0%} of the fastest | worst "
             "`None` / fastest | fastest there | worst shape |", "|" + "---|" * 7]
    for key, entry in sorted(data["summary"].items()):
        family, mode = key.split(" ", 1)
        within = round(entry["within_fraction"] * entry["shapes"])
        lines.append(f"| `{family}` | {mode} | {entry['shapes']} | {within} "
                     f"({entry['within_fraction']:.0%}) | {entry['worst_ratio']:.3f}x | "
                     f"{entry['worst_fastest']} | {_shape(entry['worst_params'])} |")
    runs = len(provenance.get("runs", [provenance["date"]]))
    return (f"{provenance['device_kind']}, {provenance['date'][:10]}, "
            f"{runs} run{'s' if runs > 1 else ''} (seed{'s' if len(seeds) > 1 else ''} "
            f"{', '.join('not recorded' if s is None else str(s) for s in seeds)}), "
            f"{len(drawn)} shapes in all (`{results_file(GENERALIZATION).name}`); a ratio is "
            "`None`'s time over the fastest implementation's or peer's at that shape, device "
            "time (CUPTI).\n\n"
            + "\n".join(lines))


def calibration_table() -> str:
    """Per op family: the sweep's timed calls and the implementations they cover (from
    `SWEEP`), then the ceilings and the point count of the fit (`CALIBRATION`)."""
    rows = [row for row in _load(SWEEP) if "ms" in row]
    fit = json.loads(CALIBRATION.read_text())
    families: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["kind"] != "ceiling":
            families.setdefault(row["family"], []).append(row)
    ceiling_rows = len(rows) - sum(len(timed) for timed in families.values())
    lines = ["| op | calls timed (forward / VJP) | implementations timed |", "|---|---|---|"]
    for family, timed in sorted(families.items()):
        forward = sum(row["direction"] == "forward" for row in timed)
        names = ", ".join(sorted({row["implementation"] for row in timed}))
        lines.append(f"| `{family}` | {len(timed)} ({forward} / {len(timed) - forward}) | "
                     f"{names} |")
    ceilings = fit["ceilings"]
    return (f"{fit['device_kind']}, `{results_file(SWEEP).name}` "
            f"({len(rows) - ceiling_rows} timed op calls and {ceiling_rows} ceiling "
            f"measurements) fitted into `{CALIBRATION.name}` "
            f"({fit['provenance']['date']}): "
            f"ceilings bf16 {ceilings['bf16_tflops']:.0f} TFLOP/s, f32 "
            f"{ceilings['f32_tflops']:.0f} TFLOP/s, HBM {ceilings['hbm_tbps']:.2f} TB/s; "
            f"{len(fit['points'])} points of measured efficiency.\n\n" + "\n".join(lines))


TABLES = {"models": model_table, "ops": op_table, "seed": seed_table,
          "tpu": tpu_roofline_table, "generalization": generalization_table,
          "calibration": calibration_table}
FIGURE = re.compile(r"<!--fig (\S+) (\S+) ([^\s>-]+)-->(.*?)<!--/fig-->", re.S)
CONSTANT = re.compile(r"<!--const (\S+) ([^\s>-]+)-->(.*?)<!--/const-->", re.S)


def _load(benchmark: str) -> Any:
    file = results_file(benchmark)
    text = file.read_text()
    if file.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def constant(reference: str, fmt: str) -> str:
    """`MODULE:NAME[/DIVISOR]`: the attribute NAME (dotted) of MODULE, over DIVISOR, in `fmt`."""
    module_name, _, name = reference.partition(":")
    name, _, divisor = name.partition("/")
    value: Any = importlib.import_module(module_name)
    for part in name.split("."):
        value = getattr(value, part)
    return format(value / int(divisor) if divisor else value, fmt)


def figure(benchmark: str, path: str, fmt: str) -> str:
    """The value at `path` in a benchmark's results file, formatted (see the module
    docstring)."""
    value = _load(benchmark)
    for part in re.findall(r"\[[^\]]*\]|[^.\[\]]+", path):
        if part.startswith("["):
            conditions = dict(c.replace("~", " ").split("=", 1) for c in part[1:-1].split(";"))
            matches = [row for row in value
                       if all(str(row.get(k)) == v for k, v in conditions.items())]
            if len(matches) != 1:
                raise SystemExit(f"{benchmark}: {part} matches {len(matches)} rows, not one")
            value = matches[0]
        elif isinstance(value, list):
            value = value[int(part)]
        else:
            value = value[part.replace("~", " ")]
    return format(value, fmt)


def rendered(page: str) -> str:
    """`page` with the text between each table's markers replaced by the current table and
    each figure by its current value."""
    for name, table in TABLES.items():
        begin, end = f"<!-- report:{name} -->", f"<!-- /report:{name} -->"
        if begin not in page:
            continue
        if end not in page:
            raise SystemExit(f"{begin} has no {end} after it")
        head, rest = page.split(begin, 1)
        _, tail = rest.split(end, 1)
        page = f"{head}{begin}\n{table()}\n{end}{tail}"
    page = FIGURE.sub(lambda m: f"<!--fig {m[1]} {m[2]} {m[3]}-->{figure(m[1], m[2], m[3])}"
                      "<!--/fig-->", page)
    return CONSTANT.sub(lambda m: f"<!--const {m[1]} {m[2]}-->{constant(m[1], m[2])}"
                        "<!--/const-->", page)


# A number with a unit or a ratio: `1.24x`, `43%`, `9.5 ms`, `256 MiB`, `3.4 TB/s`,
# `700 TFLOP/s`. A digit or letter right after the `x` makes it a shape (`16384x2048`), and
# `2 x M` (spaced) is a product, not a ratio.
MEASURED = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:x(?![\w.]\w)|×|"  # noqa: RUF001 - the sign, on purpose
    r"\s?(?:%|percent\b|[kMGTP]?FLOP/?s\b|[kMGTP]?FLOPS\b|[KMGTP]i?B/s\b|[KMGTP]i?B\b|bytes\b|"
    r"[nuµm]?s\b|sec(?:ond)?s?\b|min(?:ute)?s?\b|hours?\b|times (?:faster|slower)\b))")
# What a page may hold that is not a figure: generated blocks, figures, constants, code
# (fenced and inline), HTML comments and link targets.
NOT_PROSE = (re.compile(r"<!-- report:(\w+) -->.*?<!-- /report:\1 -->", re.S), FIGURE, CONSTANT,
             re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M), re.compile(r"`[^`\n]*`"),
             re.compile(r"<!--.*?-->", re.S), re.compile(r"\]\([^)\s]*\)"))


def hand_written_figures(page: str) -> list[str]:
    """`line N: text` for each measured-looking number (`MEASURED`) in `page`'s prose
    outside the generated blocks, figures, constants and code (`NOT_PROSE`)."""
    for pattern in NOT_PROSE:
        page = pattern.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), page)
    return [f"line {number}: {found[0].strip()}"
            for number, line in enumerate(page.splitlines(), 1)
            for found in MEASURED.finditer(line)]


def pages(readme: pathlib.Path = README, docs: pathlib.Path = DOCS) -> list[pathlib.Path]:
    """README.md, then every markdown page under `docs` in path order."""
    return [readme, *sorted(docs.rglob("*.md"))] if docs.is_dir() else [readme]


def _check_markers(texts: dict[pathlib.Path, str]) -> None:
    """Every table's markers appear on exactly one page."""
    for name in TABLES:
        found = [path.name for path, text in texts.items()
                 if f"<!-- report:{name} -->" in text]
        if len(found) != 1:
            raise SystemExit(f"the table <!-- report:{name} --> must be on exactly one page "
                             f"of README.md and docs/, found on {found or 'none'}")


def main(argv: list[str] | None = None, readme: pathlib.Path = README,
         docs: pathlib.Path = DOCS) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="fail when a page's tables or figures differ from the results files")
    args = parser.parse_args(argv)
    texts = {path: path.read_text() for path in pages(readme, docs)}
    _check_markers(texts)
    stale = []
    for path, current in texts.items():
        wanted = rendered(current)
        if wanted == current:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(wanted)
    if args.check:
        loose = [f"{path}: {where}" for path, text in texts.items()
                 for where in hand_written_figures(text)]
        for where in loose:
            print(f"{where}: a figure written by hand (put it in a <!--fig--> or "
                  "<!--const--> marker, or a generated table)", file=sys.stderr)
        if loose:
            return 1
        if stale:
            names = ", ".join(str(path) for path in stale)
            print(f"{names}: tables or figures differ from the results files: run "
                  "`python -m benchmarks.report`", file=sys.stderr)
            return 1
        print("README.md's and docs/'s tables match the results files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
