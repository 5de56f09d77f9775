"""Device probe: what does the fixed-order `delta` (`attention/_delta.py`) cost
in compile time and run time on the GPU? The gemma2 step under `None` (Mosaic attention
at head dim 256, the only suite model whose backward runs it) is where a slow-compiling
order shows; a pairwise tree of halves compiled far slower than a chain of adds or a plain
sum, and ran slower than the plain sum, which is why the library sums in a Pallas Triton
kernel on CUDA.

Compiles `attention_delta` alone at gemma2's shape and at d128/d64, then the gemma2
`None` step, each with the library's kernel, a plain `jnp.sum`, the chain and the tree
swapped in, each in a fresh process (no compilation cache). Then times `delta` itself
for each order at each shape (CUPTI, one process).

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/delta_compile_probe.py
(`--run-times-only`: the run times alone.) Writes `$OUT/delta_compile_probe.jsonl`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

VJP_MODULES = ("pallas_mosaic_gpu_vjp", "pallas_triton_vjp", "pallas_mosaic_tpu_vjp")
DELTA_SHAPES = {"gemma2 d256": (2, 8192, 8, 256), "d128": (4, 4096, 16, 128),
                "d64": (8, 2048, 32, 64), "d80, a partial last block": (2, 1000, 4, 80)}


def _plain_sum(out, dout, dlse=None):
    import jax.numpy as jnp
    terms = out.astype(jnp.float32) * dout.astype(jnp.float32)
    delta = jnp.swapaxes(jnp.sum(terms, axis=-1), 1, 2)
    return delta if dlse is None else delta - dlse.astype(jnp.float32)


def _pairwise(out, dout, dlse=None):
    """Another fixed order: elementwise adds of halves (a pairwise tree)."""
    import jax.numpy as jnp
    terms = out.astype(jnp.float32) * dout.astype(jnp.float32)
    width = 1 << max(terms.shape[-1] - 1, 0).bit_length()
    if width != terms.shape[-1]:
        terms = jnp.pad(terms, [(0, 0)] * (terms.ndim - 1) + [(0, width - terms.shape[-1])])
    while terms.shape[-1] > 1:
        half = terms.shape[-1] // 2
        terms = terms[..., :half] + terms[..., half:]
    delta = jnp.swapaxes(terms[..., 0], 1, 2)
    return delta if dlse is None else delta - dlse.astype(jnp.float32)


def _chain(out, dout, dlse=None):
    """The fixed order the library sums off CUDA: a chain of adds, column by column."""
    import jax.numpy as jnp

    from tokamax_kernels.attention._delta import delta_by_chain
    delta = delta_by_chain(out, dout)
    return delta if dlse is None else delta - dlse.astype(jnp.float32)


DELTAS = {"library (Triton kernel)": None, "plain sum": _plain_sum, "chain": _chain,
          "pairwise tree": _pairwise}


def _use(delta: str) -> None:
    import importlib
    if DELTAS[delta] is not None:
        for name in VJP_MODULES:
            module = importlib.import_module(f"tokamax_kernels.attention.{name}")
            module.attention_delta = DELTAS[delta]


def _worker(what: str, delta: str, smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks.models import MODELS, ops
    from tokamax_kernels.attention import pallas_triton_vjp

    _use(delta)
    start = time.perf_counter()
    if what in DELTA_SHAPES:
        shape = (2, 16, 2, 32) if smoke else DELTA_SHAPES[what]
        s = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        jax.jit(pallas_triton_vjp.attention_delta).lower(s, s).compile()
    else:
        model = MODELS["gemma2"]
        params = model.init(jax.random.key(0), model.sized(smoke))
        batch = model.make_batch(jax.random.key(1), model.sized(smoke))
        step = jax.jit(jax.grad(model.loss_fn(ops.variants()["ours"], smoke=smoke)))
        step.lower(params, batch).compile()
    return dict(what=what, delta=delta, compile_s=round(time.perf_counter() - start, 2))


def _run_times(smoke: bool) -> list[dict]:
    """Each order's `delta` alone, CUPTI, at each shape, with its largest difference from
    a float64 sum."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tokamax_kernels.attention._delta import attention_delta
    from tokamax_pass import benchmarking

    records = []
    for what, shape in DELTA_SHAPES.items():
        shape = (2, 16, 2, 32) if smoke else shape
        out, dout = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in (1, 2))
        want = np.einsum("bqhd,bqhd->bhq", np.asarray(out, np.float64),
                         np.asarray(dout, np.float64))
        for delta, fn in DELTAS.items():
            step = jax.jit(fn or attention_delta)
            data = benchmarking.benchmark(step, out, dout, iterations=50)
            error = float(np.max(np.abs(np.asarray(step(out, dout), np.float64) - want)))
            records.append(dict(what=what, delta=delta, run_ms=data.median_evaluation_time_ms,
                                method=data.method, max_abs_error=error))
    return records


def main(argv: list[str]) -> int:
    smoke = "--smoke" in argv
    if "--worker" in argv:
        what, delta = argv[argv.index("--worker") + 1:argv.index("--worker") + 3]
        print(json.dumps(_worker(what, delta, smoke)))
        return 0
    path = os.path.join(os.environ.get("OUT", "/tmp"), "delta_compile_probe.jsonl")
    with open(path, "a") as f:
        for record in _run_times(smoke):
            print(json.dumps(record), flush=True)
            f.write(json.dumps(record) + "\n")
        if "--run-times-only" in argv:
            return 0
        for what in (*DELTA_SHAPES, "gemma2 None step"):
            for delta in DELTAS:
                run = subprocess.run(
                    [sys.executable, __file__, "--worker", what, delta,
                     *(["--smoke"] if smoke else [])],
                    capture_output=True, text=True, timeout=300)
                lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
                record = json.loads(lines[-1]) if lines else dict(
                    what=what, delta=delta, error=run.stderr[-500:])
                print(json.dumps(record), flush=True)
                f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
