"""Tuned StableHLO artifacts: the serialized program plus its manifest, and their checks.

`make_artifact(optimized, ...)` serializes an optimized program with `jax.export`; the
artifact's `manifest.json` records every op with its kernel and config, the device kind
it was tuned for, the versions that made it and the SHA-256 of the program's bytes.
`load_artifact(directory)` checks those before it runs anything: a tuned artifact is
guaranteed only on the device it was tuned for, and a program that is not the one its
manifest digests never loads. `tokamax_pass.export` (the function) optimizes a plain
function first.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from tokamax_pass.core import atomic_io, checks, device, spec
from tokamax_pass.core.caller_warnings import warn_at_caller
from tokamax_pass.passes.inspection import Inspection, custom_call_targets, inspect_path
from tokamax_pass.version import __version__

MANIFEST = "manifest.json"
_SUFFIX = ".stablehlo"

__all__ = [
    "Artifact", "ArtifactIntegrityError", "ArtifactMismatchError", "LoadedArtifact",
    "check_compatible", "function_name", "inspect", "load_artifact", "make_artifact",
]


class ArtifactMismatchError(RuntimeError):
    """An artifact made for another device or by newer software than is here."""


class ArtifactIntegrityError(spec.SpecError):
    """An artifact whose program bytes are not the ones its manifest digests (a file
    swapped or torn after the save), or whose manifest carries no digest."""


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A tuned program: serialized `jax.export.Exported` bytes plus its manifest."""

    name: str
    serialized: bytes
    manifest: Mapping[str, Any]

    @functools.cached_property
    def exported(self) -> jax.export.Exported:
        load_kernel_runtimes(self.manifest)
        return _deserialize(self.serialized, f"artifact {self.name!r} ({self.name}{_SUFFIX})")

    def __call__(self, *args: Any) -> Any:
        """Runs the program (no device check; `load_artifact` checks)."""
        return self.exported.call(*args)

    def __repr__(self) -> str:
        """Its name, platforms, op calls and program size, not the program's bytes."""
        return (f"Artifact({self.name!r}, platforms={list(self.manifest.get('platforms', []))}, "
                f"{len(self.manifest.get('ops', []))} op call(s), "
                f"{len(self.serialized)} program bytes)")

    def mlir_text(self) -> str:
        return self.exported.mlir_module()

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Writes `<name>.stablehlo` and `manifest.json` (with the program's SHA-256) into
        `directory`, made if needed.

        Both files are written into a temporary directory beside `directory`, which is
        renamed into place when `directory` is absent or empty; into a directory that
        holds files they move in program first, manifest last. A save killed at any point
        leaves the old artifact, the new one, or one whose digest check fails on load.
        """
        _require_non_empty("Artifact.save", "directory", directory)
        _require_file_name("Artifact.save", self.name)
        directory = checks.directory_to_write("Artifact.save", "directory", directory)
        program = f"{self.name}{_SUFFIX}"
        manifest = {**self.manifest, "file": program,
                    "sha256": {program: hashlib.sha256(self.serialized).hexdigest()}}
        files = {program: self.serialized,
                 MANIFEST: (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()}
        built = atomic_io.temporary_directory_beside(directory)
        try:
            for name, data in files.items():
                atomic_io.write_atomic(built / name, data)
            if not atomic_io.replace_directory(built, directory):
                for name in files:  # the manifest last: it names and digests the program
                    os.replace(built / name, directory / name)
                atomic_io.fsync_directory(directory)
        finally:
            atomic_io.remove_tree(built)
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Artifact:
        """Reads an artifact directory written by `save` (no compatibility checks)."""
        _require_non_empty("load_artifact", "directory", directory)
        directory = checks.as_path("load_artifact", "directory", directory)
        if not directory.exists():
            raise FileNotFoundError(f"load_artifact: directory {os.fspath(directory)!r} does "
                                    f"not exist")
        manifest_path = directory / MANIFEST
        if not manifest_path.is_file():
            raise FileNotFoundError(f"{directory} is not a tokamax_pass artifact: no {MANIFEST}")
        data = spec.read_file(manifest_path, what=str(manifest_path))
        try:
            manifest = spec.loads(data.decode("utf-8"), what=str(manifest_path))
        except UnicodeDecodeError as e:
            raise spec.SpecError(f"{manifest_path} is not UTF-8 JSON text: {e.reason}") from None
        if not isinstance(manifest, dict):
            raise spec.SpecError(f"{manifest_path} must hold a JSON object, got "
                                 f"{type(manifest).__name__}")
        spec.check_schema(manifest, what=str(manifest_path))
        _check_manifest(manifest, what=str(manifest_path))
        program = directory / manifest["file"]
        if not program.is_file():
            raise FileNotFoundError(f"{manifest_path} names {manifest['file']}, which is missing")
        serialized = spec.read_binary_file(program, what=str(program))
        _check_digest(manifest, serialized, manifest_path=manifest_path, program=program)
        return cls(manifest["name"], serialized, manifest)


def make_artifact(optimized: Any, arg_specs: Sequence[Any], *,
                  platforms: Sequence[str] | None = None,
                  device_kind: str | Sequence[str] | None = None,
                  name: str | None = None) -> Artifact:
    """The artifact of an `Optimized` program; see `tokamax_pass.export` for the arguments."""
    if device_kind is not None:
        checks.require_strs("export", "device_kind", device_kind)
    if name is not None:
        _require_file_name("export", name)
    platforms = _platforms(platforms, device_kind)
    # A static argument is passed as it is: a static str is not an array spec.
    static = optimized.static_positions(len(arg_specs))
    args = tuple(a if i in static else _abstract(a) for i, a in enumerate(arg_specs))
    _check_placements(args, static, platforms)
    with device.targeting(device_kind) if device_kind is not None else contextlib.nullcontext():
        gpu_kind = device.lowering_target("cuda").device_kind if "cuda" in platforms else None
        try:
            exported, plan = optimized.export_with_plan(args, platforms)
        except RuntimeError as e:
            unknown = None if gpu_kind is None else device.unknown_gpu_kind_error(gpu_kind)
            if unknown is None:
                raise
            raise unknown from e
        kinds = {p: device.lowering_target(p).device_kind for p in platforms}
    name = name or _safe_name(getattr(optimized.fun, "__name__", "exported"))
    serialized = bytes(exported.serialize())
    manifest = _manifest(name, optimized, exported, plan, kinds, device_kind)
    manifest["sha256"] = {manifest["file"]: hashlib.sha256(serialized).hexdigest()}
    _warn_fallbacks(manifest["fallbacks"])
    return Artifact(name, serialized, manifest)


def inspect(source: str | os.PathLike[str] | Artifact) -> Inspection:
    """The ops, kernels and configs in an artifact (object, directory or its
    `manifest.json`), a `.stablehlo` file, a `.mlir`/lowered-text file, or StableHLO text
    itself."""
    if isinstance(source, Artifact):
        return Inspection.from_text(source.mlir_text(), manifest=source.manifest)
    if not isinstance(source, (str, os.PathLike)):
        hint = (" (export it first: tokamax_pass.export(f, *args))" if callable(source)
                else "")
        raise TypeError(f"inspect: source must be an Artifact, a path (artifact directory, "
                        f".stablehlo or text file) or StableHLO text, got "
                        f"{type(source).__name__}{hint}")
    _require_non_empty("inspect", "source", source)
    if os.path.basename(source) == MANIFEST and os.path.isfile(source):
        source = os.path.dirname(source) or "."  # an artifact's manifest: its artifact
    return inspect_path(source, load_artifact_dir=Artifact.load, deserialize=_deserialize_text)


@dataclasses.dataclass(frozen=True)
class LoadedArtifact:
    """A checked artifact, callable like the exported function."""

    artifact: Artifact

    def __call__(self, *args: Any) -> Any:
        return self.artifact.exported.call(*args)

    @property
    def manifest(self) -> Mapping[str, Any]:
        return self.artifact.manifest

    def __repr__(self) -> str:
        return f"LoadedArtifact({self.artifact!r})"


def load_artifact(directory: str | os.PathLike[str] | Artifact, *, check: bool = True,
                  device: jax.Device | None = None) -> LoadedArtifact:
    """Loads a saved artifact after checking it suits `device` (default: the first device).

    Raises `ArtifactMismatchError` when the artifact was made for another platform or
    device kind, or with a newer jax or tokamax_pass than is installed; `check=False`
    skips the checks (the program may then fail or run slower than tuned).
    """
    checks.require_bool("load_artifact", "check", check)  # `check="no"` read as true
    if device is not None and not isinstance(device, jax.Device):
        raise TypeError(f"load_artifact: device must be a jax.Device (jax.devices()[i]) or "
                        f"None, got {type(device).__name__}")
    artifact = directory if isinstance(directory, Artifact) else Artifact.load(directory)
    if check:
        check_compatible(artifact.manifest, device or jax.devices()[0])
        check_manifest_describes_program(artifact)
    return LoadedArtifact(artifact)


def check_manifest_describes_program(artifact: Artifact) -> None:
    """`ArtifactIntegrityError` unless the manifest's platforms, argument and result specs
    and kernels are the program's own. The checks and the runtime setup read the manifest
    (the digest ties the program to it, not it to the program): a manifest edited to
    claim another platform or to leave a kernel out would get past `check_compatible` and
    fail inside XLA."""
    manifest = artifact.manifest
    for key, actual in _program_fields(artifact.exported).items():
        if key in manifest and manifest[key] != actual:
            raise ArtifactIntegrityError(
                f"artifact {artifact.name!r}: its manifest's {key!r} is {manifest[key]!r:.200} "
                f"but its program's is {actual!r:.200} (the manifest was edited after the "
                f"export); re-export the artifact")


# Custom-call targets whose runtime a Python module sets up on import: a Mosaic GPU
# kernel's host code links against `libmosaic_gpu_runtime.so`, which XLA finds only once
# `jax.experimental.mosaic.gpu` has been imported (it names the library's path). A fresh
# process that loads an artifact imports no kernel code, and without the import its first
# call fails with "Symbols not found: mosaic_gpu_launch_kernel".
_RUNTIME_MODULES = {"mosaic_gpu": "jax.experimental.mosaic.gpu"}


def load_kernel_runtimes(manifest: Mapping[str, Any]) -> None:
    """Imports the runtime of every kernel the artifact calls (`_RUNTIME_MODULES`), before
    its program is deserialized to run."""
    for target in manifest.get("custom_calls", ()):
        for prefix, module in _RUNTIME_MODULES.items():
            if target.startswith(prefix):
                with contextlib.suppress(ImportError):  # a jaxlib without it runs none
                    importlib.import_module(module)


def check_compatible(manifest: Mapping[str, Any], dev: jax.Device) -> None:
    """Raises `ArtifactMismatchError` unless the artifact may run on `dev` here."""
    if not isinstance(manifest, Mapping):
        raise TypeError(f"check_compatible: manifest must be a Mapping (artifact.manifest), "
                        f"got {type(manifest).__name__}")
    if not isinstance(dev, jax.Device):
        raise TypeError(f"check_compatible: dev must be a jax.Device (jax.devices()[i]), got "
                        f"{type(dev).__name__}")
    # No command runs an artifact: this named a `--no-check` flag that does not exist.
    override = "; pass load_artifact(..., check=False) to run it anyway"
    versions = manifest.get("versions", {})
    for package, installed in (("jax", jax.__version__),
                               ("tokamax_pass", __version__)):
        made = versions.get(package)
        if made is None:
            # Read as "exported with jax None, newer than the installed 0.x; upgrade jax".
            raise ArtifactMismatchError(
                f"artifact {manifest.get('name')!r} records no {package} version in its "
                f"manifest's 'versions' (not written by tokamax_pass.export?); re-export "
                f"it{override}")
        if _version_tuple(made) > _version_tuple(installed):
            raise ArtifactMismatchError(
                f"artifact {manifest.get('name')!r} was exported with {package} {made}, "
                f"newer than the installed {installed}; upgrade {package}{override}"
            )
    platform = {"gpu": "cuda"}.get(dev.platform, dev.platform)
    platforms = list(manifest.get("platforms", ()))
    if platform not in platforms:
        # A program holds no code for a platform it was not exported for: no override.
        raise ArtifactMismatchError(
            f"artifact {manifest.get('name')!r} was exported for {platforms}, not for "
            f"{platform} ({dev.device_kind}), and cannot run here; re-export it with "
            f"{platform!r} among its platforms: tokamax_pass.export(..., "
            f"platforms={[*platforms, platform]!r}) (the command line's --platforms "
            f"{','.join([*platforms, platform])})"
        )
    wanted = manifest.get("device_kinds", {}).get(platform)
    if wanted is not None and wanted != dev.device_kind:
        raise ArtifactMismatchError(
            f"artifact {manifest.get('name')!r} was tuned for {wanted!r}, but this device is "
            f"{dev.device_kind!r}: its kernels and configs are guaranteed only on {wanted!r}; "
            f"re-export it with tokamax_pass.export(..., device_kind={dev.device_kind!r}) "
            f"(the command line's --device-kind){override}"
        )


# --- helpers -----------------------------------------------------------------------------

def _manifest(name: str, optimized: Any, exported: jax.export.Exported, plan: Any,
              kinds: Mapping[str, str | None],
              device_kind: str | Sequence[str] | None) -> dict[str, Any]:
    import jaxlib

    return {
        "schema_version": spec.SCHEMA_VERSION,
        "name": name,
        "file": f"{name}{_SUFFIX}",
        "function": function_name(optimized.fun),
        "device_kind": (device_kind if device_kind is None or isinstance(device_kind, str)
                        else ",".join(device_kind)),
        "device_kinds": dict(kinds),
        **_program_fields(exported),
        "ops": [row.to_dict() for row in plan],
        "rewrites": [match.to_dict() for match in plan.matches],
        "fallbacks": [{"path": row.path, "platform": row.platform,
                       "device_kind": row.device_kind, "target_runs": row.fallback_from,
                       "exported": row.implementation}
                      for row in plan if row.fallback_from is not None],
        "versions": {
            "tokamax_pass": __version__,
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "calling_convention": exported.calling_convention_version,
        },
    }


def _program_fields(exported: jax.export.Exported) -> dict[str, Any]:
    """The manifest's fields that describe the program itself, read from it: written at
    export, compared on a checked load."""
    return {
        "platforms": list(exported.platforms),
        "in_specs": [spec.array_spec(a) for a in exported.in_avals],
        "out_specs": [spec.array_spec(a) for a in exported.out_avals],
        "custom_calls": custom_call_targets(exported.mlir_module()),
    }


class ExportFallbackWarning(UserWarning):
    """An export holds another implementation than the target would run itself, because
    this machine cannot lower that one (cuDNN attention, exported from a CPU machine)."""


def describe_fallback(fallback: Mapping[str, Any]) -> str:
    """One entry of a manifest's `fallbacks`, as the export warning and the CLI say it."""
    device_kind = fallback["device_kind"] or "any device kind"
    return (f"{fallback['path']} on {fallback['platform']} ({device_kind}): "
            f"{fallback['exported']} in place of {fallback['target_runs']}")


def describe_fallbacks(fallbacks: Sequence[Mapping[str, Any]]) -> list[str]:
    """A manifest's `fallbacks` as lines, each distinct one once, with its count where
    several calls (a model's layers) fall back alike."""
    counts = collections.Counter(describe_fallback(f) for f in fallbacks)
    return [line if n == 1 else f"{line} ({n} calls)" for line, n in counts.items()]


def _warn_fallbacks(fallbacks: Sequence[Mapping[str, Any]]) -> None:
    """Says at export time which op calls fall back (also in the manifest's `fallbacks`)."""
    if not fallbacks:
        return
    calls = "; ".join(describe_fallbacks(fallbacks))
    warn_at_caller(
        f"export: {len(fallbacks)} op call(s) hold another implementation than the target "
        f"would run, which cannot be lowered on this machine: {calls}. Export on the target "
        f"device for the same program it would run; the manifest lists these under "
        f"'fallbacks'", ExportFallbackWarning)


def function_name(fun: Any) -> str:
    """`module.qualname` of an exported function (`functools.partial(...)` around one):
    the same for every export of one program, unlike a repr holding an address."""
    target = getattr(fun, "__wrapped__", fun)
    if isinstance(target, functools.partial):
        return f"functools.partial({function_name(target.func)})"
    module = getattr(target, "__module__", None) or type(target).__module__
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}.{qualname}"


