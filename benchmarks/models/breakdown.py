"""Where a model's training step spends its device time, kernel by kernel.

    python -m benchmarks.models.breakdown --only llama [--variants plain,ours] [--output F]

Traces a few steps of each variant with `jax.profiler`, sums every device kernel's time
per step, and sorts them into categories: GEMMs (cuBLAS and XLA's Triton GEMMs), attention
(cuDNN, our flash kernels), other Pallas kernels, XLA fusions (elementwise, reductions),
and the rest (copies, sorts, scatters). The step's total is the sum of its kernels (busy
time; the idle gaps between kernels are counted apart). This says what a kernel library
could still gain in a model: only the categories it replaces. Each of the top kernels
that is an XLA fusion also carries what it computes (`hlo`: its operand and result shapes
and the JAX ops it was made of), so a slow fusion can be traced back to the model's code.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from typing import Any

import jax

from benchmarks.models import MODELS, ops, run
from benchmarks.sweep import source_commit
from tokamax_pass import benchmarking

# First match wins; tested against the kernel's name and its HLO op's name together.
CATEGORIES = (
    ("attention", re.compile(r"cudnn|fmha|flash|attention|_fwd_kernel|_bwd_kernel|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|cublas|\bdot|matmul|ragged", re.I)),
    ("pallas kernel", re.compile(r"mosaic|triton|pallas|custom-call", re.I)),
    ("xla fusion", re.compile(r"fusion|reduce|convert|multiply|add|exponential", re.I)),
)


def category(kernel: str, hlo_op: str) -> str:
    """The category of one device kernel (see `CATEGORIES`); "other" when none matches."""
    text = f"{kernel} {hlo_op}"
    for name, pattern in CATEGORIES:
        if pattern.search(text):
            return name
    return "other"


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) fusion\(.*calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]+)"')


def fusion_descriptions(hlo_text: str) -> dict[str, str]:
    """`fusion instruction name -> "(operand shapes) -> result shape: jax ops"` for every
    fusion of a compiled module's text (under its HLO name and its kernel name); the JAX
    ops are the distinct `op_name`s of the fused computation's instructions with the
    `jit(...)/` prefix dropped."""
    headers: dict[str, str] = {}
    ops_of: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line.startswith("%") and line.rstrip().endswith("{"):
            current = line[1:].split(" ", 1)[0]
            headers[current] = line.split(" ", 1)[1].rsplit("{", 1)[0].strip()
            ops_of[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            for op_name in _OP_NAME.findall(line):
                op = op_name.split(")/", 1)[-1]
                if op not in ops_of[current]:
                    ops_of[current].append(op)
    found = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match and match.group(3) in headers:
            name, computation = match.group(1), match.group(3)
            signature = re.sub(r"[\w.\-]+: ", "", headers[computation])
            described = f"{signature}: {', '.join(ops_of[computation][:8])}"[:500]
            # A GPU kernel is named after its fusion with "." spelled "_".
            found[name] = found[name.replace(".", "_")] = described
    return found


def profile_step(step: Any, args: tuple, steps: int) -> dict[str, Any]:
    """Per-step device time of `step(*args)` (a jitted function), by category and kernel."""
    compiled = step.lower(*args).compile()
    fusions = fusion_descriptions(compiled.as_text())
    module = compiled.as_text().split("HloModule ", 1)[-1].split(",", 1)[0].split(" ", 1)[0]
    jax.block_until_ready(compiled(*args))
    jax.block_until_ready(compiled(*args))
    events = [(name, str(stats["hlo_op"]), start, duration)
              for name, stats, start, duration in benchmarking.traced_hlo_ops(
                  lambda: compiled(*args), steps)
              if str(stats.get("hlo_module", "")).startswith(module)]
    if not events:
        raise RuntimeError(f"the profiler recorded no device kernels of {module}")
    per_kernel: dict[tuple[str, str], float] = collections.defaultdict(float)
    for name, hlo_op, _, duration in events:
        per_kernel[(category(name, hlo_op), f"{hlo_op} | {name[:120]}")] += duration / steps
    by_category: dict[str, float] = collections.defaultdict(float)
    for (cat, _), ns in per_kernel.items():
        by_category[cat] += ns
    busy = sum(by_category.values())
    spans = sorted((start, start + duration) for _, _, start, duration in events)
    wall = (spans[-1][1] - spans[0][0]) / steps
    top = sorted(per_kernel.items(), key=lambda item: -item[1])[:40]
    return {
        "module": module,
        "busy_ms": busy / 1e6,
        "span_ms": wall / 1e6,
        "categories_ms": {k: v / 1e6 for k, v in sorted(by_category.items(),
                                                        key=lambda kv: -kv[1])},
        "top_kernels": [{"category": cat, "kernel": kernel, "ms": ns / 1e6,
                         **({"hlo": fusions[name]} if name in fusions else {})}
                        for (cat, kernel), ns in top
                        for name in [kernel.split(" | ", 1)[-1]]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.models.breakdown",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=["llama"], choices=sorted(MODELS))
    parser.add_argument("--variants", default="plain,ours")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the smoke sizes (any machine)")
    parser.add_argument("--output", default="breakdown.json")
    args = parser.parse_args(argv)
    switch = ops.variants(upstream=True)
    results: dict[str, Any] = {"provenance": {"commit": source_commit()},
                               "device_kind": jax.devices()[0].device_kind,
                               "jax": jax.__version__, "models": {}}
    for name in args.only:
        model = MODELS[name]
        params, batch = run._inputs(model, smoke=args.tiny)
        for variant in args.variants.split(","):
            if variant not in switch:
                continue
            step = jax.jit(model.step_fn(switch[variant], smoke=args.tiny))
            found = profile_step(step, (params, batch), args.steps)
            results["models"].setdefault(name, {})[variant] = found
            cats = ", ".join(f"{k} {v:.2f}" for k, v in found["categories_ms"].items())
            print(f"{name} {variant}: busy {found['busy_ms']:.2f} ms, span "
                  f"{found['span_ms']:.2f} ms; {cats}", flush=True)
            with open(args.output, "w") as out:
                json.dump(results, out, indent=1)
        jax.clear_caches()
    return 0


if __name__ == "__main__":
    sys.exit(main())
