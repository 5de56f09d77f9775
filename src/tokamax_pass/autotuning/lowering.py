"""Autotuning candidates lowered in worker processes.

Lowering a Pallas kernel is Python work, and threads share one interpreter lock:
sixteen threads lowering Mosaic GPU kernels take about as long as one. The candidates of
ops declared slow to lower (`Op.slow_lowering`: the Mosaic GPU kernels) go to workers;
the rest lower in the tuning process, where they never wait for a worker to start. Worker
processes (`python -m tokamax_pass.autotuning.export_worker`, JAX on the CPU only, so they
never touch the accelerator) export each candidate for the target platform with
`jax.export`, as `tokamax_pass.export` does for artifacts; the tuning process
deserializes it and compiles it, which releases the lock. Workers are plain
subprocesses talking pickles over pipes, not `multiprocessing` ones, so the user's
main module is never re-run in them. A candidate a worker cannot export (an op that
needs the real device to lower, such as cuDNN's) is lowered in the tuning process as
before. The `lower_time_ms` of an exported candidate counts only the tuning process's
share (lowering the deserialized call).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax

from tokamax_pass.core import spec
from tokamax_pass.core.device import targeting
from tokamax_pass.core.op import Op

# Slow-lowering candidates (`Op.slow_lowering`) in a wave from which worker processes pay
# for their start (importing JAX and the kernels, a few seconds, in parallel with the
# wave's other work); the other candidates always lower in the tuning process.
MIN_CANDIDATES = 8
MAX_PROCESSES = 8
# A worker's command line. Its own module, which the package never imports: run as
# `-m` a module the package imported first would warn in every worker (runpy's
# "found in sys.modules" RuntimeWarning) and exist twice.
WORKER_COMMAND = (sys.executable, "-m", "tokamax_pass.autotuning.export_worker")


def call_op(op: Op, vmap: Any, arguments: dict[str, Any]) -> Callable[[dict], Any]:
    """A function of the arguments that calls `op`, vmapped as the op call was
    (`vmap`: its `BoundArguments.vmap` levels)."""

    def fn(args: dict[str, Any]) -> Any:
        return op(**args)

    if not vmap:
        return fn
    leaves, treedef = jax.tree.flatten(arguments, is_leaf=lambda v: v is None)
    operand = [i for i, leaf in enumerate(leaves) if spec.is_array(leaf)]
    for level in reversed(vmap):
        axes: list[Any] = [None] * len(leaves)
        for axis, i in zip(level.axes, operand, strict=True):
            axes[i] = axis
        fn = jax.vmap(fn, in_axes=(jax.tree.unflatten(treedef, axes),), axis_size=level.size)
    return fn


def export_candidate(op: Op, vmap: Any, arguments: dict[str, Any], platform: str,
                     device_kind: str | None) -> bytearray:
    """The serialized `jax.export` of `op` called on `arguments` (abstract), in the
    standardized form the autotuner compiles. Runs in a worker."""
    from tokamax_pass import benchmarking
    from tokamax_pass.export_checks import DISABLE_JAX_EXPORT_CHECKS
    f_std, specs = benchmarking.standardize_function(call_op(op, vmap, arguments), arguments,
                                                     seed=None)
    target = (targeting(device_kind) if device_kind and platform != "cpu"
              else contextlib.nullcontext())
    with target:
        exported = jax.export.export(jax.jit(f_std), platforms=[platform],
                                     disabled_checks=DISABLE_JAX_EXPORT_CHECKS)(specs)
    return exported.serialize()


def deserialized(blob: bytes | bytearray) -> Callable[[list[Any]], Any]:
    """The standardized function `f_std(arrays)` of an exported candidate."""
    exported = jax.export.deserialize(bytearray(blob))
    return exported.call


def process_count(requested: int | None, candidates: int, cpus: int) -> int:
    """Workers for a wave: `requested` if given, else enough to pay off on big waves."""
    if requested is not None:
        return requested
    return min(MAX_PROCESSES, max(1, cpus // 2)) if candidates >= MIN_CANDIDATES else 0


def start_early(requested: int | None) -> ExportWorkers | None:
    """Workers started before `autotune` traces the function, so they have imported JAX
    and the kernels by the time the first candidate needs them: `requested` of them when
    given, by default some on a GPU (where Mosaic GPU kernels are slow to lower)."""
    if requested is None:
        if jax.default_backend() != "gpu":
            return None
        requested = min(MAX_PROCESSES, max(1, (os.cpu_count() or 1) // 2))
    return ExportWorkers(requested) if requested > 0 else None


class ExportWorkers:
    """A few worker processes; `export(...)` runs `export_candidate` in an idle one."""

    def __init__(self, processes: int) -> None:
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._workers = [
            subprocess.Popen(WORKER_COMMAND, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
            for _ in range(processes)]
        self._idle: queue.Queue[subprocess.Popen] = queue.Queue()
        for worker in self._workers:
            self._idle.put(worker)
        self._alive = len(self._workers)
        self._lock = threading.Lock()

    def export(self, *request: Any) -> bytearray:
        """`export_candidate(*request)` in a worker; raises what it raised there."""
        worker = self._take()
        assert worker.stdin is not None and worker.stdout is not None  # started with PIPEs
        try:
            pickle.dump(request, worker.stdin)
            worker.stdin.flush()
            ok, payload = pickle.load(worker.stdout)
        except (OSError, EOFError, pickle.PickleError):
            with self._lock:
                self._alive -= 1
            raise
        self._idle.put(worker)
        if not ok:
            raise RuntimeError(f"the export worker failed: {payload}")
        return payload

    def _take(self) -> subprocess.Popen:
        while True:
            with self._lock:
                if not self._alive:
                    raise RuntimeError("every export worker has exited")
            with contextlib.suppress(queue.Empty):
                return self._idle.get(timeout=1.0)

    def close(self) -> None:
        for worker in self._workers:
            with contextlib.suppress(OSError):
                if worker.stdin is not None:
                    worker.stdin.close()
            worker.terminate()
