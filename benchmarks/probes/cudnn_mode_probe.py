"""Device probe: our cuDNN attention against `jax.nn`'s, alternated in one process, in
three timing modes (forward+backward with the output as its cotangent, without and
behind an optimization barrier, and `jax.grad` with a random cotangent), at three
shapes, twice each: is a gap in one benchmark run the op or run-to-run variance?

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/cudnn_mode_probe.py
Writes `$OUT/cudnn_mode_probe.jsonl`.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from benchmarks.probes._probe import timed

OUT = os.environ.get("OUT", "/tmp")
SHAPES = ((4, 8192, 16, 128, False), (4, 8192, 16, 128, True), (32, 2048, 16, 64, False))


def fwd_bwd(f, barrier):
    def run(q, k, v):
        out, pull = jax.vjp(f, q, k, v)
        if barrier:
            out = jax.lax.optimization_barrier(out)
        return out, pull(out)
    return jax.jit(run)


def grad(f):
    def run(q, k, v, ct):
        return jax.grad(lambda q, k, v: jnp.sum((f(q, k, v) * ct).astype(jnp.float32)),
                        argnums=(0, 1, 2))(q, k, v)
    return jax.jit(run)


def main():
    rows = []
    for b, s, h, d, causal in SHAPES:
        q, k, v, ct = (jax.random.normal(jax.random.key(i), (b, s, h, d), jnp.bfloat16)
                       for i in range(4))
        flops = 4 * b * h * s * s * d * 3.5 / (2 if causal else 1)
        fns = {"jax.nn cudnn": lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                   q, k, v, is_causal=c, implementation="cudnn"),
               "tokamax cudnn": lambda q, k, v, c=causal: tokamax.dot_product_attention(
                   q, k, v, is_causal=c, implementation="cudnn")}
        for rep in range(2):
            for mode in ("no barrier", "barrier", "grad"):
                for name, f in fns.items():
                    rec = dict(b=b, s=s, h=h, d=d, causal=causal, mode=mode, impl=name, rep=rep)
                    wrapped = grad(f) if mode == "grad" else fwd_bwd(f, mode == "barrier")
                    timed(rec, wrapped, (q, k, v, ct) if mode == "grad" else (q, k, v), flops)
                    print(json.dumps(rec), flush=True)
                    rows.append(rec)
    with open(f"{OUT}/cudnn_mode_probe.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
