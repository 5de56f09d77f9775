"""Device probe for the Mosaic GPU attention forward's intra-warpgroup overlap
(`MosaicAttentionConfig.softmax_overlap`): CUPTI timings of the forward with and without
it at the same tiles, against cuDNN, in one process; and how far the two outputs differ.

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/softmax_overlap_probe.py
It runs in a subprocess with a timeout (a deadlocked kernel costs the run, not the
machine) and appends JSON lines to `$OUT/softmax_overlap.jsonl` (TFLOP/s with causal
counted at half). Numerics against the float32 reference:
`tests/gpu/test_mosaic_attention_gpu.py -k softmax_overlap`.
"""

from __future__ import annotations

import json
import os
import sys

from benchmarks.probes._probe import run_phases, timed

OUT = os.environ.get("OUT", "/tmp")
TIMEOUT_S = 360

# name, (b, s, h, hk, d), causal, soft cap, [(block_q, block_kv, stages, overlap), ...]
# The first config is the heuristics' pick without overlap.
WORKLOADS = [
    ("b4 s8192 h16 d128", (4, 8192, 16, 16, 128), False, None,
     [(64, 128, 2, False), (64, 128, 2, True)]),
    ("b4 s8192 h16 d128 causal", (4, 8192, 16, 16, 128), True, None,
     [(64, 128, 2, False), (64, 128, 2, True)]),
    ("gqa causal b4 s4096 hq32 hkv8 d128", (4, 4096, 32, 8, 128), True, None,
     [(64, 128, 2, False), (64, 128, 2, True)]),
    ("llama b4 s4096 hq16 hkv4 d128 causal", (4, 4096, 16, 4, 128), True, None,
     [(64, 128, 2, False), (64, 128, 2, True)]),
    ("b32 s2048 h16 d64", (32, 2048, 16, 16, 64), False, None,
     [(128, 128, 2, False), (128, 128, 2, True), (64, 128, 2, True)]),
    ("b16 s4096 h8 d256", (16, 4096, 8, 8, 256), False, None,
     [(64, 64, 2, False), (64, 64, 2, True)]),
    ("soft cap 50 b2 s8192 hq8 hkv4 d256 causal (gemma 2 global)", (2, 8192, 8, 4, 256), True,
     50.0, [(64, 64, 2, False), (64, 64, 2, True)]),
]


def _log(record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(os.path.join(OUT, "softmax_overlap.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _forward(implementation, causal: bool, cap: float | None):
    import jax

    from tokamax_kernels.attention import dot_product_attention
    return jax.jit(lambda q, k, v: dot_product_attention(
        q, k, v, is_causal=causal, logits_soft_cap=cap, implementation=implementation))


def bench() -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.probes._probe import random_normal
    from tokamax_kernels.attention import PallasMosaicGpuFlashAttention
    from tokamax_kernels.attention._mosaic_gpu_common import MosaicAttentionConfig

    for name, (b, s, h, hk, d), causal, cap, configs in WORKLOADS:
        q = random_normal(0, (b, s, h, d), jnp.bfloat16)
        k = random_normal(1, (b, s, hk, d), jnp.bfloat16)
        v = random_normal(2, (b, s, hk, d), jnp.bfloat16)
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        variants = [] if cap is not None else [("cudnn", "cudnn")]
        for bq, bkv, stages, overlap in configs:
            config = MosaicAttentionConfig(block_q=bq, block_kv=bkv, num_stages=stages,
                                           softmax_overlap=overlap)
            label = f"mosaic {bq}x{bkv} s{stages}" + (" overlap" if overlap else "")
            variants.append((label, PallasMosaicGpuFlashAttention(config=config)))
        outputs = {}
        for label, impl in variants:
            record = dict(workload=name, variant=label, mode="fwd")
            out = timed(record, _forward(impl, causal, cap), (q, k, v), flops)
            if out is not None:
                outputs[label] = out
                base = next((o for lbl, o in outputs.items() if lbl.startswith("mosaic")), None)
                if base is not None:
                    record["max_abs_diff_vs_first_mosaic"] = float(jnp.max(jnp.abs(
                        out.astype(jnp.float32) - base.astype(jnp.float32))))
            _log(record)
        jax.clear_caches()


def main(argv: list[str]) -> int:
    return run_phases(argv, __file__, {"bench": (bench, TIMEOUT_S)}, _log)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
