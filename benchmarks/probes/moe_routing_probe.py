"""Device probe: `moe_dispatch` / `moe_combine` against the plain routing a user writes
(`x[order // k]`, `zeros.at[order].set(out)`, an einsum with the weights; autodiff's
transposes), forward+backward at several MoE shapes, and whether both give the same
values. The expert computation between them is left out (rows go straight to the
combine), so the times are the routing's own.

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/moe_routing_probe.py
Writes `$OUT/moe_routing_probe.jsonl`.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.models import ops
from tokamax_pass import benchmarking

# name: (tokens, top_k, width, experts)
SHAPES = {
    "mixtral suite layer": (16384, 2, 2048, 8),
    "Mixtral-8x7B width": (8192, 2, 4096, 8),
    "fine-grained top-8 of 64": (8192, 8, 2048, 64),
    "small": (2048, 2, 1024, 8),
}
SMOKE = {"smoke": (64, 2, 32, 4)}


def _case(tokens: int, top_k: int, width: int, experts: int) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (tokens, width), jnp.bfloat16)
    logits = jax.random.normal(keys[1], (tokens, experts))
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, -1), top_k)
    cotangents = (jax.random.normal(keys[2], (tokens * top_k, width), jnp.bfloat16),
                  jax.random.normal(keys[3], (tokens, width), jnp.bfloat16))
    library = ops.variants()["ours"]

    def routed(lib):
        def f(x, weights):
            rows, _, routing = lib.moe_dispatch(x, ids, experts)
            return rows, lib.moe_combine(rows * 2, routing, weights)

        def step(x, weights, cotangents):
            outputs, pullback = jax.vjp(f, x, weights)
            return outputs, pullback(cotangents)
        return jax.jit(step)

    records, values = [], {}
    for name, lib in (("plain", ops.Plain()), ("ours", library)):
        step = routed(lib)
        values[name] = jax.tree.leaves(step(x, weights, cotangents))
        data = benchmarking.benchmark(step, x, weights, cotangents, iterations=30)
        records.append(dict(variant=name, ms=data.median_evaluation_time_ms,
                            method=data.method))
    worst = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
                for a, b in zip(values["plain"], values["ours"], strict=True))
    records.append(dict(variant="agreement", max_abs_difference=worst,
                        bitwise=bool(worst == 0.0)))
    return records


def main(argv: list[str]) -> int:
    shapes = SMOKE if "--smoke" in argv else SHAPES
    path = os.path.join(os.environ.get("OUT", "/tmp"), "moe_routing_probe.jsonl")
    with open(path, "a") as f:
        for name, shape in shapes.items():
            for record in _case(*shape):
                record = dict(shape=name, tokens_topk_width_experts=shape, **record)
                print(json.dumps(record), flush=True)
                f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
