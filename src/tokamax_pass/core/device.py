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
import difflib
import functools
import importlib.resources
import json
import re
from collections.abc import Iterator, Sequence

import jax

# The longest device kind a result or a command names (JAX's are a few words).
MAX_DEVICE_KIND_CHARS = 200

_HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")
# NVIDIA GPU models by the word a device kind names them with, besides JAX's GPU table's
# (`_known_gpu_models`): a kind naming none of them is a candidate misspelling.
_OTHER_GPU_MODELS = ("A100", "A800", "A10", "A10G", "A30", "A40", "L4", "L40", "L40S",
                     "V100", "T4", "P100", "K80", "P4", "B100", "B200", "GB200")
# Pre-Ampere GPUs by their model word: Volta, Turing, Pascal and Kepler datacenter cards
# and the GeForce RTX 20 series; Turing's Quadro RTX and TITAN RTX, and the TITAN V, are
# matched by two words (`_is_pre_ampere`).
_PRE_AMPERE_MODELS = ("v100", "t4", "p100", "p40", "p4", "k80", "2060", "2070", "2080")


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
        """A Hopper GPU: its kind names a Hopper model as a word ("NVIDIA H100 80GB HBM3";
        not "NVIDIA H2000")."""
        models = {k.lower() for k in _HOPPER_KINDS}
        return self.platform == "cuda" and bool(models & set(_words(self.device_kind or "")))

    @property
    def is_ampere_or_newer(self) -> bool:
        return self.platform == "cuda" and not _is_pre_ampere(_words(self.device_kind or ""))


def _is_pre_ampere(words: Sequence[str]) -> bool:
    """Whether a device kind's words name a GPU older than Ampere (`_PRE_AMPERE_MODELS`,
    a Quadro RTX, a TITAN RTX or TITAN V); "NVIDIA RTX 2000 Ada Generation" is not."""
    names = set(words)
    return bool(names & set(_PRE_AMPERE_MODELS)) or (
        "rtx" in names and bool(names & {"quadro", "titan"})) or {"titan", "v"} <= names


def _abstract_device():
    """The abstract mesh's device, also where the mesh has no axes (`sharding.meshless`
    keeps the device of the mesh it drops)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None else getattr(mesh, "abstract_device", None)


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


# Device kinds named by `targeting` for platforms other than the abstract device's (an
# export for "cuda" and "tpu" at once from a CPU machine): {platform: device kind}.
_OTHER_KINDS: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "tokamax_pass_other_kinds", default=()
)


def lowering_target(platform: str) -> Target:
    """The target of a lowering for `platform` (one of possibly several export platforms)."""
    platform = _canonical_platform(platform)
    device = _abstract_device()
    if device is not None and _canonical_platform(device.platform) == platform:
        return Target(platform, device.device_kind)
    named = dict(_OTHER_KINDS.get()).get(platform)
    return Target(platform, named or _local_device_kind(platform))


def device_kind_key(device_kind: str | None) -> str:
    """File-name form of a device kind: `"NVIDIA H200"` -> `"nvidia_h200"`."""
    return (device_kind or "unknown").lower().replace(" ", "_").replace("/", "_")


@functools.cache
def shipped_device_kinds() -> tuple[str, ...]:
    """The device kinds the library autotuning cache ships configs for (`"NVIDIA H200"`),
    as each folder's files record them (the folder names are `device_kind_key`s)."""
    root = importlib.resources.files("tokamax_pass") / "data" / "autotuning"
    if not root.is_dir():
        return ()
    kinds = []
    for folder in sorted(root.iterdir(), key=lambda p: p.name):
        files = sorted((f for f in folder.iterdir() if f.name.endswith(".json")),
                       key=lambda f: f.name) if folder.is_dir() else []
        for item in files:
            try:
                kind = json.loads(item.read_text()).get("device_kind")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(kind, str):
                kinds.append(kind)
                break
    return tuple(kinds)


def _words(kind: str) -> tuple[str, ...]:
    return tuple(w for w in re.split(r"[^0-9a-z]+", kind.lower()) if w)


@functools.cache
def _known_gpu_models() -> frozenset[str]:
    """The words NVIDIA device kinds name their GPU model with (`"h200"`, `"a100"`,
    `"4090"`): ours and JAX's GPU table's."""
    models = {m.lower() for m in (*_HOPPER_KINDS, *_OTHER_GPU_MODELS)}
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:  # another jax layout: ours alone
        return frozenset(models)
    return frozenset(models | {_words(v.value)[-1] for v in gpu_info.GpuVersion})


def misspelled_shipped_kind(device_kind: str, *, typed: bool = False) -> str | None:
    """The shipped device kind (`shipped_device_kinds`) that `device_kind` names another
    way, or `None`: the same words in another case or with other separators
    (`"nvidia_h200"`, `"nvidia-h200"`), or the kind without its leading word(s)
    (`"H200"`). JAX reports a device's kind whole and spelled one way, so no device
    reports such a name; a kind that is merely similar (`"NVIDIA H20"`, `"NVIDIA H200
    NVL"`, both real devices) is not matched.

    `typed`: the kind was typed by a user (a target to export for, a cache to clear), not
    read from a device or a file, so a GPU kind that names no GPU model we or JAX know
    (`_known_gpu_models`) and is a typo away from a shipped one (`"NVIDIA H2000"`) is
    matched too, unless it is this machine's GPU's: a GPU newer than both lists may
    report such a name."""
    if device_kind in shipped_device_kinds():
        return None
    words = _words(device_kind)
    for known in shipped_device_kinds():
        known_words = _words(known)
        if words and ("".join(words) == "".join(known_words)
                      or (len(words) < len(known_words)
                          and known_words[len(known_words) - len(words):] == words)):
            return known
    if (typed and platform_of_kind(device_kind) == "cuda"
            and not set(words) & _known_gpu_models()
            and device_kind != _local_device_kind("cuda")):
        gpus = {k.lower(): k for k in shipped_device_kinds() if platform_of_kind(k) == "cuda"}
        close = difflib.get_close_matches(device_kind.lower(), list(gpus), n=1, cutoff=0.9)
        if close:
            return gpus[close[0]]
    return None