_PLATFORM_NAMES = ("cpu", "gpu", "cuda", "rocm", "tpu")


def _platforms(platforms: Sequence[str] | str | None,
               device_kind: str | Sequence[str] | None) -> tuple[str, ...]:
    named = [device_kind] if isinstance(device_kind, str) else device_kind or []
    for kind in (k.strip() for names in named for k in str(names).split(",")):
        if kind.lower() in _PLATFORM_NAMES:
            # A platform's name read as a device kind ("cpu" as a cuda device's): the
            # artifact was built for a device that does not exist, on heuristic configs.
            raise ValueError(
                f"export: device_kind must name a device model like 'NVIDIA H200' or "
                f"'TPU v6 lite' (jax.devices()[0].device_kind on it), got the platform "
                f"{kind!r}; choose platforms with platforms= (CLI: --platforms)")
    kinds = device.kinds_by_platform(device_kind) if device_kind is not None else {}
    if platforms is None:
        return tuple(kinds) or (device.current_target().platform,)
    checks.require_strs("export", "platforms", platforms)
    if isinstance(platforms, str):
        platforms = platforms.split(",")
    result = tuple({"gpu": "cuda"}.get(p.strip().lower(), p.strip().lower()) for p in platforms)
    unknown = [p for p in result if p not in ("cpu", "cuda", "rocm", "tpu")]
    if not result or unknown:
        raise ValueError(f"export: platforms must name cpu, cuda, rocm or tpu, got {platforms!r}")
    twice = sorted({p for p in result if result.count(p) > 1})
    if twice:
        # The manifest listed the platform twice ("gpu,cuda" as ['cuda', 'cuda']).
        raise ValueError(f"export: platforms names {', '.join(twice)} more than once, got "
                         f"{platforms!r} ('gpu' is 'cuda'); list each platform once")
    for platform, kind in kinds.items():
        if platform not in result:
            raise ValueError(f"export: device_kind names {kind!r}, a {platform} device, but "
                             f"platforms={list(result)} has no {platform!r}")
    return result


