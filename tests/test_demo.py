"""`tokamax-pass demo` runs the seed example and prints its op table."""

from tokamax_pass import cli


def test_demo_prints_every_op_call(capsys):
    assert cli.main(["demo", "--shape", "1", "64", "2", "16", "--iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert "implementation='triton' -> None" in out  # the GPU kernels cannot run on CPU
    assert "same result as jax.jit: True" in out
    assert "op calls tuned" in out
    for op in ("LayerNorm", "XlaChunkedDotProductAttention", "DotProductAttentionVjp",
               "XlaChunkedDotProductAttentionVjp"):
        assert f"\n  {op} " in out
