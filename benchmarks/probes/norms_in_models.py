"""Device probe: do the Triton norms help or hurt inside a model's training step?

    PYTHONPATH=src:kernels:. python benchmarks/probes/norms_in_models.py \
        [--only llama encoder ...] [--rounds 3] [--out FILE.jsonl]

Alone, the Triton layer norm's forward+backward runs up to twice as fast as XLA's at
shapes the generalization benchmark draws; inside a model XLA fuses a norm with its
neighbours (the residual add before it, the gradient's add after it), which a kernel
cannot. This times each model's step four ways in alternating rounds, in one process:
plain JAX, ours (`None`), and ours with every norm (`rms_norm`, `add_rms_norm`,
`layer_norm`) forced to `implementation="triton"`, and to `"xla"`, forward and gradient.
One JSON line per model and variant (the rounds' times and the ratio of
plain's median to its median), after a provenance line, to `--out`
(default `$OUT/norms_in_models.jsonl`, else the working directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
from typing import Any

import jax

import tokamax_pass
from benchmarks import sweep
from benchmarks.models import MODELS, ops, run
from benchmarks.models.ablation import timed_in_rounds


@dataclasses.dataclass(frozen=True)
class ForcedNorms(ops.Library):
    """Our ops (`implementation=None`) with every norm forced to `implementation`."""

    implementation: str = "triton"

    def rms_norm(self, x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
        return tokamax_pass.layer_norm(x, scale, None, epsilon=eps, subtract_mean=False,
                                       implementation=self.implementation)

    def add_rms_norm(self, x: jax.Array, h: jax.Array, scale: jax.Array,
                     eps: float = 1e-6) -> Any:
        return tokamax_pass.layer_norm(h, scale, None, epsilon=eps, subtract_mean=False,
                                       residual=x, implementation=self.implementation)

    def layer_norm(self, x: jax.Array, scale: jax.Array, offset: jax.Array,
                   eps: float = 1e-6) -> jax.Array:
        return tokamax_pass.layer_norm(x, scale, offset, epsilon=eps,
                                       implementation=self.implementation)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.norms_in_models",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=["llama", "encoder", "gemma2"],
                        choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(os.environ.get("OUT", ".")) / "norms_in_models.jsonl")
    args = parser.parse_args()
    variants = {"plain": ops.Plain(), "ours": ops.Library(tokamax_pass, "ours"),
                "ours, triton norms": ForcedNorms(tokamax_pass, "ours", "triton"),
                "ours, xla norms": ForcedNorms(tokamax_pass, "ours", "xla")}
    with args.out.open("w") as out:
        out.write(json.dumps({"provenance": {
            "commit": sweep.source_commit(), "jax": jax.__version__,
            "device_kind": jax.devices()[0].device_kind}}) + "\n")
        for name in args.only:
            model = MODELS[name]
            params, batch = run._inputs(model, smoke=False)
            steps = {v: jax.jit(model.step_fn(o, smoke=False)) for v, o in variants.items()}
            for row in timed_in_rounds(name, steps, params, batch, args.rounds,
                                       args.iterations):
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