def _abstract(arg: Any) -> Any:
    def leaf(x: Any) -> Any:
        if isinstance(x, str):
            try:
                return spec.parse_array_spec(x)
            except spec.SpecError as e:
                raise spec.SpecError(f"export: {e}") from None
        if spec.is_array(x) and not isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    return jax.tree.map(leaf, arg)


def _check_placements(args: Sequence[Any], static: frozenset[int],
                      platforms: Sequence[str]) -> None:
    """A `ValueError` for an argument spec placed over devices of a platform the artifact
    is not lowered for (a `NamedSharding` over this CPU machine's mesh in an export for
    `cuda`), which JAX refuses deep in the trace as a mismatch of meshes."""
    for i, arg in enumerate(args):
        if i in static:
            continue
        for leaf in jax.tree.leaves(arg):
            mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
            if mesh is None or mesh.empty:
                continue
            placed_on = getattr(mesh.abstract_mesh.abstract_device, "platform", None)
            others = [p for p in platforms if placed_on is not None and p != placed_on]
            if others:
                raise ValueError(
                    f"export: argument {i} is placed over a mesh of {placed_on} devices, but "
                    f"the artifact is also for {others}: give its spec a NamedSharding over an "
                    f"abstract mesh of the target's devices, jax.sharding.AbstractMesh(sizes, "
                    f"names, abstract_device=jax.sharding.AbstractDevice(device_kind, None, "
                    f"platform)), and export under jax.sharding.use_abstract_mesh(that mesh) "
                    f"(docs/export.md)")