def check_device_kind(device_kind: str, *, typed: bool = False) -> None:
    """`ValueError` for a device kind that misspells a shipped one
    (`misspelled_shipped_kind`, `typed` as there): it would be taken as a device of its
    own, whose library cache does not exist, so every op would silently run heuristic
    configs. Also for one no device reports: control characters, or above
    `MAX_DEVICE_KIND_CHARS` (the cache file of a result is named after its device kind:
    a NUL byte or a name too long fails in the file system, a newline makes a file name
    with one)."""
    if not device_kind.isprintable() or len(device_kind) > MAX_DEVICE_KIND_CHARS:
        raise ValueError(f"device_kind {device_kind[:80]!r} is not a device kind JAX reports "
                         f"(printable text of at most {MAX_DEVICE_KIND_CHARS} characters, "
                         f"like 'NVIDIA H200')")
    known = misspelled_shipped_kind(device_kind, typed=typed)
    if known is not None:
        raise ValueError(
            f"device_kind {device_kind!r} is not a device kind JAX reports; did you mean "
            f"{known!r}? The library autotuning cache ships configs for {known!r}, and "
            f"{device_kind!r} would miss them (heuristic configs instead). Pass the kind "
            f"exactly as jax.devices()[0].device_kind reports it on the target device")


def platform_of_kind(device_kind: str) -> str:
    """The platform of a device kind: `"tpu"` for TPU kinds (`"TPU v5 lite"`, `"TPU v5p"`,
    `"TPU v6 lite"`, `"TPU7x"`), else `"cuda"` (`"NVIDIA H200"`)."""
    return "tpu" if device_kind.upper().startswith("TPU") else "cuda"


def kinds_by_platform(device_kinds: str | Sequence[str]) -> dict[str, str]:
    """`{platform: kind}` of one or several device kinds (`"NVIDIA H200,TPU v6 lite"` or a
    sequence); `ValueError` when two name one platform, or one misspells a shipped kind
    (`check_device_kind`: `"H200"` for `"NVIDIA H200"`)."""
    if isinstance(device_kinds, str):
        device_kinds = [k for k in device_kinds.split(",") if k.strip()]
    kinds: dict[str, str] = {}
    for kind in (k.strip() for k in device_kinds):
        check_device_kind(kind, typed=True)
        platform = platform_of_kind(kind)
        if platform in kinds:
            raise ValueError(f"device_kind names two {platform} devices ({kinds[platform]!r} and "
                             f"{kind!r}); give at most one per platform")
        kinds[platform] = kind
    if not kinds:
        raise ValueError("device_kind must name a device kind, e.g. 'NVIDIA H200'")
    return kinds


def unknown_gpu_kind_error(device_kind: str) -> ValueError | None:
    """The error, naming the known kinds, for a CUDA device kind that JAX cannot lower
    Pallas kernels for from another machine (its GPU table has no such GPU, so it cannot
    tell the compute capability), or `None` where JAX knows the kind. Without it the
    export failed deep inside JAX's Triton lowering ("No supported GPU devices found")."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:  # another jax layout: JAX's own error stands
        return None
    if gpu_info.gpu_version_from_device_kind(device_kind) is not None:
        return None
    known = sorted(str(v) for v in gpu_info.GpuVersion)
    return ValueError(
        f"device_kind {device_kind!r} is not a CUDA device kind JAX can lower kernels for "
        f"from this machine (it knows {', '.join(map(repr, known))}); pass the kind "
        f"exactly as jax.devices()[0].device_kind reports it on the target GPU, export on "
        f"that GPU, or leave device_kind out for a program for any CUDA GPU (xla kernels)")


@contextlib.contextmanager
def targeting(device_kind: str | Sequence[str], platform: str | None = None) -> Iterator[None]:
    """Traces and lowers for devices that are not here (`"NVIDIA H200"`, `"TPU v6 lite"`, or
    both: one kind per platform) from a CPU machine; `platform` defaults to the kind's
    (`platform_of_kind`).

    JAX needs an abstract device to lower Pallas Triton kernels: the GPU's when one is
    named, else the first kind's. Ops read the device kind of the platform they are
    lowered for to pick kernels and configs for that device.
    """
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    if platform is not None and isinstance(device_kind, str):
        check_device_kind(device_kind, typed=True)
        kinds = {_canonical_platform(platform): device_kind}
    else:
        kinds = kinds_by_platform(device_kind)
    first = "cuda" if "cuda" in kinds else next(iter(kinds))
    device = AbstractDevice(kinds[first], None, first)
    # Auto axes: ops whose shape rules do not support explicit sharding still trace.
    mesh = AbstractMesh((1,), ("_target",), axis_types=(AxisType.Auto,), abstract_device=device)
    token = _OTHER_KINDS.set(tuple((p, k) for p, k in kinds.items() if p != first))
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            yield
    finally:
        _OTHER_KINDS.reset(token)
