"""Device probe: ways to write the dense GLU gradient, against the jnp expression.

Each variant is a `jax.custom_vjp` of `activation(x @ w[:, 0]) * (x @ w[:, 1])` on fused
(K, 2, N) weights: the forward as one (K, 2N) GEMM or two; the products saved or
recomputed; the four gradient GEMMs written by hand (einsums, the two weight gradients
stacked) or as autodiff of `(x @ w[:, 0], x @ w[:, 1])` makes them. Timed forward+backward
(the output as its own cotangent) and inside `jax.grad` with a random cotangent (as in a
model), at five shapes, twice each (CUPTI, median after warm-up).

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/glu_vjp_variants_probe.py
One JSON line per timing goes to `$OUT/glu_vjp_probe2.jsonl`.
"""

from __future__ import annotations

import functools
import json
import math
import os

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from benchmarks.probes._probe import timed

OUT = os.environ.get("OUT", "/tmp")
F32 = jnp.float32
SHAPES = [("llama", 16384, 2048, 5632, "swish"), ("gemma2", 16384, 2304, 9216, "gelu"),
          ("8b", 8192, 4096, 14336, "swish"), ("small", 4096, 1024, 2816, "swish"),
          ("odd", 6000, 1536, 4000, "gelu")]
ACTIVATIONS = {"swish": jax.nn.swish, "gelu": functools.partial(jax.nn.gelu, approximate=True)}


def plain(x, w, act):
    return act(x @ w[:, 0]) * (x @ w[:, 1])


def products(x, w, fused):
    if fused:
        k, _, n = w.shape
        both = x @ w.reshape(k, 2 * n)
        return both[..., :n], both[..., n:]
    return x @ w[:, 0], x @ w[:, 1]


def make(act, fwd_fused, keep, bwd_gemms, wide=True):
    """`fwd_fused`: the forward's products as one GEMM; `keep`: (gate, up) saved as
    residuals; `bwd_gemms`: "autodiff" (`jax.vjp` of the two products) or "manual";
    `wide`: the elementwise math in float32."""
    cast = (lambda a: a.astype(F32)) if wide else (lambda a: a)

    def out_of(g, u, dtype):
        return (act(cast(g)) * cast(u)).astype(dtype)

    @jax.custom_vjp
    def glu(x, w):
        return out_of(*products(x, w, True), x.dtype)

    def fwd(x, w):
        g, u = products(x, w, fwd_fused)
        return out_of(g, u, x.dtype), (x, w, (g, u) if keep else None)

    def bwd(res, dout):
        x, w, gu = res
        g, u = gu if gu is not None else products(x, w, fwd_fused)
        a, act_vjp = jax.vjp(act, cast(g))
        dy = cast(dout)
        (dg,) = act_vjp(dy * cast(u))
        dg, du = dg.astype(x.dtype), (dy * a).astype(x.dtype)
        if bwd_gemms == "autodiff":
            _, pull = jax.vjp(lambda x, w: products(x, w, False), x, w)
            return pull((dg, du))
        wg, wu = w[:, 0], w[:, 1]
        dx = dg @ wg.T + du @ wu.T
        dw = jnp.stack([jnp.einsum("mk,mn->kn", x, dg), jnp.einsum("mk,mn->kn", x, du)], axis=1)
        return dx, dw

    glu.defvjp(fwd, bwd)
    return glu


def fwd_bwd(f):
    def run(x, w):
        out, pull = jax.vjp(f, x, w)
        return out, pull(out)
    return jax.jit(run)


def grad_only(f):
    """As in a model: the output feeds a loss; only gradients leave the program."""
    def run(x, w, ct):
        return jax.grad(lambda x, w: jnp.sum((f(x, w) * ct).astype(F32)), argnums=(0, 1))(x, w)
    return jax.jit(run)


def inputs(m, k, n):
    """`(x, w, ct, flops)`: random bf16 x (m, k), fused weights (k, 2, n) scaled by
    1/sqrt(k), a random cotangent (m, n), and the forward+backward FLOPs."""
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (k, 2, n), F32) / math.sqrt(k)).astype(
        jnp.bfloat16)
    ct = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
    return x, w, ct, 2 * m * k * 2 * n * 3


def main():
    rows = []
    for name, m, k, n, act_name in SHAPES:
        act = ACTIVATIONS[act_name]
        x, w, ct, flops = inputs(m, k, n)
        fns = {"plain": functools.partial(plain, act=act),
               "current": make(act, True, False, "manual"),
               "A_two_keep_auto": make(act, False, True, "autodiff"),
               "A2_fused_keep_auto": make(act, True, True, "autodiff"),
               "A3_fused_recompute_auto": make(act, True, False, "autodiff"),
               "A4_two_recompute_auto": make(act, False, False, "autodiff"),
               "A5_two_keep_manual": make(act, False, True, "manual"),
               "A_bf16": make(act, False, True, "autodiff", wide=False),
               "library_xla": lambda x, w, act=act: tokamax.gated_linear_unit(
                   x, w, activation=act, implementation="xla")}
        for mode, wrap, args in (("fwd+bwd", fwd_bwd, (x, w)), ("grad", grad_only, (x, w, ct))):
            ref = None
            for rep in range(2):
                for variant, f in fns.items():
                    rec = dict(shape=name, m=m, k=k, n=n, act=act_name, mode=mode,
                               variant=variant, rep=rep)
                    res = timed(rec, wrap(f), args, flops)
                    if res is not None and rep == 0 and mode == "fwd+bwd":
                        if ref is None:
                            ref = res
                        else:
                            rec["rel_err_vs_plain"] = max(
                                float(jnp.max(jnp.abs(a.astype(F32) - b.astype(F32)))
                                      / (jnp.max(jnp.abs(b.astype(F32))) + 1e-6))
                                for a, b in zip(jax.tree.leaves(res), jax.tree.leaves(ref),
                                                strict=True))
                    print(json.dumps(rec), flush=True)
                    rows.append(rec)
    with open(f"{OUT}/glu_vjp_probe2.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
