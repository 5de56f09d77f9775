"""Device sweep: is cuDNN attention ever slower than plain JAX's default (XLA) attention?

`implementation=None` runs cuDNN wherever cuDNN runs without a measurement, as the
plain-JAX path (`jax.nn.dot_product_attention(implementation="cudnn")`). But
`jax.nn.dot_product_attention`'s own default is XLA, so a user who writes it without
`implementation=` runs XLA. This sweep times both, forward and forward+backward, over
small and odd shapes where a fused kernel's fixed costs could lose (short sequences,
batch 1, GQA, causal, head dims 64-256), so the rule can be checked, not assumed.

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/cudnn_vs_xla_attention_sweep.py
One JSON line per shape and mode goes to `$OUT/cudnn_vs_xla_attention.jsonl` (replaced) as it is
measured
(CUPTI, median of 20 after warm-up, `tokamax_pass.benchmarking`).
"""

from __future__ import annotations

import itertools
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.probes._probe import random_normal
from tokamax_pass.benchmarking import compile_benchmark, standardize_function

OUT = os.environ.get("OUT", "/tmp")
SHAPES = [  # batch, seq, query heads, key/value heads, head dim
    (b, s, h, hk, d)
    for (b, s), (h, hk), d in itertools.product(
        [(1, 128), (1, 512), (4, 256), (8, 1024), (2, 2048)], [(8, 8), (16, 4)], [64, 128, 256])
]


def _step(implementation: str, causal: bool, backward: bool):
    def attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                            implementation=implementation)

    if not backward:
        return jax.jit(attention)

    def fwd_bwd(q, k, v, do):
        out, pullback = jax.vjp(attention, q, k, v)
        return (out, *pullback(do))
    return jax.jit(fwd_bwd)


def main() -> None:
    out = os.path.join(OUT, "cudnn_vs_xla_attention.jsonl")
    open(out, "w").close()
    for (b, s, h, hk, d), causal in itertools.product(SHAPES, (False, True)):
        q = random_normal(0, (b, s, h, d), jnp.bfloat16)
        k = random_normal(1, (b, s, hk, d), jnp.bfloat16)
        v = random_normal(2, (b, s, hk, d), jnp.bfloat16)
        do = random_normal(3, (b, s, h, d), jnp.bfloat16)
        for backward in (False, True):
            row = dict(shape=[b, s, h, hk, d], causal=causal,
                       mode="fwd+bwd" if backward else "fwd")
            for implementation in ("xla", "cudnn"):
                args = (q, k, v, do) if backward else (q, k, v)
                try:
                    f_std, std_args = standardize_function(
                        _step(implementation, causal, backward), *args)
                    row[implementation] = compile_benchmark(f_std, std_args)(
                        std_args).median_evaluation_time_ms
                except Exception as e:  # noqa: BLE001 - the sweep logs and goes on
                    row[implementation] = f"{type(e).__name__}: {str(e)[:300]}"
            if all(isinstance(row.get(i), float) for i in ("xla", "cudnn")):
                row["cudnn_vs_xla"] = row["xla"] / row["cudnn"]
            print(json.dumps(row), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            jax.clear_caches()


if __name__ == "__main__":
    main()
