"""Two `jax.distributed` processes on loopback: process 0 autotunes, both get its result."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import jax
import pytest

import tokamax_pass as tk
from _tunable_ops import ChunkConfig, XlaChunkedMatmul
from tokamax_pass.autotuning import distributed, keys
from tokamax_pass.autotuning.entry import Entry, Measurement
from tokamax_pass.core import spec
from tokamax_pass.core.spec import SpecError

TESTS = pathlib.Path(__file__).resolve().parents[1]  # where `_tunable_ops` lives

WORKER = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, pid = sys.argv[1], int(sys.argv[2])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=60)
    import tokamax_pass as tk
    from tokamax_pass.autotuning import autotuner
    from _tunable_ops import XlaChunkedMatmul

    tuned = []
    original = autotuner.Autotuner.tune_many
    def counting_tune(self, plans):
        tuned.extend(plans)
        return original(self, plans)
    autotuner.Autotuner.tune_many = counting_tune

    x = jax.random.normal(jax.random.key(0), (64, 32))
    w = jax.random.normal(jax.random.key(1), (32, 16))
    result = tk.autotune([XlaChunkedMatmul().bind(x, w)], progress=False, ignore_cache=True,
                         iterations=2)
    print("RESULT " + json.dumps({"process": jax.process_index(), "count": jax.process_count(),
                                  "tuned": len(tuned), "result": result.dumps()}), flush=True)
    jax.distributed.shutdown()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_process_zero_tunes_and_every_process_gets_the_same_result(tmp_path):
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
           "TOKAMAX_PASS_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    reports = [json.loads(next(line[len("RESULT "):] for line in out.splitlines()
                               if line.startswith("RESULT "))) for out in outputs]
    assert [r["process"] for r in reports] == [0, 1]
    assert all(r["count"] == 2 for r in reports)
    assert reports[0]["tuned"] == 1 and reports[1]["tuned"] == 0  # only process 0 measured
    assert reports[0]["result"] == reports[1]["result"]
    assert len(json.loads(reports[0]["result"])["entries"]) == 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class UsersMatmul(XlaChunkedMatmul):
    """An op of the user's: neither registered nor lowered in this process."""


class _ProcessZero:
    """The key-value store as a process other than 0 sees it: process 0's result text."""

    def __init__(self, text: str) -> None:
        self.text = text

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        return self.text


def test_other_processes_read_process_zeros_result_as_process_zero_does(monkeypatch):
    """Process 1 finds the calls of a user's op that only process 0 lowered itself
    before reading process 0's result, so it runs process 0's configs; an entry it still
    cannot read is an error, not skipped with a warning."""
    x, w = jax.ShapeDtypeStruct((64, 32), "float32"), jax.ShapeDtypeStruct((32, 16), "float32")
    ba = keys.canonical(UsersMatmul().bind(x, w))
    kind = jax.devices()[0].device_kind
    text = tk.AutotuningResult(kind, [Entry(ba, {ChunkConfig(16): Measurement((1.0,))},
                                            keys.provenance(ba.op))]).dumps()
    monkeypatch.setattr(distributed, "is_multiprocess", lambda: True)
    monkeypatch.setattr(distributed.jax, "process_index", lambda: 1)
    monkeypatch.setattr(distributed, "_client", lambda: _ProcessZero(text))
    result = tk.autotune([ba], progress=False)
    assert [type(b.op) for b, _ in result] == [UsersMatmul]
    monkeypatch.setattr(distributed, "_client", lambda: _ProcessZero(
        text.replace(spec.import_path(UsersMatmul), "their_models.TheirMatmul")))
    with pytest.raises(SpecError, match="read by process 1.*TheirMatmul"):
        tk.autotune([ba], progress=False)
