"""Device probe: which piece of the default Mosaic attention backward changes from one
compile to the next. Two configurations (GQA d256 with the head dim split over two dq
warpgroups; a causal d64 window of 200 with one) gave one of two dq/dk results per compile
when `delta` had no fixed order, while reruns of one compiled program agreed and out and
dv never changed (`benchmarks/probes/longest_first_probe.py` shows it).

Each of `--processes` worker processes (run at once, so their compiles and timings
interleave as they did when the difference showed) compiles every piece on its own:
the forward kernel (out, lse), `attention_delta` (delta), the dq and dk/dv kernels fed
that process's lse and delta, and the whole `jax.vjp` step; it hashes each output.
The parent then writes, per configuration and piece, whether every process agreed.
A piece that differs while its inputs agree is the one that varies.

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/compile_reproducibility_probe.py
Writes `$OUT/compile_reproducibility.jsonl` (one line per process and piece, then the
summary lines).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

OUT = os.environ.get("OUT", "/tmp")
RESULTS = os.path.join(OUT, "compile_reproducibility.jsonl")
WORKER_TIMEOUT_S = 240

# name: ((batch, seq_q, seq_kv, heads, kv_heads, head_dim), forward compute_wgs,
#        backward compute_wgs, block_kv, local window or None); every case causal.
CASES = {
    "gqa-d256-split-dq": ((2, 512, 512, 4, 2, 256), 1, 2, 64, None),
    "window-d64": ((2, 1024, 1024, 4, 2, 64), 2, 1, 64, (200, 0)),
    "gqa-d128 (control)": ((2, 1024, 1024, 8, 2, 128), 2, 2, 128, None),
}


def _hash(x) -> str:
    import numpy as np
    return hashlib.sha1(np.asarray(x).tobytes()).hexdigest()[:12]


def _pieces(name: str) -> dict[str, str]:
    """Hashes of every piece of case `name`, each piece compiled in this process."""
    import jax
    import jax.numpy as jnp

    from benchmarks.probes._probe import random_normal
    from tokamax_kernels.attention import (
        PallasMosaicGpuFlashAttention,
        PallasMosaicGpuFlashAttentionVjp,
        _window,
        dot_product_attention,
    )
    from tokamax_kernels.attention._delta import attention_delta
    from tokamax_kernels.attention._mosaic_gpu_bwd_kernels import (
        mosaic_attention_dkv,
        mosaic_attention_dq,
    )
    from tokamax_kernels.attention._mosaic_gpu_common import (
        MosaicAttentionConfig,
        MosaicAttentionVjpConfig,
    )
    from tokamax_kernels.attention._mosaic_gpu_fwd_kernel import mosaic_attention_forward

    (b, sq, sk, h, hk, d), fwd_wgs, vjp_wgs, block_kv, window = CASES[name]
    q, do = (random_normal(i, (b, sq, h, d), jnp.bfloat16) for i in (0, 3))
    k, v = (random_normal(i, (b, sk, hk, d), jnp.bfloat16) for i in (1, 2))
    fwd_config = MosaicAttentionConfig(block_kv=block_kv, compute_wgs=fwd_wgs)
    vjp_config = MosaicAttentionVjpConfig(compute_wgs=vjp_wgs)
    kw = dict(scale=d ** -0.5, causal=True, window=_window.bounds(window, True))
    out, lse = jax.jit(lambda q, k, v: mosaic_attention_forward(
        q, k, v, config=fwd_config, **kw))(q, k, v)
    delta = jax.jit(attention_delta)(out, do)
    dq = jax.jit(lambda *a: mosaic_attention_dq(*a, config=vjp_config, **kw))(
        q, k, v, do, lse, delta)
    dk, dv = jax.jit(lambda *a: mosaic_attention_dkv(*a, config=vjp_config, **kw))(
        q, k, v, do, lse, delta)
    op = PallasMosaicGpuFlashAttention(
        config=fwd_config, vjp=PallasMosaicGpuFlashAttentionVjp(config=vjp_config))

    def step(q, k, v, do):
        result, pullback = jax.vjp(lambda q, k, v: dot_product_attention(
            q, k, v, is_causal=True, local_window_size=window, implementation=op), q, k, v)
        return (result, *pullback(do))

    step_out, step_dq, step_dk, step_dv = jax.jit(step)(q, k, v, do)
    found = dict(out=out, lse=lse, delta=delta, dq_kernel=dq, dk_kernel=dk, dv_kernel=dv,
                 step_out=step_out, step_dq=step_dq, step_dk=step_dk, step_dv=step_dv)
    return {piece: _hash(value) for piece, value in found.items()}


def worker(index: int) -> None:
    records = []
    for name in CASES:
        try:
            records.append(dict(process=index, case=name, hashes=_pieces(name)))
        except Exception as e:  # noqa: BLE001 - a failing case is a result
            records.append(dict(process=index, case=name,
                                error=f"{type(e).__name__}: {str(e)[:500]}"))
    with open(os.path.join(OUT, f"compile_reproducibility_{index}.json"), "w") as f:
        json.dump(records, f)


def summarize(records: list[dict]) -> list[dict]:
    """Per case and piece: the distinct hashes over the processes that ran it."""
    summary = []
    for name in CASES:
        runs = [r["hashes"] for r in records if r["case"] == name and "hashes" in r]
        for piece in (runs[0] if runs else {}):
            values = sorted({run[piece] for run in runs})
            summary.append(dict(case=name, piece=piece, processes=len(runs),
                                distinct=len(values), values=values))
    return summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.compile_reproducibility_probe",
        description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(i)])
               for i in range(args.processes)]
    records = []
    for i, process in enumerate(workers):
        try:
            process.wait(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
        path = os.path.join(OUT, f"compile_reproducibility_{i}.json")
        if os.path.exists(path):
            with open(path) as f:
                records.extend(json.load(f))
        else:
            records.append(dict(process=i, error=f"no results (exit {process.returncode})"))
    with open(RESULTS, "a") as f:
        for record in records + summarize(records):
            print(json.dumps(record), flush=True)
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
