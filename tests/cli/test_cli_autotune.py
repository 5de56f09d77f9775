"""`tokamax-pass autotune | cache | bound-args` and the xplane_to_bound_args tool, on CPU."""

from __future__ import annotations

import glob

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from tokamax_pass import cli
from tokamax_pass.autotuning import cache
from tokamax_pass.tools import xplane_to_bound_args

SHAPES = ["f32[16,64]", "f32[64,32]"]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKAMAX_PASS_CACHE_DIR", str(tmp_path / "user"))
    cache._USER.invalidate()


def test_autotune_command_writes_a_result(tmp_path, capsys):
    out = tmp_path / "result.json"
    assert cli.main(["autotune", "_tunable_ops:loss", "--args", *SHAPES, "--grad",
                     "-o", str(out), "--no-progress"]) == 0
    result = tokamax.AutotuningResult.load(out)
    [(ba, data)] = list(result)
    assert type(ba.op).__name__ == "XlaChunkedMatmul" and len(data) == 5
    printed = capsys.readouterr().out
    assert "XlaChunkedMatmul" in printed and "autotuning took" in printed


def test_autotune_command_writes_the_result_the_cache_refused(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("TOKAMAX_PASS_CACHE_DIR", str(tmp_path / "a_file" / "cache"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    out = tmp_path / "result.json"
    with pytest.raises(SystemExit, match="UnsavedResultError: .* the result is in "):
        cli.main(["autotune", "_tunable_ops:loss", "--args", *SHAPES, "--grad",
                  "-o", str(out), "--cache", "--no-progress"])
    [(ba, data)] = list(tokamax.AutotuningResult.load(out))
    assert type(ba.op).__name__ == "XlaChunkedMatmul" and len(data) == 5


@pytest.mark.parametrize("flags, chunked_configs", [
    pytest.param([], 1, id="staged: the losing kernel keeps its first config"),
    pytest.param(["--search-losers"], 5, id="--search-losers: every config"),
])
def test_autotune_all_implementations_searches_losers_only_when_asked(
        tmp_path, monkeypatch, flags, chunked_configs):
    from tokamax_pass.autotuning import staging

    monkeypatch.setattr(staging, "TUNING_GAIN", 1e9)  # no kernel could win after tuning
    out = tmp_path / "result.json"
    assert cli.main(["autotune", "_tunable_ops:loss", "--args", *SHAPES, "--grad",
                     "--all-implementations", "--ignore-cache", "-o", str(out),
                     "--no-progress", *flags]) == 0
    timed = {type(ba.op).__name__: len(data) for ba, data in tokamax.AutotuningResult.load(out)}
    assert timed == {"XlaChunkedMatmul": chunked_configs, "ChunkedMatmul": 1,
                     "AutodiffVjp": 1}  # the gradient of the XLA reference: no configs


def test_bound_args_command_then_autotune_from_the_file(tmp_path):
    listing = tmp_path / "bound_args.json"
    assert cli.main(["bound-args", "_tunable_ops:loss", "--args", *SHAPES, "--grad",
                     "-o", str(listing)]) == 0
    bound = tokamax.autotuning.bound_args_from_json(str(listing))
    assert sorted(type(b.op).__name__ for b in bound) == ["AutodiffVjp", "XlaChunkedMatmul"]
    out = tmp_path / "result.json"
    assert cli.main(["autotune", "--bound-args", str(listing), "-o", str(out),
                     "--no-progress", "--cache",
                     "--write-library-cache", str(tmp_path / "lib")]) == 0
    assert len(tokamax.AutotuningResult.load(out)) == 1
    [shipped] = (tmp_path / "lib").glob("*/xla_chunked_matmul.json")
    assert len(tokamax.AutotuningResult.load(shipped)) == 1
    assert len(cache.read(cache.cache_file(jax.devices()[0].device_kind))) == 1


def test_cache_commands(tmp_path, capsys):
    out = tmp_path / "result.json"
    cli.main(["autotune", "_tunable_ops:loss", "--args", *SHAPES, "-o", str(out),
              "--no-progress"])
    folder = tmp_path / "elsewhere"
    assert cli.main(["cache", "--cache-dir", str(folder), "import", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["cache", "--cache-dir", str(folder), "list"]) == 0
    assert "1 entries" in capsys.readouterr().out
    assert cli.main(["cache", "--cache-dir", str(folder), "show"]) == 0
    assert "XlaChunkedMatmul" in capsys.readouterr().out
    assert cli.main(["cache", "--cache-dir", str(folder), "clear"]) == 0
    assert "removed" in capsys.readouterr().out
    assert list(folder.glob("*.json")) == []


def _seed_loss(x, scale):
    x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=None)
    x = tokamax.dot_product_attention(x, x, x, implementation="xla_chunked")
    return jnp.sum(x)


def test_xplane_to_bound_args_end_to_end(tmp_path, capsys):
    x = jax.random.normal(jax.random.key(1), (2, 32, 2, 16), dtype=jnp.bfloat16)
    scale = jax.random.normal(jax.random.key(0), (16,), dtype=jnp.float32)
    f_grad = jax.jit(jax.grad(_seed_loss))
    with jax.profiler.trace(str(tmp_path / "trace")):
        jax.block_until_ready(f_grad(x, scale))
    [xplane] = glob.glob(str(tmp_path / "trace" / "**" / "*.xplane.pb"), recursive=True)
    output = tmp_path / "bound_args.json"
    assert xplane_to_bound_args.main([f"--xplane_file={xplane}",
                                      f"--output_file={output}"]) == 0
    from_profile = tokamax.autotuning.bound_args_from_json(str(output))
    from_program = tokamax.autotuning.get_bound_args(f_grad, x, scale)
    # The profile holds every program the process had loaded, so earlier tests' ops too.
    assert len(from_program) == 4  # layer norm, chunked attention and their VJP ops
    assert {b.to_json() for b in from_program} <= {b.to_json() for b in from_profile}
    again = tmp_path / "again.json"
    assert cli.main(["bound-args", "--xplane_file", xplane, "-o", str(again)]) == 0
    assert again.read_text() == output.read_text()
    ours = [b for b in from_profile if b.to_json() in {p.to_json() for p in from_program}]
    result = tokamax.autotune(ours, progress=False)
    assert {type(b.op).__name__ for b, _ in result} == {
        "XlaChunkedDotProductAttention", "XlaChunkedDotProductAttentionVjp"}


def test_xplane_skips_op_calls_it_cannot_load(tmp_path):
    """A profile of a process that ran an op defined inside a function (it cannot be
    imported back by name): that call is skipped with a warning, the others are kept."""
    import dataclasses

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Local(tokamax.Op):
        def _fwd(self, x, *, config, return_residuals):
            return 2 * x, None

    x = jax.random.normal(jax.random.key(2), (4, 16))
    scale = jax.random.normal(jax.random.key(3), (16,))
    with jax.profiler.trace(str(tmp_path / "trace")):
        jax.block_until_ready(jax.jit(lambda x: Local()(x))(x))
        jax.block_until_ready(jax.jit(lambda x, s: tokamax.layer_norm(x, s, None))(x, scale))
    [xplane] = glob.glob(str(tmp_path / "trace" / "**" / "*.xplane.pb"), recursive=True)
    with pytest.warns(UserWarning, match="cannot be loaded here.*Local"):
        bound = xplane_to_bound_args.bound_args_from_xplane(xplane)
    assert "LayerNorm" in {type(b.op).__name__ for b in bound}


def test_not_a_profile_is_a_clear_error(tmp_path):
    """The library's own error (a `SpecError`, as every loader's), naming the file."""
    from tokamax_pass.core.spec import SpecError

    bogus = tmp_path / "x.xplane.pb"
    bogus.write_bytes(b"\xff\xff not a profile")
    with pytest.raises(SpecError, match="x.xplane.pb is not an XSpace profile"):
        xplane_to_bound_args.bound_args_from_xplane(bogus)


def test_autotune_says_why_nothing_was_timed(tmp_path, monkeypatch, capsys):
    """A layer norm on CPU runs `xla`, which has no configs: the command printed an empty
    table and nothing else, not the options that time more."""
    (tmp_path / "norm_only.py").write_text(
        "import tokamax_pass\n\n"
        "def f(x):\n"
        "    return tokamax_pass.layer_norm(x, None, None).sum()\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["autotune", "norm_only:f", "--args", "f32[4,8]", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "0 ops" in printed
    assert "note: nothing was timed" in printed
    assert "--all-implementations" in printed and "--ignore-cache" in printed