def _require_non_empty(who: str, name: str, value: Any) -> None:
    """A `ValueError` for `""`, which `Path` reads as the working directory: `save("")`
    wrote the artifact there, `load_artifact("")` and `inspect("")` read it."""
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{who}: {name} must not be empty, got {value!r}; pass '.' for the "
                         f"working directory")


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "exported"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


# The most digits a part of a version `_version_tuple` reads may have.
_MAX_VERSION_DIGITS = 9


def _is_version(value: Any) -> bool:
    """Whether `value` is a version string `_version_tuple` reads: digits first, and
    parts of a few digits (one of thousands failed converting to an int, a bare
    `ValueError` from `load_artifact`'s checks)."""
    return (isinstance(value, str) and re.match(r"\d+(\.\d+)*", value) is not None
            and all(len(p) <= _MAX_VERSION_DIGITS for p in re.findall(r"\d+", value)[:3]))


def _deserialize(data: bytes, what: str) -> jax.export.Exported:
    """`jax.export.deserialize`, with a `SpecError` naming `what` for bytes that are not a
    serialized program (it fails deep in flatbuffers on a corrupt or truncated file). The
    StableHLO module inside is parsed here too: `deserialize` reads it only when it is
    first used, and a damaged one raised XLA's bare "Failed to deserialize StableHLO"."""
    try:
        exported = jax.export.deserialize(bytearray(data))
        exported.mlir_module()
    except Exception as e:  # noqa: BLE001 - flatbuffers raises struct.error, IndexError, ...
        raise spec.SpecError(f"{what} is not a serialized jax.export program (corrupt or "
                             f"truncated?): {type(e).__name__}: {e}") from None
    return exported


