"""Writes the README's model table from the results files, or checks that it matches them.

    python -m benchmarks.report           # rewrite the table between the README's markers
    python -m benchmarks.report --check   # exit 1 when the README differs (CI runs this)

Each row comes from one run of `python -m benchmarks.models` (every variant of a model
in one process) named in `MODEL_ROWS`; every number in the table is read from that file,
and a variant that did not run says so instead of a number.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results" / "nvidia_h200"
BEGIN, END = "<!-- report:models -->", "<!-- /report:models -->"

# model -> the results file of its run of record.
MODEL_ROWS = {
    "llama": "models_llama.json",
    "mixtral": "models_llama_mixtral.json",
    "gemma2": "models_gemma2_encoder_llama.json",
    "encoder": "models_gemma2_encoder_llama.json",
}
VARIANTS = (("ours", "ours `None`"), ("optimize", "`optimize`"), ("tuned", "tuned"),
            ("upstream", "upstream Tokamax 0.0.17"))


def _cell(row: dict[str, Any], variant: str) -> str:
    value = row.get(variant)
    if not isinstance(value, dict):
        return "- (not run)"
    if "ms" not in value:
        return f"- ({value.get('skipped') or value.get('error', '')[:40]})"
    plain = row["plain"]["ms"]
    return f"{value['ms']:.2f} ms ({plain / value['ms']:.3f}x)"


def model_table() -> str:
    """The markdown table (with a line naming the device and files) from `MODEL_ROWS`."""
    header = ("| model | plain JAX | " + " | ".join(label for _, label in VARIANTS)
              + " | `autotune` (all implementations) | results file |")
    lines = [header, "|" + "---|" * (len(VARIANTS) + 4)]
    device = None
    for name, file in MODEL_ROWS.items():
        data = json.loads((RESULTS / file).read_text())
        device = data["device_kind"]
        row = data["models"][name]
        autotune = (f"{row['autotune_s']:.1f} s, {row['autotune_op_calls']} op calls"
                    if "autotune_s" in row else "-")
        lines.append(f"| {name} | {row['plain']['ms']:.2f} ms | "
                     + " | ".join(_cell(row, v) for v, _ in VARIANTS)
                     + f" | {autotune} | `{file}` |")
    intro = (f"{device}, one training step (`jax.grad` of the loss over all parameters), "
             "device time (CUPTI), median of 10 after warm-up; ratios are plain JAX's time "
             "over the variant's, every variant of a row measured in one process.")
    return intro + "\n\n" + "\n".join(lines)


def rendered(readme: str) -> str:
    """`readme` with the text between the markers replaced by the current table."""
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"README.md lacks the markers {BEGIN} ... {END}")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{model_table()}\n{END}{tail}"


def main(argv: list[str] | None = None, readme: pathlib.Path = README) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="fail when the README's table differs from the results files")
    args = parser.parse_args(argv)
    current = readme.read_text()
    wanted = rendered(current)
    if args.check:
        if wanted != current:
            print("README.md's model table differs from the results files: run "
                  "`python -m benchmarks.report`", file=sys.stderr)
            return 1
        print("README.md's model table matches the results files")
        return 0
    readme.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
