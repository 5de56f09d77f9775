"""Device probe for causal query blocks launched longest first (`longest_first` on
`MosaicAttentionConfig` and `MosaicAttentionVjpConfig`): CUPTI timings of the causal
forward and forward + backward with the option off and on at the same tiles (the
heuristics' pick for the shape), against cuDNN, in one process; and whether the two
orders agree bitwise (they should: a block's work does not depend on when it runs).

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/longest_first_probe.py
It runs in a subprocess with a timeout (a deadlocked kernel costs the run, not the
machine) and appends JSON lines to `$OUT/longest_first.jsonl` as each timing lands
(TFLOP/s with causal counted at half, the backward at 2.5 forwards). Numerics against
the float32 reference: `tests/gpu/test_mosaic_attention_gpu.py -k longest_first`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from benchmarks.probes._probe import run_phases, timed

OUT = os.environ.get("OUT", "/tmp")
TIMEOUT_S = 230

# name, (b, s, h, hk, d): every workload causal.
WORKLOADS = [
    ("b4 s8192 h16 d128 causal", (4, 8192, 16, 16, 128)),
    ("gqa causal b4 s4096 hq32 hkv8 d128", (4, 4096, 32, 8, 128)),
    ("llama b4 s4096 hq16 hkv4 d128 causal", (4, 4096, 16, 4, 128)),
    ("b8 s2048 h16 d64 causal", (8, 2048, 16, 16, 64)),
]


def _log(record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(os.path.join(OUT, "longest_first.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _forward(implementation):
    """The jitted causal forward; `implementation` (an op or a name) closed over, never
    passed through a default argument or `functools.partial` into `jax.jit`."""
    import jax

    from tokamax_kernels.attention import dot_product_attention
    return jax.jit(lambda q, k, v: dot_product_attention(
        q, k, v, is_causal=True, implementation=implementation))


def _forward_backward(implementation):
    """The jitted causal forward and its gradients of the cotangent `do`."""
    import jax

    from tokamax_kernels.attention import dot_product_attention

    def f(q, k, v, do):
        _, pullback = jax.vjp(lambda q, k, v: dot_product_attention(
            q, k, v, is_causal=True, implementation=implementation), q, k, v)
        return pullback(do)
    return jax.jit(f)


def _mosaic_ops(q, k):
    """The heuristics' forward and VJP configs for this causal call, and the ops with
    `longest_first` off and on at those tiles."""
    import jax

    from tokamax_kernels.attention import (
        PallasMosaicGpuFlashAttention,
        PallasMosaicGpuFlashAttentionVjp,
    )
    b, s, h, _ = q.shape
    fwd = PallasMosaicGpuFlashAttention().bind(q, k, k, is_causal=True).heuristics_config
    vjp_op = PallasMosaicGpuFlashAttentionVjp()
    ba = vjp_op.bind((jax.ShapeDtypeStruct((b, h, s), "float32"),), q, q, query=q, key=k,
                     value=k, bias=None, mask=None, scale=q.shape[-1] ** -0.5,
                     is_causal=True, query_seq_lengths=None, key_value_seq_lengths=None,
                     local_window_size=None, logits_soft_cap=None, precision=None)
    vjp = vjp_op._get_heuristics_config(ba)
    ops = {}
    for on in (False, True):
        ops[on] = PallasMosaicGpuFlashAttention(
            config=dataclasses.replace(fwd, longest_first=on),
            vjp=PallasMosaicGpuFlashAttentionVjp(
                config=dataclasses.replace(vjp, longest_first=on)))
    return fwd, vjp, ops


def bench() -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.probes._probe import random_normal

    for name, (b, s, h, hk, d) in WORKLOADS:
        q, do = (random_normal(i, (b, s, h, d), jnp.bfloat16) for i in (0, 3))
        k, v = (random_normal(i, (b, s, hk, d), jnp.bfloat16) for i in (1, 2))
        fwd_flops = 4 * b * h * s * s * d * 0.5
        try:
            fwd_config, vjp_config, ops = _mosaic_ops(q, k)
        except Exception as e:  # noqa: BLE001
            _log(dict(workload=name, error=f"{type(e).__name__}: {str(e)[:800]}"))
            continue
        _log(dict(workload=name, fwd_config=str(fwd_config), vjp_config=str(vjp_config)))
        variants = [("mosaic", ops[False]), ("mosaic longest_first", ops[True]),
                    ("cudnn", "cudnn")]
        for mode, make, args, flops in (
                ("fwd", _forward, (q, k, v), fwd_flops),
                ("fwd+bwd", _forward_backward, (q, k, v, do), 3.5 * fwd_flops)):
            outputs = {}
            for label, impl in variants:
                record = dict(workload=name, variant=label, mode=mode)
                outputs[label] = timed(record, make(impl), args, flops)
                if (label == "mosaic longest_first" and outputs.get("mosaic") is not None
                        and outputs[label] is not None):
                    record["bitwise_equal_to_grid_order"] = all(
                        bool(jnp.array_equal(a, b_)) for a, b_ in zip(
                            jax.tree.leaves(outputs[label]),
                            jax.tree.leaves(outputs["mosaic"]), strict=True))
                _log(record)
            jax.clear_caches()


def main(argv: list[str]) -> int:
    return run_phases(argv, __file__, {"bench": (bench, TIMEOUT_S)}, _log)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
