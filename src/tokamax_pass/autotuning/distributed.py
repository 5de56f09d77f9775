"""Autotuning in a multi-process (`jax.distributed`) run: tune once, share the result.

Every process must compile the same kernels with the same configs: an SPMD program
whose ranks differ in config could deadlock or give rank-dependent numerics. So
process 0 tunes and publishes its `AutotuningResult` JSON in the distributed
key-value store (no device collective needed); every other process waits for it.
Calls are matched by order (every process calls `autotune` the same number of
times, as SPMD programs do).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax

from tokamax_pass.autotuning.result import AutotuningResult

_KEY_PREFIX = "tokamax_pass/autotuning/result/"
_CALLS = itertools.count()


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "autotune: jax.process_count() > 1 but jax.distributed is not initialized; "
            "call jax.distributed.initialize() first"
        )
    return client


def tune_once(tune: Callable[[], AutotuningResult], *,
              discover: Callable[[], object] = lambda: None,
              timeout_s: float = 3600.0) -> AutotuningResult:
    """`tune()` on process 0; every process returns process 0's result.

    The other processes run `discover()` (lowering the tuned function, which lets them
    name the ops it calls: `spec.remember_lowered`) and read the result strictly, so no
    process skips an entry (an op of the user's that only process 0 had lowered) and runs
    other configs than process 0's. `timeout_s` bounds how long the
    other processes wait for it.
    """
    if not is_multiprocess():
        return tune()
    key = f"{_KEY_PREFIX}{next(_CALLS)}"
    client = _client()
    if jax.process_index() == 0:
        try:
            text = tune().dumps()
        except BaseException as e:
            client.key_value_set(key, "error: " + repr(e))
            raise
        client.key_value_set(key, text)
        return AutotuningResult.loads(text)
    discover()
    text = client.blocking_key_value_get(key, int(timeout_s * 1000))
    if text.startswith("error: "):
        raise RuntimeError(f"autotune failed on process 0: {text[len('error: '):]}")
    return AutotuningResult.loads(
        text, what=f"process 0's autotuning result (read by process {jax.process_index()})",
        strict=True)
