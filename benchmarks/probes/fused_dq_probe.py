"""Device probe for the one-pass Mosaic GPU attention backward: CUPTI timings of
forward+backward with `dq_accumulation` "separate" (a dq kernel of its own), "ordered"
and "atomic" (dq added up by the dk/dv kernel), each split by columns or rows, against
cuDNN, in one process.

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/fused_dq_probe.py
It runs in a subprocess with a timeout (a deadlocked kernel costs the run, not the
machine) and appends JSON lines to `$OUT/fused_dq.jsonl`. `FUSED_DQ_VARIANTS` (comma
separated names, e.g. "cudnn,mosaic separate") keeps only those variants, and
`FUSED_DQ_CODE` labels the records (say, which checkout of the kernels ran), so two
checkouts can be compared on one machine. Numerics and bitwise reruns:
`tests/gpu/test_mosaic_attention_gpu.py -k one_pass`.
"""

from __future__ import annotations

import json
import os
import sys

from benchmarks.probes._probe import run_phases

OUT = os.environ.get("OUT", "/tmp")


def _log(record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(os.path.join(OUT, "fused_dq.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _ops(mode: str, **fields):
    from tokamax_kernels.attention import (
        PallasMosaicGpuFlashAttention,
        PallasMosaicGpuFlashAttentionVjp,
    )
    from tokamax_kernels.attention._mosaic_gpu_common import MosaicAttentionVjpConfig
    config = MosaicAttentionVjpConfig(dq_accumulation=mode, **fields)
    return PallasMosaicGpuFlashAttention(vjp=PallasMosaicGpuFlashAttentionVjp(config=config))


def _fwd_bwd(implementation, **statics):
    import jax

    from tokamax_kernels.attention import dot_product_attention

    def f(q, k, v, do, lengths=None):
        out, pullback = jax.vjp(lambda q, k, v: dot_product_attention(
            q, k, v, implementation=implementation, key_value_seq_lengths=lengths,
            **statics), q, k, v)
        return (out, *pullback(do))
    return jax.jit(f)


def _inputs(b, sq, sk, h, hk, d, seed=0):
    import jax.numpy as jnp

    from benchmarks.probes._probe import random_normal
    return (random_normal(seed, (b, sq, h, d), jnp.bfloat16),
            random_normal(seed + 1, (b, sk, hk, d), jnp.bfloat16),
            random_normal(seed + 2, (b, sk, hk, d), jnp.bfloat16),
            random_normal(seed + 3, (b, sq, h, d), jnp.bfloat16))


WORKLOADS = [  # name, (b, s, h, hk, d), causal
    ("b4 s8192 h16 d128", (4, 8192, 16, 16, 128), False),
    ("b4 s8192 h16 d128 causal", (4, 8192, 16, 16, 128), True),
    ("gqa causal b4 s4096 hq32 hkv8 d128", (4, 4096, 32, 8, 128), True),
    ("llama b4 s4096 hq16 hkv4 d128 causal", (4, 4096, 16, 4, 128), True),
    ("b32 s2048 h16 d64", (32, 2048, 16, 16, 64), False),
]


def bench() -> None:
    import jax

    from tokamax_pass.benchmarking import compile_benchmark, standardize_function

    variants = {"cudnn": ("cudnn", None, None), "mosaic separate": ("separate", 2, None)}
    for split in ("columns", "rows"):
        for mode in ("ordered", "atomic"):
            variants[f"mosaic {mode} by {split}"] = (mode, 2, split)
    wanted = os.environ.get("FUSED_DQ_VARIANTS")
    if wanted:
        variants = {name: variants[name] for name in wanted.split(",")}
    code = os.environ.get("FUSED_DQ_CODE", "")
    for name, (b, s, h, hk, d), causal in WORKLOADS:
        q, k, v, do = _inputs(b, s, s, h, hk, d)
        flops = 4 * b * h * s * s * d * 3.5 * (0.5 if causal else 1.0)
        for variant, (mode, wgs, split) in variants.items():
            if mode == "cudnn":
                impl = "cudnn"
            elif split == "columns" and d // wgs < 64:
                continue
            else:
                impl = _ops(mode, compute_wgs=wgs, **({"dq_split": split} if split else {}))
            record = dict(phase="bench", workload=name, variant=variant, code=code)
            try:
                f_std, args = standardize_function(_fwd_bwd(impl, is_causal=causal),
                                                   q, k, v, do)
                ms = compile_benchmark(f_std, args)(args).median_evaluation_time_ms
                record.update(ms=ms, tflops=flops / ms / 1e9)
            except Exception as e:  # noqa: BLE001
                record.update(error=f"{type(e).__name__}: {str(e)[:800]}")
            _log(record)
            jax.clear_caches()


def main(argv: list[str]) -> int:
    timeout = int(os.environ.get("FUSED_DQ_TIMEOUT", "420"))
    return run_phases(argv, __file__, {"bench": (bench, timeout)}, _log)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
