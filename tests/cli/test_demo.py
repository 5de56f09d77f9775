"""`tokamax-pass demo` runs the seed example and prints its op table: every op call
must run (a failed op fails the demo and this test)."""

import re

import pytest

from tokamax_pass import cli
from tokamax_pass.commands import demo

ROW = re.compile(r"^  (\w+) +(\w+) +.*?(\S+) *$")


def _op_rows(out: str) -> dict[str, str]:
    """`{op call: its ms cell}` from the demo's table (the lines under its dashes)."""
    table = out.split("\n  --")[1].splitlines()[1:]
    return {m.group(1): m.group(3) for m in map(ROW.match, table) if m}


@pytest.mark.slow
def test_demo_runs_every_op_call(capsys):
    assert cli.main(["demo", "--shape", "2", "64", "2", "16", "--iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert "implementation='triton' -> None" in out  # the GPU kernels cannot run on CPU
    assert "finite: True" in out
    assert "same result as jax.jit: True" in out
    tuned = re.search(r"tokamax.autotune: (\d+) op calls tuned", out)
    assert tuned and int(tuned.group(1)) >= 2, out  # the chunked attention and its VJP
    assert "failed" not in out, out
    rows = _op_rows(out)
    for op in ("LayerNorm", "XlaChunkedDotProductAttention", "XlaDotProductAttentionVjp",
               "XlaChunkedDotProductAttentionVjp"):
        assert op in rows, out
    for op, ms in rows.items():
        assert float(ms) > 0, (op, ms)


def test_a_failing_op_call_fails_the_demo(capsys, monkeypatch):
    def broken(ba, iterations):
        raise RuntimeError("broken kernel")

    monkeypatch.setattr(demo, "op_time_ms", broken)
    assert cli.main(["demo", "--shape", "2", "64", "2", "16", "--iterations", "2",
                     "--no-autotune"]) == 1
    out = capsys.readouterr().out
    assert "failed: RuntimeError" in out
    assert re.search(r"\d+ op calls? failed", out), out
