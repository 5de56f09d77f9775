"""Device probe for the Mosaic GPU attention kernels: numerics and CUPTI timings vs cuDNN.

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/mosaic_attention_probe.py [phase ...]
Each phase runs in its own subprocess with a timeout (a deadlocked kernel costs one
phase, not the run) and appends JSON lines to `$OUT/mosaic_attention.jsonl`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

OUT = os.environ.get("OUT", "/tmp")
PHASES = {"small": 95, "bench_d64": 62, "bench_d128": 62, "bench_d128_causal": 62,
          "compile_d128": 60, "run_d128": 40, "run_d128_wgs1": 40, "quick_d128": 45,
          "quick_d128_causal": 55, "heads_gqa": 40, "heads_mha": 40,
          "op_gqa": 60}


def _log(record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(os.path.join(OUT, "mosaic_attention.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _setup():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tokamax_kernels.attention import (
        DotProductAttention,
        PallasMosaicGpuFlashAttention,
        PallasMosaicGpuFlashAttentionVjp,
    )
    return jax, jnp, np, DotProductAttention, PallasMosaicGpuFlashAttention, \
        PallasMosaicGpuFlashAttentionVjp


def _inputs(jax, jnp, b, sq, sk, h, hk, d, dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, sk, hk, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, sk, hk, d), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (b, sq, h, d), jnp.float32).astype(dtype)
    return q, k, v, do


def _fwd_bwd(jax, op, causal):
    def f(q, k, v, do):
        out, pullback = jax.vjp(lambda q, k, v: op(q, k, v, is_causal=causal), q, k, v)
        return (out, *pullback(do))
    return jax.jit(f)


def _rel(np, a, b) -> float:
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


def _reference(jax, jnp, DPA, q, k, v, do, causal):
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    with jax.default_matmul_precision("highest"):
        ref = DPA()
        scale = 1.0 / float(q.shape[-1]) ** 0.5

        def fwd(q, k, v):
            return ref._fwd(q, k, v, None, None, scale=scale, is_causal=causal,
                            query_seq_lengths=None, key_value_seq_lengths=None,
                            local_window_size=None, logits_soft_cap=None, precision=None,
                            config=None, return_residuals=True)

        (out, (lse,)), pullback = jax.vjp(lambda q, k, v: fwd(q, k, v), *f32[:3])
        grads = pullback(((f32[3]), (jnp.zeros_like(lse),)))
    return out, lse, grads


def phase_small() -> None:
    jax, jnp, np, DPA, Fwd, Vjp = _setup()
    from tokamax_kernels.attention._mosaic_gpu_fwd_kernel import mosaic_attention_forward
    cases = [  # b, sq, sk, h, hk, d, causal, backward
        (2, 256, 256, 4, 4, 64, False, True), (2, 256, 256, 4, 4, 64, True, True),
        (2, 256, 256, 4, 2, 128, False, True), (2, 384, 384, 4, 2, 128, True, True),
        (1, 256, 256, 4, 1, 64, True, True), (1, 256, 512, 2, 2, 64, True, True),
        (1, 512, 256, 2, 1, 128, False, True), (1, 256, 256, 2, 2, 256, False, False),
        (1, 256, 256, 2, 1, 256, True, False),
    ]
    for b, sq, sk, h, hk, d, causal, backward in cases:
        case = dict(phase="small", shape=[b, sq, sk, h, hk, d], causal=causal)
        try:
            t0 = time.time()
            q, k, v, do = _inputs(jax, jnp, b, sq, sk, h, hk, d, jnp.bfloat16)
            out_r, lse_r, grads_r = _reference(jax, jnp, DPA, q, k, v, do, causal)
            op = Fwd()
            ba = op.bind(q, k, v, is_causal=causal)
            config = op._get_heuristics_config(ba)
            out, lse = jax.jit(functools.partial(
                mosaic_attention_forward, scale=d ** -0.5, causal=causal, config=config))(q, k, v)
            case.update(config=str(config), out=_rel(np, out, out_r),
                        lse=float(np.max(np.abs(np.asarray(lse) - np.asarray(lse_r)))))
            if backward:
                res = _fwd_bwd(jax, op, causal)(q, k, v, do)
                res2 = _fwd_bwd(jax, op, causal)(q, k, v, do)
                case.update({n: _rel(np, g, r) for n, g, r in
                             zip(("dq", "dk", "dv"), res[1:], grads_r, strict=True)})
                case["bitwise_rerun"] = all(
                    bool(np.array_equal(np.asarray(a), np.asarray(c)))
                    for a, c in zip(res, res2, strict=True))
            case["s"] = round(time.time() - t0, 1)
        except Exception as e:  # noqa: BLE001 - report and go on to the next case
            case["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        _log(case)


def phase_heads(name: str) -> None:
    """Each kernel alone at the shape where GQA was seen to hang (B=2, S=256, H=4, D=128),
    with Hkv=2 (`heads_gqa`) or 4 (`heads_mha`): a line after each compile and each run,
    so the last line names the kernel (and the stage) that does not finish."""
    jax, jnp, np, DPA, Fwd, Vjp = _setup()
    from tokamax_kernels.attention._mosaic_gpu_bwd_kernels import (
        mosaic_attention_dkv,
        mosaic_attention_dq,
    )
    from tokamax_kernels.attention._mosaic_gpu_fwd_kernel import mosaic_attention_forward
    F, B = _configs()
    kv_heads = 2 if name == "heads_gqa" else 4
    q, k, v, do = _inputs(jax, jnp, 2, 256, 256, 4, kv_heads, 128, jnp.bfloat16)
    statics = dict(scale=128 ** -0.5, causal=False)

    def step(kernel: str, f, *args):
        t0 = time.time()
        compiled = jax.jit(f).lower(*args).compile()
        _log(dict(phase=name, kernel=kernel, compiled_s=round(time.time() - t0, 1)))
        t0 = time.time()
        out = jax.block_until_ready(compiled(*args))
        _log(dict(phase=name, kernel=kernel, ran_s=round(time.time() - t0, 2)))
        return out

    out, lse = step("forward", functools.partial(
        mosaic_attention_forward, config=F(block_q=64, block_kv=128), **statics), q, k, v)
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))
    step("dq", functools.partial(mosaic_attention_dq, config=B(), **statics),
         q, k, v, do, lse, delta)
    step("dkv", functools.partial(mosaic_attention_dkv, config=B(), **statics),
         q, k, v, do, lse, delta)


def phase_op_gqa() -> None:
    """The GQA shape through the op (forward alone, then forward + VJP) and through the
    three kernels in one jitted program: the kernels alone finish (`heads_gqa`), so the
    last line says which combination does not."""
    jax, jnp, np, DPA, Fwd, Vjp = _setup()
    from tokamax_kernels.attention._mosaic_gpu_bwd_kernels import (
        mosaic_attention_dkv,
        mosaic_attention_dq,
    )
    from tokamax_kernels.attention._mosaic_gpu_fwd_kernel import mosaic_attention_forward
    F, B = _configs()
    q, k, v, do = _inputs(jax, jnp, 2, 256, 256, 4, 2, 128, jnp.bfloat16)
    statics = dict(scale=128 ** -0.5, causal=False)

    def one_program(q, k, v, do):
        out, lse = mosaic_attention_forward(q, k, v, config=F(block_q=64, block_kv=128),
                                            **statics)
        delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))
        dq = mosaic_attention_dq(q, k, v, do, lse, delta, config=B(), **statics)
        return out, dq, *mosaic_attention_dkv(q, k, v, do, lse, delta, config=B(), **statics)

    stages = [("op_forward", jax.jit(Fwd()), (q, k, v)),
              ("kernels_one_program", jax.jit(one_program), (q, k, v, do)),
              ("op_forward_and_vjp", _fwd_bwd(jax, Fwd(), False), (q, k, v, do))]
    for stage, f, args in stages:
        _log(dict(phase="op_gqa", stage=stage, started=True))
        t0 = time.time()
        jax.block_until_ready(f(*args))
        _log(dict(phase="op_gqa", stage=stage, done_s=round(time.time() - t0, 1)))


def _time(jax, np, f, args, iterations=10):
    from jax.experimental.mosaic.gpu import profiler
    out = jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    _, times = profiler.measure(f, iterations=iterations)(*args)
    return out, float(np.median(times)), float(np.min(times))


def _bench(name, b, s, h, d, causal, fwd_configs, bwd_configs) -> None:
    jax, jnp, np, DPA, Fwd, Vjp = _setup()
    q, k, v, do = _inputs(jax, jnp, b, s, s, h, h, d, jnp.bfloat16)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    # Reference on batch element 0 only (the f32 logits of the full batch are too big).
    out_r, _, grads_r = _reference(jax, jnp, DPA, *(x[:1] for x in (q, k, v, do)), causal)
    ref = (out_r, *grads_r)

    def record(impl, mode, f, args):
        rec = dict(phase=name, impl=impl, mode=mode)
        try:
            res, med, best = _time(jax, np, f, args)
            n = 1 if mode == "fwd" else 3.5
            rec.update(ms=round(med, 4), min_ms=round(best, 4),
                       tflops=round(n * flops / med / 1e9, 1))
            res = res if isinstance(res, tuple) else (res,)
            rec["rel_err"] = [round(_rel(np, a[:1], r), 5) for a, r in zip(res, ref, strict=False)]
            if mode == "fwd+bwd" and impl.startswith("mosaic"):
                again = f(*args)
                rec["bitwise_rerun"] = all(bool(np.array_equal(np.asarray(a), np.asarray(c)))
                                           for a, c in zip(res, again, strict=True))
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        _log(rec)

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    record("cudnn", "fwd", jax.jit(cudnn), (q, k, v))
    record("cudnn", "fwd+bwd", _fwd_bwd(jax, cudnn_op(jax, causal), causal), (q, k, v, do))
    for config in fwd_configs:
        op = Fwd(config=config)
        record(f"mosaic {config}", "fwd", jax.jit(lambda q, k, v, op=op: op(
            q, k, v, is_causal=causal)), (q, k, v))
    fwd_op = Fwd(config=fwd_configs[0])
    for config in bwd_configs:
        op = fwd_op.replace(vjp=Vjp(config=config))
        record(f"mosaic {config}", "fwd+bwd", _fwd_bwd(jax, op, causal), (q, k, v, do))
    record("cudnn", "fwd (again)", jax.jit(cudnn), (q, k, v))


def cudnn_op(jax, causal):
    def op(q, k, v, is_causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, implementation="cudnn")
    return op


def _configs():
    from tokamax_kernels.attention._mosaic_gpu_common import (
        MosaicAttentionConfig as F,
    )
    from tokamax_kernels.attention._mosaic_gpu_common import (
        MosaicAttentionVjpConfig as B,
    )
    return F, B


def phase_d128(name: str) -> None:
    """Compile (no run) or run the three d128 kernels one by one, logging after each step."""
    jax, jnp, np, DPA, Fwd, Vjp = _setup()
    from tokamax_kernels.attention._mosaic_gpu_bwd_kernels import (
        mosaic_attention_dkv,
        mosaic_attention_dq,
    )
    from tokamax_kernels.attention._mosaic_gpu_fwd_kernel import mosaic_attention_forward
    F, B = _configs()
    causal = True
    q, k, v, do = _inputs(jax, jnp, 2, 256, 256, 4, 2, 128, jnp.bfloat16)
    fcfg = F(block_q=64, block_kv=128)
    bcfg = B(compute_wgs=1) if name.endswith("wgs1") else B()
    kw = dict(scale=128 ** -0.5, causal=causal)
    lse = jnp.zeros((2, 4, 256), jnp.float32)
    fns = {"fwd": (jax.jit(functools.partial(mosaic_attention_forward, config=fcfg, **kw)),
                   (q, k, v)),
           "dq": (jax.jit(functools.partial(mosaic_attention_dq, config=bcfg, **kw)),
                  (q, k, v, do, lse, lse)),
           "dkv": (jax.jit(functools.partial(mosaic_attention_dkv, config=bcfg, **kw)),
                   (q, k, v, do, lse, lse))}
    if name == "compile_d128":
        for key, (f, args) in fns.items():
            t0 = time.time()
            f.lower(*args).compile()
            _log(dict(phase=name, kernel=key, compile_s=round(time.time() - t0, 1)))
        return
    out_r, lse_r, grads_r = _reference(jax, jnp, DPA, q, k, v, do, causal)
    t0 = time.time()
    out, lse = jax.block_until_ready(fns["fwd"][0](q, k, v))
    _log(dict(phase=name, kernel="fwd", out=_rel(np, out, out_r), s=round(time.time() - t0, 1)))
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))
    for key in ("dq", "dkv"):
        t0 = time.time()
        res = jax.block_until_ready(fns[key][0](q, k, v, do, lse, delta))
        res = res if isinstance(res, tuple) else (res,)
        want = grads_r[:1] if key == "dq" else grads_r[1:]
        _log(dict(phase=name, kernel=key, s=round(time.time() - t0, 1),
                  err=[_rel(np, a, b) for a, b in zip(res, want, strict=True)]))


def _quick(name: str) -> None:
    jax, jnp, np, DPA, Fwd, Vjp = _setup()
    causal = name.endswith("causal")
    b, s, h, d = 4, 8192, 16, 128
    q, k, v, do = _inputs(jax, jnp, b, s, s, h, h, d, jnp.bfloat16)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)

    def cudnn(q, k, v, is_causal=causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, implementation="cudnn")

    for impl, mode, f, args in (
            ("cudnn", "fwd", jax.jit(cudnn), (q, k, v)),
            ("mosaic", "fwd", jax.jit(lambda q, k, v: Fwd()(q, k, v, is_causal=causal)),
             (q, k, v)),
            ("cudnn", "fwd+bwd", _fwd_bwd(jax, cudnn, causal), (q, k, v, do)),
            ("mosaic", "fwd+bwd", _fwd_bwd(jax, Fwd(), causal), (q, k, v, do))):
        rec = dict(phase=name, impl=impl, mode=mode)
        try:
            t0 = time.time()
            _, med, best = _time(jax, np, f, args)
            n = 1 if mode == "fwd" else 3.5
            rec.update(ms=round(med, 4), min_ms=round(best, 4),
                       tflops=round(n * flops / med / 1e9, 1), s=round(time.time() - t0, 1))
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        _log(rec)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--phase":
        name = argv[1]
        if name == "small":
            phase_small()
            return
        if (name.endswith("d128") and name.split("_")[0] in ("compile", "run")) or "wgs1" in name:
            phase_d128(name)
            return
        if name.startswith("quick"):
            _quick(name)
            return
        if name.startswith("heads"):
            phase_heads(name)
            return
        if name == "op_gqa":
            phase_op_gqa()
            return
        F, B = _configs()
        if name == "bench_d64":
            _bench(name, 32, 2048, 16, 64, False,
                   [F(block_q=128, block_kv=128), F(block_q=64, block_kv=128),
                    F(block_q=128, block_kv=64, num_stages=3)],
                   [B(block_q_dq=64, block_kv_dq=128, block_q_dkv=128, block_kv_dkv=64),
                    B(), B(block_q_dq=128, block_kv_dq=64, block_q_dkv=128, block_kv_dkv=64)])
        elif name.startswith("bench_d128"):
            causal = name.endswith("causal")
            _bench(name, 4, 8192, 16, 128, causal,
                   [F(block_q=64, block_kv=128), F(block_q=128, block_kv=64),
                    F(block_q=64, block_kv=64, num_stages=3)],
                   [B(), B(num_stages=3), B(compute_wgs=1)])
        return
    phases = argv or list(PHASES)
    for name in phases:
        t0 = time.time()
        try:
            proc = subprocess.run([sys.executable, __file__, "--phase", name],
                                  timeout=PHASES[name], stderr=subprocess.PIPE, text=True)
            tail = (proc.stderr or "")[-1500:] if proc.returncode else ""
            _log(dict(phase=name, rc=proc.returncode, s=round(time.time() - t0, 1),
                      stderr_tail=tail))
        except subprocess.TimeoutExpired:
            _log(dict(phase=name, error=f"timed out after {PHASES[name]} s"))


if __name__ == "__main__":
    main(sys.argv[1:])
