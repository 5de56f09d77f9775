"""The `xla` attention backward against the plain expression's autodiff, on the device.

    python3 benchmarks/probes/attention_xla_vjp_probe.py OUT.jsonl

For causal GQA and soft-capped windowed attention (bf16, the benchmark shapes): forward
+ backward device time (CUPTI, median of 10 after warm-up) of the plain expression a user
writes (`jax.nn.dot_product_attention(implementation="xla")`, or the soft cap written out
in jnp), ours with `implementation="xla"` (the lse-residual backward), ours with the
autodiff reference backward (`DotProductAttentionVjp`, the previous `xla` backward), and
`None`; then whether the Mosaic GPU backward compiles with the soft cap and a window
(the error text when it does not).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from benchmarks import workloads
from tokamax_pass import benchmarking

SHAPES = {
    "gqa causal b4 s4096 hq32 hkv8 d128": dict(b=4, s=4096, h=32, kv=8, d=128, extra={}),
    "soft cap 50 window 4096 b4 s8192 h16 d128 causal": dict(
        b=4, s=8192, h=16, kv=16, d=128,
        extra=dict(local_window_size=(4096, 0), logits_soft_cap=50.0)),
}


def _plain(extra: dict) -> object:
    if not extra:
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla")
    return lambda q, k, v: workloads._capped_attention(
        q, k, v, causal=True, window=extra["local_window_size"][0],
        soft_cap=extra["logits_soft_cap"])


def _ours(implementation: object, extra: dict) -> object:
    return lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=True, implementation=implementation, **extra)


def main(out: str) -> None:
    with open(out, "a") as f:
        for name, p in SHAPES.items():
            keys = jax.random.split(jax.random.key(0), 3)
            q = jax.random.normal(keys[0], (p["b"], p["s"], p["h"], p["d"]), jnp.bfloat16)
            k, v = (jax.random.normal(key, (p["b"], p["s"], p["kv"], p["d"]), jnp.bfloat16)
                    for key in keys[1:])
            candidates = {
                "plain": _plain(p["extra"]),
                "ours xla": _ours("xla", p["extra"]),
                "ours xla, autodiff backward": _ours(
                    tokamax.DotProductAttention(vjp=tokamax.DotProductAttentionVjp()),
                    p["extra"]),
                "ours None": _ours(None, p["extra"]),
            }
            if p["extra"]:
                candidates["ours mosaic"] = _ours("mosaic", p["extra"])
            for label, fn in candidates.items():
                row = {"shape": name, "variant": label}
                try:
                    f_std, arrays = benchmarking.standardize_function(
                        fn, q, k, v, mode="forward_and_vjp")
                    data = benchmarking.compile_benchmark(f_std, arrays)(
                        arrays, iterations=10)
                    row.update(ms=data.median_evaluation_time_ms, method=data.method)
                except Exception as e:  # noqa: BLE001 - a failure is a result
                    row["error"] = f"{type(e).__name__}: {e}"[:4000]
                print(json.dumps(row)[:400], flush=True)
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
