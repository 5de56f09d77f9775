"""Exporting programs that call tokamax_pass kernels: tuned StableHLO artifacts.

`export(fun, *arg_specs)` runs the pass for each requested platform and serializes
the program with `jax.export` (see `artifact.py` for the artifact, its manifest and
`load_artifact`'s checks). This module only puts `optimize` and the artifact together:
`Optimized.export` makes artifacts without importing it back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokamax_pass.artifact import (
    Artifact,
    ArtifactIntegrityError,
    ArtifactMismatchError,
    ExportFallbackWarning,
    LoadedArtifact,
    check_compatible,
    function_name,
    inspect,
    load_artifact,
)
from tokamax_pass.export_checks import DISABLE_JAX_EXPORT_CHECKS
from tokamax_pass.optimize import Optimized, optimize

__all__ = [
    "DISABLE_JAX_EXPORT_CHECKS", "Artifact", "ArtifactIntegrityError", "ArtifactMismatchError",
    "ExportFallbackWarning", "LoadedArtifact", "check_compatible", "export", "function_name",
    "inspect", "load_artifact",
]


def export(fun: Callable[..., Any], *arg_specs: Any, platforms: Sequence[str] | None = None,
           device_kind: str | Sequence[str] | None = None, name: str | None = None) -> Artifact:
    """Exports `fun` (a function or `optimize(...)`) with every op resolved and pinned.

    Args:
      fun: the function; a plain function is wrapped with `optimize` first.
      *arg_specs: one per positional argument: arrays, `jax.ShapeDtypeStruct`s or spec
        strings like `"bf16[32,2048,16,64]"` (pytrees of them; statics as values).
      platforms: e.g. `("cpu", "cuda", "tpu")`: each platform's lowering gets its own kernels
        in one artifact. Default: the platforms of `device_kind`, else this machine's backend.
      device_kind: the device the artifact is for when it is not here (`"NVIDIA H200"`,
        `"TPU v6 lite"`), or one per platform (a sequence, or kinds joined by commas): its
        caches and heuristics pick the configs, and its abstract device lets JAX lower
        the Triton kernels.
      name: the artifact's file name; default the function's name.
    """
    if not callable(fun):
        raise TypeError(f"export: fun must be a function or optimize(...), got "
                        f"{type(fun).__name__}")
    optimized = fun if isinstance(fun, Optimized) else optimize(fun)
    return optimized.export(*arg_specs, platforms=platforms, device_kind=device_kind, name=name)
