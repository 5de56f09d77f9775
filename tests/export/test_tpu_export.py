"""One artifact for CPU, CUDA and TPU from this CPU machine: each platform's lowering holds
its own kernels (`examples/mosaic_model.py`: XLA on CPU, Mosaic GPU on the H200, Mosaic
TPU on the TPU), through the Python API and the CLI the Bazel rule runs."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

import tokamax_pass as tk
from examples import mosaic_model
from tokamax_pass import cli, core

KINDS = ("NVIDIA H200", "TPU v6 lite")


def _check(manifest: dict) -> None:
    assert manifest["platforms"] == ["cpu", "cuda", "tpu"]
    assert manifest["device_kinds"] == {"cpu": "cpu", "cuda": "NVIDIA H200",
                                        "tpu": "TPU v6 lite"}
    assert {"mosaic_gpu_v2", "tpu_custom_call"} <= set(manifest["custom_calls"])
    by_platform = {}
    for row in manifest["ops"]:
        by_platform.setdefault(row["platform"], set()).add(row["op"])
    assert by_platform["tpu"] >= {"PallasMosaicTpuRaggedDot", "PallasMosaicTpuFlashAttention",
                                  "PallasMosaicTpuFlashAttentionVjp"}
    assert by_platform["cuda"] >= {"PallasMosaicGpuRaggedDot", "PallasMosaicGpuFlashAttention"}
    assert not any(op.startswith("Pallas") for op in by_platform["cpu"])


def test_export_for_three_platforms_in_one_artifact():
    artifact = tk.export(mosaic_model.loss_grad, *mosaic_model.ARG_SPECS,
                         platforms=("cpu", "cuda", "tpu"), device_kind=KINDS)
    _check(artifact.manifest)
    assert artifact.manifest["device_kind"] == "NVIDIA H200,TPU v6 lite"


def test_cli_or_bazel_artifact_for_three_platforms(tmp_path):
    """Under `bazel test` the artifact comes from the `//:mosaic_artifact` rule; under plain
    pytest the test builds it with the CLI command the rule runs."""
    out = pathlib.Path("mosaic_artifact")
    if "TEST_SRCDIR" not in os.environ:
        out = tmp_path / "mosaic_artifact"
        assert cli.main(["export", "examples.mosaic_model:loss_grad", "--args",
                         *mosaic_model.ARG_SPECS, "--platforms", "cpu,cuda,tpu",
                         "--device-kind", ",".join(KINDS), "-o", str(out)]) == 0
    _check(json.loads((out / "manifest.json").read_text()))


def test_device_kinds_must_match_the_platforms():
    with pytest.raises(ValueError, match="'TPU v6 lite', a tpu device.*no 'tpu'"):
        tk.export(mosaic_model.loss_grad, *mosaic_model.ARG_SPECS, platforms=("cpu", "cuda"),
                  device_kind=KINDS)
    with pytest.raises(ValueError, match="two tpu devices"):
        core.device.kinds_by_platform("TPU v5p,TPU v6 lite")
    assert core.device.kinds_by_platform("TPU v5 lite") == {"tpu": "TPU v5 lite"}
    assert core.device.platform_of_kind("NVIDIA H200") == "cuda"