def _deserialize_text(data: bytes, what: str) -> str:
    return _deserialize(data, what).mlir_module()


# The fields of each of a manifest's `ops` that `inspect` prints.
_OP_ROW_FIELDS = ("path", "platform", "arguments", "implementation", "op", "config", "source")
# The longest file name most file systems take (bytes).
_MAX_FILE_NAME = 255


def _check_manifest(manifest: Mapping[str, Any], *, what: str) -> None:
    """A `SpecError` for a manifest whose fields `load_artifact` and `inspect` read have
    the wrong types (it failed with an `AttributeError`, `KeyError` or `TypeError` in the
    checks or in `inspect`'s table)."""
    for key, kind in (("name", str), ("file", str), ("versions", Mapping),
                      ("platforms", list), ("device_kinds", Mapping), ("custom_calls", list),
                      ("ops", list)):
        if key in ("name", "file") and key not in manifest:
            raise spec.SpecError(f"{what} has no {key!r}")
        if key in manifest and not isinstance(manifest[key], kind):
            raise spec.SpecError(f"{what}: {key!r} must be a {kind.__name__}, got "
                                 f"{manifest[key]!r:.80}")
    file = manifest["file"]
    if (Path(file).name != file or not file.endswith(_SUFFIX)
            or len(file.encode(errors="replace")) > _MAX_FILE_NAME):
        raise spec.SpecError(f"{what}: 'file' must name a {_SUFFIX} file in the artifact "
                             f"directory, got {file!r:.300}")
    for key in ("platforms", "custom_calls"):
        if not all(isinstance(t, str) for t in manifest.get(key, ())):
            raise spec.SpecError(f"{what}: {key!r} must be a list of strs, got "
                                 f"{manifest[key]!r:.80}")
    # A kind of another type was read as a device the artifact was tuned for ("tuned for
    # 2.5, but this device is 'cpu'"), naming neither the file nor what is wrong in it.
    if not all(isinstance(k, str | None) for k in manifest.get("device_kinds", {}).values()):
        raise spec.SpecError(f"{what}: 'device_kinds' must map platforms to device kinds "
                             f"(strs) or null, got {manifest['device_kinds']!r:.80}")
    for i, row in enumerate(manifest.get("ops", ())):
        if not isinstance(row, Mapping) or not all(k in row for k in _OP_ROW_FIELDS):
            raise spec.SpecError(f"{what}: ops[{i}] must be an object with the fields "
                                 f"{list(_OP_ROW_FIELDS)}, got {row!r:.120}")
    for package, version in manifest.get("versions", {}).items():
        if package in ("jax", "tokamax_pass") and not _is_version(version):
            raise spec.SpecError(f"{what}: versions[{package!r}] must be a version string "
                                 f"like '0.4.30', got {version!r:.80}")


