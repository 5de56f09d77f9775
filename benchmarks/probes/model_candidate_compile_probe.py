"""Device probe: each `autotune` candidate of a model compiled alone, one after another.

What the concurrent compile phase of `tokamax.autotune(..., all_implementations=True)`
hides: for every implementation of every op call of one `benchmarks/models` model, its
first config is lowered and compiled on its own (an XLA implementation also with XLA's GEMM
autotuning off, `xla_gpu_autotune_level=0`, first, so the difference is what that
autotuning costs), then the other configs until a time budget is spent. Also the time
`discovery` takes to find the op calls, twice, and once while export workers start.

Run on the H200 from the repository root:
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/model_candidate_compile_probe.py mixtral 120
(120: seconds for the configs after the first). One JSON line per event goes to
`$OUT/compile_cost_<model>.jsonl`: `lower_s` and `compile_s` in wall seconds, `_cpu` the process's
CPU seconds meanwhile.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jax

from benchmarks.models import MODELS, ops, run
from tokamax_pass import benchmarking
from tokamax_pass.autotuning import api, autotuner, discovery, lowering, timing_inputs
from tokamax_pass.core.device import current_target

# XLA's GEMM autotuning off: what the candidate costs without it.
NO_GEMM_AUTOTUNING = {"xla_gpu_autotune_level": 0}


class _Log:
    """JSON lines to a file (flushed each, so a run cut short keeps what it measured)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "w")  # noqa: SIM115 - open for the probe's life

    def __call__(self, **row: Any) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        print(json.dumps(row), flush=True)


def _timed(fn: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return value, time.perf_counter() - wall, time.process_time() - cpu


def _compile_alone(log: _Log, ba: Any, config: Any, stage: int, options: Any = None) -> None:
    op = ba.op.replace(config=config)
    arguments = timing_inputs.operand_shapes(ba)
    f_std, specs = benchmarking.standardize_function(
        lowering.call_op(op, ba.vmap, arguments), arguments, seed=None)
    error = None
    lower_s = lower_cpu = compile_s = compile_cpu = 0.0
    try:
        lowered, lower_s, lower_cpu = _timed(lambda: jax.jit(f_std).lower(specs))
        _, compile_s, compile_cpu = _timed(lambda: lowered.compile(compiler_options=options))
    except Exception as e:  # noqa: BLE001 - a failing candidate is a row
        error = f"{type(e).__name__}: {str(e)[:200]}"
    log(event="candidate", stage=stage, op=type(ba.op).__name__,
        xla=autotuner._compiles_gemms_with_xla(ba.op), level0=options is not None,
        config=str(config)[:120], lower_s=round(lower_s, 3), lower_cpu=round(lower_cpu, 3),
        compile_s=round(compile_s, 3), compile_cpu=round(compile_cpu, 3), error=error)


def main(name: str, budget_s: float) -> None:
    log = _Log(os.path.join(os.environ.get("OUT", "/tmp"), f"compile_cost_{name}.jsonl"))
    model = MODELS[name]
    params, batch = run._inputs(model, smoke=False)
    step = jax.grad(model.loss_fn(ops.variants()["ours"], smoke=False))
    target = current_target()
    for attempt in range(2):
        bound, wall, cpu = _timed(lambda: discovery.get_bound_args(step, params, batch))
        log(event="discovery", attempt=attempt, s=wall, cpu=cpu, calls=len(bound))
    workers = lowering.start_early(None)
    _, wall, cpu = _timed(lambda: discovery.get_bound_args(step, params, batch))
    log(event="discovery_with_workers_starting", s=wall, cpu=cpu)
    if workers is not None:
        workers.close()
    groups = api._expand(bound, target)
    plans = [[plan for ba in group if (plan := api._plan(
        ba, api.DEFAULT_MAX_CONFIGS, target.device_kind)) is not None] for group in groups]
    log(event="plans", impl_calls=sum(map(len, plans)),
        candidates=sum(len(c) for group in plans for _, c in group))
    start = time.perf_counter()
    for group in plans:
        for ba, configs in group:
            if autotuner._compiles_gemms_with_xla(ba.op):
                _compile_alone(log, ba, configs[0], 1, NO_GEMM_AUTOTUNING)
            _compile_alone(log, ba, configs[0], 1)
    log(event="stage1_sequential", s=time.perf_counter() - start)
    start = time.perf_counter()
    for group in plans:
        for ba, configs in group:
            for config in configs[1:]:
                if time.perf_counter() - start < budget_s:
                    _compile_alone(log, ba, config, 2)
    log(event="rest_sequential", s=time.perf_counter() - start)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mixtral",
         float(sys.argv[2]) if len(sys.argv) > 2 else 120.0)
