"""Device probe for the Mosaic GPU LM-head loss: numerics against `xla`, CUPTI timings and
compiled temporary memory of plain JAX, xla, xla_chunked and mosaic.

Run on the H200 from the repository root (about 3-4 minutes):
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/lce_probe.py \
      --out $OUT/lce_probe.jsonl [phase ...]
Each phase runs in its own subprocess with a timeout (a deadlocked kernel costs one
phase, not the run) and writes one JSON line per measurement to `--out` (replaced).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

# name -> timeout in seconds.
PHASES = {"numerics": 90, "bench_8b": 100, "bench_32k": 70, "sweep": 200}
BENCH_SHAPES = {"bench_8b": (16384, 4096, 128256), "bench_32k": (16384, 2048, 32000)}
NUMERICS_SHAPES = ((2, 300, 512, 4096), (1, 1000, 1024, 32000))


def _log(out: str, record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")


def _inputs(lead, h, v, seed=0):
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(seed), (*lead, h), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(seed + 1), (h, v), jnp.float32)
         / math.sqrt(h)).astype(jnp.bfloat16)
    labels = jax.random.randint(jax.random.key(seed + 2), lead, 0, v)
    ignored = jax.random.bernoulli(jax.random.key(seed + 3), 0.125, lead)
    return x, jnp.where(ignored, -1, labels), w


def _loss(impl):
    import tokamax_pass as tokamax

    def f(x, labels, w):
        return tokamax.linear_softmax_cross_entropy_loss(x, labels, w, reduction="mean",
                                                         implementation=impl)
    return f


def _numerics(out: str) -> None:
    import jax
    import numpy as np

    for b, s, h, v in NUMERICS_SHAPES:
        x, labels, w = _inputs((b, s), h, v)
        results = {}
        for impl in ("mosaic", "xla"):
            value, grads = jax.jit(jax.value_and_grad(_loss(impl), argnums=(0, 2)))(x, labels, w)
            results[impl] = [np.asarray(a, np.float32) for a in (value, *grads)]
        record = {"phase": "numerics", "shape": [b * s, h, v]}
        for name, got, want in zip(("loss", "dx", "dw"), results["mosaic"], results["xla"],
                                   strict=True):
            scale = max(float(np.max(np.abs(want))), 1e-30)
            record[f"{name}_rel_err"] = float(np.max(np.abs(got - want))) / scale
        _log(out, record)


def _bench(out: str, phase: str) -> None:
    import jax

    from benchmarks.workloads import _plain_lce
    from tokamax_pass.benchmarking import benchmark

    tokens, h, v = BENCH_SHAPES[phase]
    x, labels, w = _inputs((tokens,), h, v)
    candidates = {"plain jax": _plain_lce, "xla": _loss("xla"),
                  "xla_chunked": _loss("xla_chunked"), "mosaic": _loss("mosaic")}
    flops = 2 * tokens * h * v
    for name, f in candidates.items():
        record = {"phase": phase, "shape": [tokens, h, v], "impl": name}
        try:
            for mode, key, work in (("forward", "fwd", flops), ("forward_and_vjp", "fwd+bwd",
                                                                   3 * flops)):
                data = benchmark(f, x, labels, w, mode=mode, method="cupti", iterations=5)
                ms = data.median_evaluation_time_ms
                record[f"{key}_ms"] = ms
                record[f"{key}_tflops"] = work / ms / 1e9
            grad = jax.jit(jax.grad(f, argnums=(0, 2)))
            memory = grad.lower(x, labels, w).compile().memory_analysis()
            record["grad_temp_mib"] = memory.temp_size_in_bytes / 2**20
            fwd = jax.jit(f).lower(x, labels, w).compile().memory_analysis()
            record["fwd_temp_mib"] = fwd.temp_size_in_bytes / 2**20
        except Exception as e:  # noqa: BLE001 - a failing candidate is a result
            record["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        _log(out, record)


def _sweep(out: str) -> None:
    """Forward configs of the search space, and backward chunkings, at Llama 3's head."""
    from tokamax_kernels.linear_softmax_cross_entropy_loss import (
        MosaicGpuLossConfig,
        PallasMosaicGpuLinearSoftmaxCrossEntropyLoss,
        PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp,
    )
    from tokamax_kernels.linear_softmax_cross_entropy_loss import _mosaic_gpu_common as common
    from tokamax_pass.benchmarking import benchmark

    tokens, h, v = BENCH_SHAPES["bench_8b"]
    x, labels, w = _inputs((tokens,), h, v)
    flops = 2 * tokens * h * v
    runs = [("forward", config, None) for config in sorted(
        common.search_space(h, v, backward=False), key=repr)]
    runs += [("forward_and_vjp", None, MosaicGpuLossConfig(chunk_vocab=c, num_stages=s))
             for c, s in ((1024, 3), (2048, 3), (4096, 3), (2048, 2))]
    runs += [("forward_and_vjp", None, MosaicGpuLossConfig(chunk_vocab=1024,
                                                           dx_token_chunk=128))]
    for mode, forward, backward in runs:
        op = PallasMosaicGpuLinearSoftmaxCrossEntropyLoss(
            config=forward, vjp=PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp(config=backward))
        record = {"phase": "sweep", "mode": mode, "forward": repr(forward),
                  "backward": repr(backward)}
        try:
            ms = benchmark(_loss(op), x, labels, w, mode=mode, method="cupti",
                           iterations=3).median_evaluation_time_ms
            record.update(ms=ms, tflops=flops * (1 if mode == "forward" else 3) / ms / 1e9)
        except Exception as e:  # noqa: BLE001 - a failing config is a result
            record["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        _log(out, record)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.lce_probe")
    parser.add_argument("--out", required=True)
    parser.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    parser.add_argument("phases", nargs="*", default=list(PHASES))
    args = parser.parse_args()
    if args.inner:
        if args.inner == "numerics":
            _numerics(args.out)
        elif args.inner == "sweep":
            _sweep(args.out)
        else:
            _bench(args.out, args.inner)
        return
    open(args.out, "w").close()  # a run replaces the file's previous run
    for phase in args.phases:
        start = time.time()
        try:
            rc = subprocess.run([sys.executable, __file__, "--out", args.out, "--inner", phase],
                                timeout=PHASES[phase]).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        _log(args.out, {"phase": phase, "rc": rc, "seconds": round(time.time() - start, 1)})


if __name__ == "__main__":
    main()
