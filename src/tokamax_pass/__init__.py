"""tokamax_pass: fast JAX kernels for Hopper GPUs, autotuned, and the pass that bakes them in.

The ops (`dot_product_attention`, `layer_norm`, `ragged_dot`, `gated_linear_unit`,
`linear_softmax_cross_entropy_loss`, `triangle_multiplication`), their implementation
classes and the MoE routing functions (`moe_dispatch`, `moe_combine`) live in
`tokamax_kernels` and are re-exported here lazily, so `import tokamax_pass` stays
cheap and the framework never imports a kernel from inside. `tokamax_pass.ops` is
upstream Tokamax's `tokamax.ops` namespace over the same ops.
"""

from __future__ import annotations

import importlib
from typing import Any

from tokamax_pass.artifact import (
    Artifact,
    ArtifactIntegrityError,
    ArtifactMismatchError,
    ExportFallbackWarning,
    LoadedArtifact,
)
from tokamax_pass.core import BoundArguments, NullConfig, Op, snake_case_name
from tokamax_pass.core.errors import AllImplementationsFailedError
from tokamax_pass.core.spec import SpecError, register_serializable

# Imported eagerly: the functions share their modules' names, and a lazy import would
# leave the package attribute bound to the module (the import system sets it).
from tokamax_pass.export import DISABLE_JAX_EXPORT_CHECKS, export, inspect, load_artifact
from tokamax_pass.optimize import optimize
from tokamax_pass.version import __git_revision__, __version__, __version_info__

# Op families, in `tokamax_kernels`; each package's `__all__` lists what it exports.
_KERNEL_PACKAGES = ("attention", "layer_norm", "ragged_dot", "gated_linear_unit",
                    "linear_softmax_cross_entropy_loss", "triangle_multiplication")

# The op functions and the names that go with them (upstream Tokamax's among them), for
# `from tokamax_pass import *`; the kernel classes are reached by name.
_OP_NAMES = (
    "DotProductAttentionImplementation",
    "RaggedDotGroupSizes",
    "dot_product_attention",
    "gated_linear_unit",
    "generate_ragged_dot_group_sizes",
    "layer_norm",
    "linear_softmax_cross_entropy_loss",
    "moe_combine",
    "moe_dispatch",
    "ragged_dot",
    "ragged_dot_general",
    "triangle_multiplication",
)

# Framework names defined in modules that are imported on first use.
_LAZY = {
    "autotune": "tokamax_pass.autotuning",
    "AutotuningResult": "tokamax_pass.autotuning",
    "autotuning": None,
    "config": None,
    "benchmarking": None,
    "batching": None,
    "benchmark": "tokamax_pass.benchmarking",
    "BenchmarkData": "tokamax_pass.benchmarking",
    "standardize_function": "tokamax_pass.benchmarking",
    "BatchedShapeDtype": "tokamax_pass.batching",
    "UnsavedResultError": "tokamax_pass.autotuning.cache",
    "ops": None,
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = _LAZY[name]
        if module is None:
            return importlib.import_module(f"tokamax_pass.{name}")
        return getattr(importlib.import_module(module), name)
    for package in _KERNEL_PACKAGES:
        try:
            family = importlib.import_module(f"tokamax_kernels.{package}")
        except ModuleNotFoundError as e:
            if e.name != f"tokamax_kernels.{package}":
                raise
            continue
        if name in getattr(family, "__all__", ()):
            return getattr(family, name)
    raise AttributeError(f"module 'tokamax_pass' has no attribute {name!r}")


def __dir__() -> list[str]:
    names = set(globals()) | set(_LAZY)
    for package in _KERNEL_PACKAGES:
        try:
            names |= set(importlib.import_module(f"tokamax_kernels.{package}").__all__)
        except ModuleNotFoundError:
            continue
    return sorted(names)


__all__ = [
    "DISABLE_JAX_EXPORT_CHECKS",
    "AllImplementationsFailedError",
    "Artifact",
    "ArtifactIntegrityError",
    "ArtifactMismatchError",
    "BoundArguments",
    "ExportFallbackWarning",
    "LoadedArtifact",
    "NullConfig",
    "Op",
    "SpecError",
    "__git_revision__",
    "__version__",
    "__version_info__",
    "export",
    "inspect",
    "load_artifact",
    "optimize",
    "register_serializable",
    "snake_case_name",
]
__all__ += list(_LAZY)
__all__ += list(_OP_NAMES)

# Registers the autotuning results and caches as a config source (cheap: no compilation).
import tokamax_pass.autotuning  # noqa: E402, F401
