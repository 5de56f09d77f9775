"""A tuned artifact of the seed model (built by Bazel's `tokamax_stablehlo`) loads and runs.

Under `bazel test` the artifact comes from the `//:seed_artifact` rule; under plain
pytest the test builds the same artifact with the CLI the rule runs.
"""

import os
import pathlib

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from examples import seed_model
from tokamax_pass import cli

ARG_SPECS = ["bf16[2,128,4,64]", "f32[64]"]


def _artifact_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    if "TEST_SRCDIR" in os.environ:
        return pathlib.Path("seed_artifact")
    out = tmp_path / "seed_artifact"
    assert cli.main(["export", "examples.seed_model:loss_grad", "--args", *ARG_SPECS,
                     "--platforms", "cpu,cuda", "--device-kind", "NVIDIA H200",
                     "-o", str(out)]) == 0
    return out


def test_seed_artifact_loads_and_matches_in_process(tmp_path):
    loaded = tokamax.load_artifact(_artifact_dir(tmp_path))
    x = random_normal(0, (2, 128, 4, 64), jnp.bfloat16)
    scale = random_normal(1, (64,))
    expected = jax.jit(seed_model.loss_grad)(x, scale)
    # The artifact wraps each platform's kernels in a platform switch, so XLA may fuse
    # differently from the in-process program: equal within bf16 rounding.
    assert_close(loaded(x, scale), expected, jnp.bfloat16)
