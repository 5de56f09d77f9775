"""Which op costs what inside a model: ours with one op family at a time swapped back to
plain JAX, timed in alternating rounds in one process.

    python -m benchmarks.models.ablation --only llama [--rounds 2] [--output FILE]
        [--set FIELD=VALUE ...]

Prints and writes (JSON lines) the device time of plain JAX, ours (`None`), and ours with
each op family (`rms_norm`, `add_rms_norm`, `layer_norm`, `attention`, `glu`, `moe_glu`,
`ragged_dot`, `lm_head_loss`) that the model calls taken from plain JAX; the op whose swap
closes the gap is where the time goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import jax

from benchmarks.models import MODELS, ops, run

OP_FAMILIES = ("rms_norm", "add_rms_norm", "layer_norm", "attention", "glu", "moe_glu",
               "ragged_dot", "lm_head_loss")


def _families_called(model, params, batch) -> list[str]:
    """The op families the model calls (traced once with a recording switch)."""
    called: set[str] = set()

    class Recording(ops.Plain):
        def __getattribute__(self, name):
            if name in OP_FAMILIES:
                called.add(name)
            return super().__getattribute__(name)

    jax.eval_shape(model.loss_fn(Recording(), smoke=True), params, batch)
    return [f for f in OP_FAMILIES if f in called]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.models.ablation",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=["llama"], choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="the smoke sizes (any machine)")
    parser.add_argument("--output", default="ablation.jsonl")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="resize the models' benchmark config (as `benchmarks.models`)")
    args = parser.parse_args(argv)
    ours = ops.variants()["ours"]
    with open(args.output, "w") as out:
        for name in args.only:
            model = run.resized(MODELS[name], args.set, parser.error)
            params, batch = run._inputs(model, smoke=args.tiny)
            small = run._inputs(model, smoke=True)
            variants = {"plain": ops.Plain(), "ours": ours}
            for family in _families_called(model, *small):
                variants[f"ours, plain {family}"] = ops.Swapped(ours, frozenset({family}))
            steps = {v: jax.jit(model.step_fn(o, smoke=args.tiny))
                     for v, o in variants.items()}
            for row in timed_in_rounds(name, steps, params, batch, args.rounds,
                                       args.iterations):
                out.write(json.dumps(row) + "\n")
                print(f"{name:8s} {row['variant']:28s} "
                      + " ".join(f"{t:8.2f}" for t in row["ms"])
                      + f"  ({row['vs_plain']:.3f}x)", flush=True)
    return 0


def timed_in_rounds(name: str, steps: dict[str, Any], params: Any, batch: Any, rounds: int,
                    iterations: int) -> list[dict[str, Any]]:
    """One row per variant of model `name`: its step's device times, `steps` timed in
    turn for `rounds` rounds (a drift of the device's speed weighs on all alike), and
    plain's median time over its median (`steps` holds a `"plain"` variant)."""
    times: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(rounds):
        for variant, step in steps.items():
            times[variant].append(run._device_ms(step, params, batch, iterations)["ms"])
    plain = statistics.median(times["plain"])
    return [{"model": name, "variant": variant, "ms": ms,
             "vs_plain": plain / statistics.median(ms)} for variant, ms in times.items()]


if __name__ == "__main__":
    sys.exit(main())
