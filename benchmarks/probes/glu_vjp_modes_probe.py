"""Device probe: the jnp GLU against our XLA GLU under three ways of timing a backward.

`forward_and_vjp` with the output as its own cotangent and nothing between them (XLA may
fuse the backward with the product that made the cotangent), the same behind
`jax.lax.optimization_barrier` (the op benchmark's way, as upstream Tokamax does), and `jax.grad` of
a loss with a random cotangent (as in a model); five shapes, twice each (CUPTI, median after
warm-up).

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/glu_vjp_modes_probe.py
One JSON line per timing goes to `$OUT/glu_vjp_probe3.jsonl`.
"""

from __future__ import annotations

import functools
import json
import os

import jax

import tokamax_pass as tokamax
from benchmarks.probes._probe import timed
from benchmarks.probes.glu_vjp_variants_probe import (
    ACTIVATIONS,
    SHAPES,
    fwd_bwd,
    grad_only,
    inputs,
    plain,
)

OUT = os.environ.get("OUT", "/tmp")


def fwd_bwd_barrier(f):
    def run(x, w):
        out, pull = jax.vjp(f, x, w)
        out = jax.lax.optimization_barrier(out)
        return out, pull(out)
    return jax.jit(run)


def main():
    rows = []
    for name, m, k, n, act_name in SHAPES:
        act = ACTIVATIONS[act_name]
        x, w, ct, flops = inputs(m, k, n)
        fns = {"plain": functools.partial(plain, act=act)}
        for implementation in ("xla", None):
            fns[f"library_{str(implementation).lower()}"] = functools.partial(
                tokamax.gated_linear_unit, activation=act, implementation=implementation)
        modes = (("fwd+bwd", fwd_bwd, (x, w)), ("fwd+bwd barrier", fwd_bwd_barrier, (x, w)),
                 ("grad", grad_only, (x, w, ct)))
        for mode, wrap, args in modes:
            for rep in range(2):
                for variant, f in fns.items():
                    rec = dict(shape=name, m=m, k=k, n=n, act=act_name, mode=mode,
                               variant=variant, rep=rep)
                    timed(rec, wrap(f), args, flops)
                    print(json.dumps(rec), flush=True)
                    rows.append(rec)
    with open(f"{OUT}/glu_vjp_probe3.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