def _require_file_name(who: str, name: Any) -> None:
    """The artifact's name becomes `<name>.stablehlo` in the directory it is saved to: a
    name with a path separator would write outside it."""
    if not isinstance(name, str) or name in ("", ".", "..") or re.search(r"[/\\]", name):
        raise (ValueError if isinstance(name, str) else TypeError)(
            f"{who}: name must be a file name (no directories), got {name!r}")


def _check_digest(manifest: Mapping[str, Any], serialized: bytes, *, manifest_path: Path,
                  program: Path) -> None:
    """`ArtifactIntegrityError` unless the manifest's SHA-256 of its program matches the
    bytes read, and of every other file it digests the file beside it: a program swapped
    or torn under its manifest never loads."""
    digests = manifest.get("sha256")
    if not isinstance(digests, Mapping) or not isinstance(digests.get(program.name), str):
        raise ArtifactIntegrityError(
            f"{manifest_path} carries no SHA-256 of {program} ('sha256' with the program's "
            f"file name), so nothing ties the manifest to the program; re-export the "
            f"artifact with this tokamax_pass")
    for name, wanted in digests.items():
        path = program.parent / str(name)
        if Path(str(name)).name != name or not isinstance(wanted, str):
            raise ArtifactIntegrityError(f"{manifest_path}: 'sha256' must map file names in "
                                         f"the artifact directory to hex digests, got "
                                         f"{name!r}: {wanted!r:.80}")
        if not path.is_file():
            raise FileNotFoundError(f"{manifest_path} digests {name}, which is missing")
        if path == program:
            actual = hashlib.sha256(serialized)
        else:  # read in blocks: a file beside the program may be of any size
            with open(path, "rb") as f:
                actual = hashlib.file_digest(f, "sha256")
        if actual.hexdigest() != wanted:
            raise ArtifactIntegrityError(
                f"{path} does not match its manifest {manifest_path}: SHA-256 "
                f"{actual.hexdigest()}, the manifest records {wanted} (the file was replaced "
                f"or torn after the save); re-export the artifact")
