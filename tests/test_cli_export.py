"""`tokamax-pass export` and `tokamax-pass inspect`."""

from __future__ import annotations

import json
import textwrap

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tk
from conftest import H200, assert_close, measured, random_normal, reference_precision
from test_optimize import ChunkConfig, _result, _square_bound
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_triton import PallasTritonLayerNorm
from tokamax_pass.cli import main

MODEL = textwrap.dedent("""
    import jax.numpy as jnp
    import tokamax_pass as tk
    from test_optimize import square

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


def test_export_for_cpu_and_h200_with_results(model, tmp_path, capsys):
    x, scale = random_normal(0, (8, 16)), random_normal(1, (16,))
    tuned = tmp_path / "tuned.json"
    _result((_square_bound(x, scale), ChunkConfig(4))).dump(str(tuned))
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
