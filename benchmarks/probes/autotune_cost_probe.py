"""Device probe: where autotuning the seed-usage `f_grad` spends its time.

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/autotune_cost_probe.py [ALONE]
For each op call of the seed-usage `f_grad` (`_probe.seed_f_grad_loss`) it prints a JSON line: the
lowering and compile times of its first ALONE (default 4) candidates one at a time (XLA's in-process
GEMM autotuning cache cold for each), their compile again with XLA's GEMM autotuning off
(`xla_gpu_autotune_level=0`), and the wall time of compiling the other candidates at once
on 16 threads. Together they say which of lowering, XLA compiling, XLA's GEMM autotuning
or contention is the autotuner's time. Lines also go to `$OUT/autotune_cost.jsonl`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.probes._probe import seed_f_grad_loss as _loss
from tokamax_pass import benchmarking
from tokamax_pass.autotuning import get_bound_args, keys
from tokamax_pass.autotuning.autotuner import call_op, candidate_configs
from tokamax_pass.autotuning.timing_inputs import timing_arguments

OUT = os.environ.get("OUT", "/tmp")


def _log(record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(os.path.join(OUT, "autotune_cost.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _lowered(ba, config, arguments):
    f_std, arrays = benchmarking.standardize_function(
        call_op(ba.op.replace(config=config), ba.vmap, arguments), arguments, seed=None)
    return jax.jit(f_std).lower(arrays)


def _compile_all(ba, configs, arguments, threads: int) -> float:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda c: _lowered(ba, c, arguments).compile(), configs))
    return time.perf_counter() - start


def main(alone: int) -> None:
    channels, seq_len, batch_size, num_heads = (64, 2048, 32, 16)
    scale = jax.random.normal(jax.random.key(0), (channels,), dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(1), (batch_size, seq_len, num_heads, channels),
                          dtype=jnp.bfloat16)
    for ba in get_bound_args(jax.jit(jax.grad(_loss)), x, scale):
        ba = keys.canonical(ba)
        configs = candidate_configs(ba, 16)
        arguments = timing_arguments(ba, 0)
        lower_s, compile_s, no_gemm_tuning_s = [], [], []
        for config in configs[:alone]:
            start = time.perf_counter()
            lowered = _lowered(ba, config, arguments)
            lower_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            lowered.compile()
            compile_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            lowered.compile(compiler_options={"xla_gpu_autotune_level": "0"})
            no_gemm_tuning_s.append(time.perf_counter() - start)
        _log({"op": type(ba.op).__name__, "candidates": len(configs),
              "lower_s_alone": round(statistics.median(lower_s), 2),
              "compile_s_alone": round(statistics.median(compile_s), 2),
              "compile_s_without_gemm_autotuning": round(statistics.median(no_gemm_tuning_s), 2),
              "others": len(configs[alone:]),
              "others_on_16_threads_s": round(_compile_all(ba, configs[alone:], arguments, 16), 1)})


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
