"""`tokamax-pass export` and `tokamax-pass inspect`."""

from __future__ import annotations

import json
import textwrap
import warnings

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tk
from _square_op import ChunkConfig, fastest_result, square_bound
from conftest import H200, assert_close, measured, random_normal, reference_precision
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_triton import PallasTritonLayerNorm
from tokamax_pass.artifact import ExportFallbackWarning
from tokamax_pass.cli import main

MODEL = textwrap.dedent("""
    import jax.numpy as jnp
    import tokamax_pass as tk
    from _square_op import square

    def loss(x, scale):
        return jnp.sum(tk.layer_norm(x, scale, None) ** 2)

    def squared(x, scale):
        return jnp.sum(square(x, scale))
""")


@pytest.fixture
def model(tmp_path, monkeypatch):
    (tmp_path / "cli_model.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import cli_model

    return cli_model


def test_export_then_inspect(model, tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["export", "cli_model:loss", "--grad", "--args", "f32[8,32]", "f32[32]",
                 "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["function"] == "cli_model.loss"
    assert [op["path"] for op in manifest["ops"]] == ["layer_norm", "layer_norm_vjp"]
    x, scale = random_normal(0, (8, 32)), random_normal(1, (32,))
    with reference_precision():
        assert_close(tk.load_artifact(out)(x, scale), jax.jit(jax.grad(model.loss))(x, scale))
    assert main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layer_norm_vjp" in printed and "LayerNorm" in printed and "AutodiffVjp" in printed
    assert main(["inspect", str(out / "loss.stablehlo"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [o["op"] for o in data["ops"]] == ["LayerNorm", "AutodiffVjp"]
    # The manifest stands for its artifact (it was "not StableHLO/MLIR or HLO text").
    assert main(["inspect", str(out / "manifest.json")]) == 0
    assert capsys.readouterr().out == printed


def test_export_with_symbolic_dimensions_runs_at_every_size(model, tmp_path, capsys):
    """A dimension named in `--args` is one symbol in every spec (`b`), an expression of
    names is one (`2*t`); the artifact runs at any sizes they take. `autotune` measures
    concrete shapes only, and a spec that is no symbolic shape is a one-line error."""
    out = tmp_path / "art"
    assert main(["export", "cli_model:loss", "--grad", "--args", "f32[b,2*t,32]", "f32[32]",
                 "-o", str(out)]) == 0
    assert "kernels: XLA only" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["in_specs"][0] == "f32[b,2*t,32]"
    artifact = tk.load_artifact(out)
    for shape in ((2, 4, 32), (3, 6, 32)):
        x, scale = random_normal(0, shape), random_normal(1, (32,))
        with reference_precision():
            assert_close(artifact(x, scale), jax.jit(jax.grad(model.loss))(x, scale))
    with pytest.raises(SystemExit, match="no symbolic shape"):
        main(["export", "cli_model:loss", "--args", "f32[b,2*,32]", "f32[32]", "-o",
              str(tmp_path / "bad")])
    with pytest.raises(SystemExit, match=r"dimensions end with '\]'"):
        main(["export", "cli_model:loss", "--args", "f32[b,32", "f32[32]", "-o",
              str(tmp_path / "bad")])
    with pytest.raises(SystemExit, match="names a dimension: this command runs concrete"):
        main(["autotune", "cli_model:loss", "--args", "f32[b,32]", "f32[32]", "-o",
              str(tmp_path / "tuned.json")])


def test_export_for_cpu_and_h200_with_results(model, tmp_path, capsys):
    x, scale = random_normal(0, (8, 16)), random_normal(1, (16,))
    tuned = tmp_path / "tuned.json"
    fastest_result((square_bound(x, scale), ChunkConfig(4))).dump(str(tuned))
    # The H200 measured the Triton norm faster at this shape: `None` takes it for cuda.
    x64 = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    scale64 = jax.ShapeDtypeStruct((64,), jnp.float32)
    h200 = tmp_path / "h200.json"
    measured(H200, {PallasTritonLayerNorm(): 1.0, LayerNorm(): 2.0}, x64, scale64,
             None).dump(str(h200))
    out = tmp_path / "both"
    assert main(["export", "cli_model:loss", "--args", "f32[8,64]", "f32[64]",
                 "--platforms", "cpu,cuda", "--device-kind", H200, "--results", str(h200),
                 "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["device_kinds"] == {"cpu": "cpu", "cuda": H200}
    assert {(op["platform"], op["implementation"]) for op in manifest["ops"]} == {
        ("cpu", "xla"), ("cuda", "triton")}
    assert main(["inspect", str(out)]) == 0
    assert "__gpu$xla.gpu.triton" in capsys.readouterr().out
    out2 = tmp_path / "tuned"
    assert main(["export", "cli_model:squared", "--args", "f32[8,16]", "f32[16]",
                 "--results", str(tuned), "-o", str(out2)]) == 0
    (op,) = json.loads((out2 / "manifest.json").read_text())["ops"]
    assert (op["config"], op["source"]) == ("ChunkConfig(chunk=4)", "autotuning result")


def test_fallbacks_alike_are_said_once_with_their_count():
    """A model's layers fall back alike: one line each, counted, not one per call."""
    from tokamax_pass.artifact import describe_fallbacks

    forward = dict(path="dot_product_attention", platform="cuda", device_kind=H200,
                   exported="mosaic", target_runs="cudnn")
    backward = {**forward, "path": "dot_product_attention_vjp"}
    assert describe_fallbacks([forward, backward, forward]) == [
        f"dot_product_attention on cuda ({H200}): mosaic in place of cudnn (2 calls)",
        f"dot_product_attention_vjp on cuda ({H200}): mosaic in place of cudnn"]


def test_export_from_cpu_says_where_the_target_would_run_cudnn(tmp_path, capsys):
    """The seed model for the H200 from this CPU machine: the shipped cache ranks cuDNN's
    attention forward first, which cannot be lowered here; the export runs the next
    measured kernel and says so, in the manifest and on the command line (once: its
    note, not also the Python API's warning)."""
    out = tmp_path / "seed"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["export", "examples.seed_model:loss", "--grad", "--args",
                     "bf16[32,2048,16,64]", "f32[64]", "--platforms", "cuda",
                     "--device-kind", H200, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "note: 2 op call(s) run another implementation" in printed
    assert f"  dot_product_attention on cuda ({H200}): " in printed
    assert "in place of cudnn" in printed
    assert not [w for w in caught if issubclass(w.category, ExportFallbackWarning)]
    sources = {op["path"]: op["source"]
               for op in json.loads((out / "manifest.json").read_text())["ops"]}
    assert sources["dot_product_attention"] == (
        "library cache (cudnn on the target: cannot be lowered here)")
    assert sources["dot_product_attention_vjp"] == "library cache"  # Mosaic there too


def test_inspect_lowered_text(model, tmp_path, capsys):
    x, scale = random_normal(0, (8, 32)), random_normal(1, (32,))
    path = tmp_path / "lowered.txt"
    path.write_text(jax.jit(model.loss).lower(x, scale).as_text())
    assert main(["inspect", str(path)]) == 0
    assert "LayerNorm" in capsys.readouterr().out


def test_errors(model, tmp_path):
    with pytest.raises(SystemExit, match="not an array spec"):
        main(["export", "cli_model:loss", "--args", "f32(8)", "-o", str(tmp_path)])
    with pytest.raises(SystemExit, match="MODULE:FUNCTION"):
        main(["export", "cli_model.loss", "--args", "f32[8]", "-o", str(tmp_path)])
    with pytest.raises(SystemExit, match="--results"):
        main(["export", "cli_model:loss", "--args", "f32[8,32]", "f32[32]",
              "--results", str(tmp_path / "missing.json"), "-o", str(tmp_path)])
    with pytest.raises(SystemExit, match="inspect: .* neither a file nor"):
        main(["inspect", str(tmp_path / "nothing")])


@pytest.fixture
def working_directory(tmp_path, monkeypatch):
    """A folder holding `my_model.py`, made the working directory, and a `sys.path`
    without it (as the console script starts; restored afterwards)."""
    import os
    import sys

    (tmp_path / "my_model.py").write_text(MODEL)
    (tmp_path / "broken_model.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    for name in ("my_model", "broken_model"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def test_cli_imports_from_the_working_directory(working_directory, capsys):
    assert main(["export", "my_model:loss", "--args", "f32[8,32]", "f32[32]",
                 "-o", str(working_directory / "art")]) == 0
    manifest = json.loads((working_directory / "art" / "manifest.json").read_text())
    assert manifest["function"] == "my_model.loss"


@pytest.mark.parametrize("target,match", [
    ("no_such_model:loss", r"cannot import 'no_such_model' .*ModuleNotFoundError"),
    ("broken_model:loss", r"cannot import 'broken_model' .*not_a_module_anywhere"),
    ("my_model:nothing", r"cannot import 'my_model:nothing': .* has no 'nothing'"),
])
def test_cli_import_errors_are_one_line(working_directory, target, match):
    with pytest.raises(SystemExit, match=match) as error:
        main(["export", target, "--args", "f32[8]", "-o", str(working_directory / "art")])
    assert "\n" not in str(error.value)


def _make_loss(power):
    def loss(x, scale):
        return jnp.sum(tk.layer_norm(x, scale, None) ** power)
    return loss


def test_exporting_a_program_twice_is_byte_identical(tmp_path):
    """The manifest names a local function by module and qualified name, not its repr."""
    dirs = []
    for i in range(2):
        tk.export(_make_loss(2), "f32[8,32]", "f32[32]").save(tmp_path / str(i))
        dirs.append(tmp_path / str(i))
    files = sorted(p.name for p in dirs[0].iterdir())
    assert files == ["loss.stablehlo", "manifest.json"]
    for name in files:
        assert (dirs[0] / name).read_bytes() == (dirs[1] / name).read_bytes(), name
    manifest = json.loads((dirs[0] / "manifest.json").read_text())
    assert manifest["function"] == "test_cli_export._make_loss.<locals>.loss"
