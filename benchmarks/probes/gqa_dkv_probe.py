"""Device probe for `MosaicAttentionVjpConfig.group_in_block`: CUPTI timings of
forward+backward through `dot_product_attention` with the Mosaic dk/dv kernel per query
head (default; the group's shares summed after it) and per K/V head (the option), against
cuDNN, at GQA/MQA workloads; also the forward alone, so that the backward's share shows
(`bwd_ms` = forward+backward - forward). Once per workload it checks the option against
the default on the timed programs' outputs (max abs difference of dq, dk, dv; the option
rounds dk/dv once, the default once per query head before its float32 sum).

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/gqa_dkv_probe.py
It runs in a subprocess with a timeout (a deadlocked kernel costs the run, not the
machine) and appends JSON lines to `$OUT/gqa_dkv.jsonl`. Numerics against the float32
reference: `tests/gpu/test_mosaic_attention_gpu.py -k group_in_block`.
"""

from __future__ import annotations

import json
import os
import sys

from benchmarks.probes._probe import run_phases

OUT = os.environ.get("OUT", "/tmp")
ITERATIONS = 10  # CUPTI runs a timing after a warm-up run; the median is recorded

WORKLOADS = [  # name, (b, s, hq, hkv, d), causal, other statics
    ("gqa causal b4 s4096 hq32 hkv8 d128", (4, 4096, 32, 8, 128), True, {}),
    ("llama b4 s4096 hq16 hkv4 d128 causal", (4, 4096, 16, 4, 128), True, {}),
    ("mqa b4 s4096 hq16 hkv1 d128 causal", (4, 4096, 16, 1, 128), True, {}),
    ("gqa b8 s2048 hq16 hkv4 d64 causal", (8, 2048, 16, 4, 64), True, {}),
    ("gemma 2 global: soft cap 50 b2 s8192 hq8 hkv4 d256 causal", (2, 8192, 8, 4, 256), True,
     dict(logits_soft_cap=50.0)),
    ("gemma 2 local: soft cap 50 window 4096 b2 s8192 hq8 hkv4 d256 causal",
     (2, 8192, 8, 4, 256), True, dict(logits_soft_cap=50.0, local_window_size=(4096, 0))),
]


def _log(record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(os.path.join(OUT, "gqa_dkv.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _mosaic(group_in_block: bool):
    from tokamax_kernels.attention import (
        PallasMosaicGpuFlashAttention,
        PallasMosaicGpuFlashAttentionVjp,
    )
    from tokamax_kernels.attention._mosaic_gpu_common import MosaicAttentionVjpConfig
    config = MosaicAttentionVjpConfig(group_in_block=group_in_block)
    return PallasMosaicGpuFlashAttention(vjp=PallasMosaicGpuFlashAttentionVjp(config=config))


def _programs(implementation, causal: bool, statics: dict):
    """Jitted forward+backward `(q, k, v, do) -> (out, dq, dk, dv)` and forward alone."""
    import jax

    from tokamax_kernels.attention import dot_product_attention

    def forward(q, k, v):
        return dot_product_attention(q, k, v, is_causal=causal, implementation=implementation,
                                     **statics)

    def fwd_bwd(q, k, v, do):
        out, pullback = jax.vjp(forward, q, k, v)
        return (out, *pullback(do))

    return jax.jit(fwd_bwd), jax.jit(forward)


def _inputs(b, s, h, hk, d, seed=0):
    import jax.numpy as jnp

    from benchmarks.probes._probe import random_normal
    return (random_normal(seed, (b, s, h, d), jnp.bfloat16),
            random_normal(seed + 1, (b, s, hk, d), jnp.bfloat16),
            random_normal(seed + 2, (b, s, hk, d), jnp.bfloat16),
            random_normal(seed + 3, (b, s, h, d), jnp.bfloat16))


def _median_ms(f, *args) -> tuple[float, str]:
    """Median device time of `f(*args)` and the timer (CUPTI on the H200; the best
    available, so a CUPTI failure degrades to the profiler instead of losing the row)."""
    from tokamax_pass.benchmarking import compile_benchmark, standardize_function
    f_std, arrays = standardize_function(f, *args)
    data = compile_benchmark(f_std, arrays)(arrays, iterations=ITERATIONS)
    return data.median_evaluation_time_ms, data.method


def _max_abs_diffs(off, on) -> dict:
    """Option on against off: max |difference| of dq, dk, dv, and the scale of each."""
    import jax.numpy as jnp

    record = {}
    for name, a, c in zip(("dq", "dk", "dv"), off[1:], on[1:], strict=True):
        a, c = a.astype(jnp.float32), c.astype(jnp.float32)
        record[f"{name}_max_abs_diff"] = float(jnp.max(jnp.abs(a - c)))
        record[f"{name}_max_abs"] = float(jnp.max(jnp.abs(a)))
    return record


def bench(only: str = "") -> None:
    """Every workload whose name holds `only`."""
    import jax

    variants = {"mosaic per query head": lambda: _mosaic(False),
                "mosaic group_in_block": lambda: _mosaic(True),
                "cudnn": lambda: "cudnn"}
    for name, (b, s, h, hk, d), causal, statics in WORKLOADS:
        if only not in name:
            continue
        # Forward 4 b h s^2 d, backward 2.5x that (five matmuls to the forward's two);
        # causal counts half.
        fwd_flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        q, k, v, do = _inputs(b, s, h, hk, d)
        results = {}  # the Mosaic variants' (out, dq, dk, dv), for the check
        for variant, implementation in variants.items():
            if statics.get("logits_soft_cap") and variant == "cudnn":
                continue  # cuDNN has no soft cap
            record = dict(phase="bench", workload=name, variant=variant)
            try:
                fwd_bwd, forward = _programs(implementation(), causal, statics)
                if variant.startswith("mosaic"):
                    results[variant] = fwd_bwd(q, k, v, do)
                ms, timer = _median_ms(fwd_bwd, q, k, v, do)
                fwd_ms, _ = _median_ms(forward, q, k, v)
                record.update(timer=timer, ms=ms, tflops=3.5 * fwd_flops / ms / 1e9,
                              fwd_ms=fwd_ms, bwd_ms=ms - fwd_ms,
                              bwd_tflops=2.5 * fwd_flops / (ms - fwd_ms) / 1e9)
            except Exception as e:  # noqa: BLE001
                record.update(error=f"{type(e).__name__}: {str(e)[:800]}")
            _log(record)
            jax.clear_caches()
        if len(results) == 2:
            _log(dict(phase="check", workload=name, **_max_abs_diffs(*results.values())))


def main(argv: list[str]) -> int:
    only = os.environ.get("GQA_DKV_ONLY", "")
    return run_phases(argv, __file__, {"bench": (lambda: bench(only), 230)}, _log)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
