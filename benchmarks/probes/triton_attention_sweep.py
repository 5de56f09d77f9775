"""Device sweep for the Pallas Triton flash-attention kernels (run on the H200, by hand).

`PYTHONPATH=src:kernels:. python3 benchmarks/probes/triton_attention_sweep.py [OUT_DIR]` times the
forward and the two backward kernels over small config grids at the benchmark shapes,
beside cuDNN in the same process, checks the best configs against a float32 XLA
reference and a bitwise rerun, and writes `triton_attention_sweep.json`. It imports
only the kernel modules, so it runs without the rest of the package. Its numbers
chose the H200 heuristics in `pallas_triton.py` / `pallas_triton_vjp.py`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

_HERE = os.path.dirname(os.path.abspath(__file__))
_PKG = os.path.join(_HERE, "..", "..", "kernels", "tokamax_kernels")
# Load the kernel modules without running the package __init__ files.
for _name, _path in (("tokamax_kernels", _PKG), ("tokamax_kernels.attention",
                                                  os.path.join(_PKG, "attention"))):
    _module = types.ModuleType(_name)
    _module.__path__ = [_path]
    sys.modules.setdefault(_name, _module)

from tokamax_kernels.attention import _triton_common as common  # noqa: E402
from tokamax_kernels.attention._triton_bwd import flash_attention_backward  # noqa: E402
from tokamax_kernels.attention._triton_fwd import flash_attention_forward  # noqa: E402

START = time.time()
BUDGET_S = float(os.environ.get("SWEEP_BUDGET_S", "250"))
SHAPES = {
    "b32_s2048_h16_d64": (32, 2048, 16, 64, False),
    "b4_s8192_h16_d128": (4, 8192, 16, 128, False),
    "b4_s8192_h16_d128_causal": (4, 8192, 16, 128, True),
}
FWD = {
    64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
}
BWD = {  # ((dkv bq, bk, warps, stages), (dq bq, bk, warps, stages))
    64: [((64, 128, 8, 3), (128, 64, 8, 3)), ((32, 128, 4, 3), (128, 32, 4, 3)),
         ((64, 64, 4, 3), (64, 64, 4, 3)), ((64, 128, 4, 2), (128, 64, 4, 2))],
    128: [((64, 128, 8, 2), (128, 64, 8, 2)), ((32, 128, 4, 2), (128, 32, 4, 2)),
          ((64, 64, 4, 2), (64, 64, 4, 2)), ((64, 128, 8, 3), (128, 64, 8, 3))],
}


def flops(b: int, s: int, h: int, d: int, causal: bool) -> float:
    return 4 * b * h * s * s * d / (2 if causal else 1)


def spec_for(s: int, d: int, causal: bool) -> common.KernelSpec:
    return common.KernelSpec(
        scale=d ** -0.5, left=None, right=0 if causal else None, offset=0, soft_cap=None,
        seq_q=s, seq_k=s, has_bias=False, has_mask=False, has_q_lengths=False,
        has_kv_lengths=False, precision=None)


def fwd_fn(spec, cfg, return_lse):
    bq, bk, w, st = cfg

    def f(q, k, v):
        return flash_attention_forward(q, k, v, None, None, None, None, spec=spec, block_q=bq,
                                       block_k=bk, num_warps=w, num_stages=st,
                                       return_lse=return_lse, interpret=False)
    return f


def bwd_fn(spec, pair):
    (bq1, bk1, w1, s1), (bq2, bk2, w2, s2) = pair

    def f(q, k, v, out, do, lse):
        delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))
        lse2 = jnp.where(jnp.isfinite(lse), lse * common.LOG2E, jnp.inf)
        dq, dk, dv, _ = flash_attention_backward(
            q, k, v, None, None, None, None, do, lse2, delta, spec=spec, blocks_dkv=(bq1, bk1),
            blocks_dq=(bq2, bk2), params_dkv=(w1, s1), params_dq=(w2, s2), interpret=False)
        return dq, dk, dv
    return f


def compile_all(fns, args):
    """Compiles `fns` (name -> fn) concurrently; failures are kept as strings."""
    def one(fn):
        try:
            return jax.jit(fn).lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            return f"{type(e).__name__}: {str(e)[:300]}"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return dict(zip(fns, pool.map(one, fns.values()), strict=True))


def time_kernels(compiled, args, iterations):
    """Median device ms per kernel-name group, and the median total."""
    _, timings = profiler.measure(compiled, aggregate=False, iterations=iterations)(*args)
    totals = [sum(t for _, t in it) for it in timings]
    groups: dict[str, list[float]] = {}
    for it in timings:
        per: dict[str, float] = {}
        for name, t in it:
            key = "dkdv" if "dkdv" in name else "dq" if "_dq" in name else (
                "fwd" if "fwd" in name else "other")
            per[key] = per.get(key, 0.0) + t
        for key, t in per.items():
            groups.setdefault(key, []).append(t)
    return statistics.median(totals), {k: statistics.median(v) for k, v in groups.items()}


def rel_err(x, ref):
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def reference(q, k, v, do, causal):
    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    with jax.default_matmul_precision("highest"):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        out, pull = jax.vjp(f, *f32)
        return (out, *pull(do.astype(jnp.float32)))


def run_shape(name, results):
    b, s, h, d, causal = SHAPES[name]
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys)
    spec = spec_for(s, d, causal)
    fl = flops(b, s, h, d, causal)
    iters = 8 if s >= 8192 else 15
    row: dict = {"shape": name, "fwd": {}, "fwd_lse": {}, "bwd": {}}

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    def cudnn_fb(q, k, v, do):
        out, pull = jax.vjp(cudnn, q, k, v)
        return out, *pull(do)
    for label, fn, args in (("cudnn_fwd", cudnn, (q, k, v)), ("cudnn_fwdbwd", cudnn_fb,
                                                             (q, k, v, do))):
        try:
            ms, _ = time_kernels(jax.jit(fn).lower(*args).compile(), args, iters)
            mult = 3.5 if "bwd" in label else 1.0
            row[label] = {"ms": ms, "tflops": mult * fl / ms / 1e9}
        except Exception as e:  # noqa: BLE001
            row[label] = f"{type(e).__name__}: {str(e)[:200]}"
    cfgs = FWD[d] if not causal else FWD[d][:3]
    fns = {("fwd_lse", c): fwd_fn(spec, c, True) for c in cfgs}
    compiled = compile_all(fns, (q, k, v))
    for (kind, c), exe in compiled.items():
        if time.time() - START > BUDGET_S:
            break
        if isinstance(exe, str):
            row[kind][str(c)] = exe
            continue
        ms, _ = time_kernels(exe, (q, k, v), iters)
        row[kind][str(c)] = {"ms": ms, "tflops": fl / ms / 1e9}
    ok = {c: r for c, r in row["fwd_lse"].items() if isinstance(r, dict)}
    best_fwd = eval(min(ok, key=lambda c: ok[c]["ms"]))
    out, lse = jax.jit(fwd_fn(spec, best_fwd, True))(q, k, v)
    plain = jax.jit(fwd_fn(spec, best_fwd, False)).lower(q, k, v).compile()
    ms, _ = time_kernels(plain, (q, k, v), iters)
    row["fwd"][str(best_fwd)] = {"ms": ms, "tflops": fl / ms / 1e9}
    pairs = BWD[d] if not causal else BWD[d][:3]
    bargs = (q, k, v, out, do, lse)
    compiled = compile_all({p: bwd_fn(spec, p) for p in pairs}, bargs)
    for p, exe in compiled.items():
        if time.time() - START > BUDGET_S:
            break
        if isinstance(exe, str):
            row["bwd"][str(p)] = exe
            continue
        ms, per = time_kernels(exe, bargs, iters)
        row["bwd"][str(p)] = {"ms": ms, "per_kernel": per}
    okb = {p: r for p, r in row["bwd"].items() if isinstance(r, dict)}
    if okb:
        # Best dkv and best dq may come from different pairs: combine them.
        best_dkv = min(okb, key=lambda p: okb[p]["per_kernel"].get("dkdv", 1e9))
        best_dq = min(okb, key=lambda p: okb[p]["per_kernel"].get("dq", 1e9))
        pair = (eval(best_dkv)[0], eval(best_dq)[1])
        fwd_ms = row["fwd_lse"][str(best_fwd)]["ms"]
        bwd_exe = jax.jit(bwd_fn(spec, pair)).lower(*bargs).compile()
        bwd_ms, per = time_kernels(bwd_exe, bargs, iters)
        dq, dk, dv = bwd_exe(*bargs)
        dq2, dk2, dv2 = bwd_exe(*bargs)
        bitwise = all(bool(jnp.array_equal(x, y)) for x, y in ((dq, dq2), (dk, dk2), (dv, dv2)))
        one = slice(0, 1)
        ref = reference(q[one], k[one], v[one], do[one], causal)
        row["best"] = {
            "fwd": best_fwd, "bwd": pair, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "bwd_per": per,
            "fwd_tflops": row["fwd"][str(best_fwd)]["tflops"],
            "fwdbwd_tflops": 3.5 * fl / (fwd_ms + bwd_ms) / 1e9, "bitwise_rerun": bitwise,
            "rel_err": {n: rel_err(x[one], r) for n, x, r in
                        zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref, strict=True)},
        }
    results.append(row)
    print(json.dumps(row), flush=True)


def _commit() -> str:
    """The git commit of the code that measured (`"unknown"` outside a checkout)."""
    run = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=_HERE, check=False)
    return run.stdout.strip() or "unknown"


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    results: list = []
    for name in SHAPES:
        if time.time() - START > BUDGET_S:
            break
        try:
            run_shape(name, results)
        except Exception as e:  # noqa: BLE001 - keep the other shapes' results
            results.append({"shape": name, "error": f"{type(e).__name__}: {str(e)[:500]}"})
            print(results[-1], flush=True)
        with open(os.path.join(out_dir, "triton_attention_sweep.json"), "w") as f:
            json.dump({"provenance": {"commit": _commit()}, "device": jax.devices()[0].device_kind,
                       "results": results}, f, indent=1)
    print(f"total {time.time() - START:.0f}s")


if __name__ == "__main__":
    main()
