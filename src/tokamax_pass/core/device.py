"""Which device a program is being built for.

Ops choose kernels and configs for a platform (`cpu`, `cuda`, ...) and a device
kind (`"NVIDIA H200"`). A concrete device answers directly; when the program is
lowered for a GPU that is not here (export from a CPU machine), the abstract
mesh's `abstract_device` names it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator

import jax

_HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")
_PRE_AMPERE_KINDS = ("V100", "T4", "P100", "K80", "P4", "RTX 20", "TITAN V")


@dataclasses.dataclass(frozen=True)
class Target:
    """A platform and, where known, the device kind programs are built for."""

    platform: str
    device_kind: str | None

    @property
    def is_gpu(self) -> bool:
        return self.platform in ("cuda", "rocm")

    @property
    def is_tpu(self) -> bool:
        return self.platform == "tpu"

    @property
    def is_hopper(self) -> bool:
        kind = self.device_kind or ""
        return self.platform == "cuda" and any(k in kind for k in _HOPPER_KINDS)

    @property
    def is_ampere_or_newer(self) -> bool:
        kind = self.device_kind or ""
        return self.platform == "cuda" and not any(k in kind for k in _PRE_AMPERE_KINDS)


def _abstract_device():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else getattr(mesh, "abstract_device", None)


@functools.cache
def _local_device_kind(platform: str) -> str | None:
    try:
        return jax.devices(platform)[0].device_kind
    except RuntimeError:
        return None


def _canonical_platform(platform: str) -> str:
    return {"gpu": "cuda"}.get(platform.lower(), platform.lower())


_LOWERING_TARGET: contextvars.ContextVar[Target | None] = contextvars.ContextVar(
    "tokamax_pass_lowering_target", default=None
)


@contextlib.contextmanager
def lowering_for(target: Target) -> Iterator[None]:
    """Makes `current_target()` answer `target` while an op is lowered for it."""
    token = _LOWERING_TARGET.set(target)
    try:
        yield
    finally:
        _LOWERING_TARGET.reset(token)


def current_target() -> Target:
    """The target of code traced now: the op being lowered, the abstract device, else the
    default backend."""
    lowering = _LOWERING_TARGET.get()
    if lowering is not None:
        return lowering
    device = _abstract_device()
    if device is not None:
        return Target(_canonical_platform(device.platform), device.device_kind)
    platform = _canonical_platform(jax.default_backend())
    return Target(platform, _local_device_kind(platform))


def abstract_only() -> bool:
    """True while tracing for devices that are not here: an abstract mesh with no concrete
    mesh behind it (`targeting`, or `jax.export` over an `AbstractMesh`)."""
    from jax._src import mesh as mesh_lib

    if jax.sharding.get_abstract_mesh().empty:
        return False
    concrete = mesh_lib.get_concrete_mesh()
    return concrete is None or concrete.empty


def lowering_target(platform: str) -> Target:
    """The target of a lowering for `platform` (one of possibly several export platforms)."""
    platform = _canonical_platform(platform)
    device = _abstract_device()
    if device is not None and _canonical_platform(device.platform) == platform:
        return Target(platform, device.device_kind)
    return Target(platform, _local_device_kind(platform))


def device_kind_key(device_kind: str | None) -> str:
    """File-name form of a device kind: `"NVIDIA H200"` -> `"nvidia_h200"`."""
    return (device_kind or "unknown").lower().replace(" ", "_").replace("/", "_")


def platform_of_kind(device_kind: str) -> str:
    """The platform of a device kind: `"tpu"` for TPU kinds (`"TPU v5 lite"`, `"TPU v5p"`,
    `"TPU v6 lite"`, `"TPU7x"`), else `"cuda"` (`"NVIDIA H200"`)."""
    return "tpu" if device_kind.upper().startswith("TPU") else "cuda"


@contextlib.contextmanager
def targeting(device_kind: str, platform: str | None = None) -> Iterator[None]:
    """Traces and lowers for a device that is not here (`"NVIDIA H200"` or `"TPU v6 lite"`
    from a CPU machine); `platform` defaults to the kind's (`platform_of_kind`).

    JAX needs an abstract device of that kind to lower Pallas Triton kernels; ops
    read the device kind from it to pick kernels and configs for that device.
    """
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    device = AbstractDevice(device_kind, None, platform or platform_of_kind(device_kind))
    # Auto axes: ops whose shape rules do not support explicit sharding still trace.
    mesh = AbstractMesh((1,), ("_target",), axis_types=(AxisType.Auto,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield
