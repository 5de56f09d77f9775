"""Finding the ops in StableHLO: the `tokamax_pass_spec` frontend attributes a lowering stamps.

Works on MLIR text (`Lowered.as_text()`, `Exported.mlir_module()`, `.mlir` files,
where strings escape a quote as `\\22`) and on HLO text (a bare JSON object). Every
instruction an op lowered to carries its spec, so specs are grouped: one entry per
distinct spec, with the number of instructions that carry it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tokamax_pass.core import spec
from tokamax_pass.core.caller_warnings import skip_unreadable
from tokamax_pass.core.primitive import METADATA_KEY
from tokamax_pass.passes.plan import format_table

_SPEC_KEY = re.compile(METADATA_KEY + r"\s*=\s*")
_MLIR_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_CUSTOM_CALL = re.compile(
    r'(?:stablehlo\.custom_call\s+@([\w$.\-]+)|call_target_name\s*=\s*"([^"]+)"|'
    r'custom_call_target="([^"]+)")'
)
_ESCAPE = re.compile(r"\\([0-9A-Fa-f]{2}|.)")


def _unescape(text: str) -> str:
    def one(match: re.Match[str]) -> str:
        code = match.group(1)
        if len(code) == 2:
            return chr(int(code, 16))
        return {"n": "\n", "t": "\t"}.get(code, code)

    return _ESCAPE.sub(one, text)


def custom_call_targets(text: str) -> list[str]:
    """Sorted distinct custom-call targets in the module (the kernels it launches)."""
    return sorted({next(g for g in m.groups() if g) for m in _CUSTOM_CALL.finditer(text)})


@dataclasses.dataclass(frozen=True)
class FoundOp:
    """One distinct op spec in a module, and how many instructions carry it."""

    op: str
    implementation: str
    config: str
    arguments: str
    instructions: int
    spec: Mapping[str, Any]


def find_ops(text: str, *, what: str = "the StableHLO text") -> list[FoundOp]:
    """The distinct op specs stamped in `text`, in order of first appearance."""
    counts: dict[str, int] = {}
    for raw in _spec_strings(text, what=what):
        counts[raw] = counts.get(raw, 0) + 1
    return [_found(raw, n) for raw, n in counts.items()]


def _spec_strings(text: str, *, what: str) -> list[str]:
    """Each stamped spec's JSON: a quoted MLIR string, or HLO text's bare JSON object.

    One that cannot be read (damaged, cut off) is skipped with a warning naming `what`
    and why, so the program's other ops are still listed; where none can be read, its
    `SpecError` is raised, so a damaged program is never listed as holding no ops."""
    found, unreadable = [], []
    attribute = f"{what}: a {METADATA_KEY} attribute"
    for match in _SPEC_KEY.finditer(text):
        start = match.end()
        try:
            if text.startswith('"', start):
                quoted = _MLIR_STRING.match(text, start)
                if quoted is None:
                    raise spec.SpecError(f"{attribute} is a string that never ends")
                found.append(spec.dumps(spec.loads(_unescape(quoted.group(1)),
                                                   what=attribute)))
            elif text.startswith("{", start):
                data, _ = spec.raw_decode(text, start, what=attribute)
                found.append(spec.dumps(data))
        except spec.SpecError as e:
            unreadable.append(e)
    skip_unreadable(found, unreadable, "an op")
    return found


def _object(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else an empty one."""
    return value if isinstance(value, dict) else {}


def _found(raw: str, count: int) -> FoundOp:
    data = spec.loads(raw, what=f"a {METADATA_KEY} attribute")
    data = _object(data)
    op = _object(data.get("op"))
    op_path = str(op.get("dataclass", "?"))
    fields = _object(op.get("fields"))
    try:
        implementation = str(spec.resolve(op_path, kind="dataclass").implementation)
    except (spec.SpecError, AttributeError):
        implementation = "?"
    config = fields.get("config")
    if isinstance(config, dict) and isinstance(config.get("fields"), dict) and config["fields"]:
        name = str(config.get("dataclass")).rsplit(".", 1)[-1]
        config_text = f"{name}({', '.join(f'{k}={v}' for k, v in config['fields'].items())})"
    else:
        config_text = "-"
    arguments = _object(data.get("arguments"))
    args_text = ", ".join(
        f"{k}={v}" for k, v in arguments.items()
        if isinstance(v, str) and re.fullmatch(r"[a-z0-9]+\[[0-9,]*\]", v)
    )
    return FoundOp(op_path.rsplit(".", 1)[-1], implementation, config_text, args_text, count, data)


@dataclasses.dataclass(frozen=True)
class Inspection:
    """What `inspect` found: the ops in the module, its custom calls, the manifest if any."""

    ops: tuple[FoundOp, ...]
    custom_calls: tuple[str, ...]
    manifest: Mapping[str, Any] | None = None

    @classmethod
    def from_text(cls, text: str, manifest: Mapping[str, Any] | None = None, *,
                  what: str = "the StableHLO text") -> Inspection:
        """The ops in `text`; errors and warnings name it as `what` (a file's path)."""
        return cls(tuple(find_ops(text, what=what)), tuple(custom_call_targets(text)),
                   manifest)

    def __str__(self) -> str:
        parts = []
        if self.manifest is not None:
            m = self.manifest
            parts.append(
                f"artifact {m.get('name')} ({m.get('function')}): platforms "
                f"{m.get('platforms')}, device kinds {m.get('device_kinds')}\n"
                f"inputs {m.get('in_specs')} -> outputs {m.get('out_specs')}\n"
                f"versions {m.get('versions')}"
            )
            rows = [[o["path"], o["platform"], o["arguments"],
                     f"{o['implementation']} ({o['op']})", o["config"], o["source"]]
                    for o in m.get("ops", ())]
            parts.append(format_table(
                ("path", "platform", "arguments", "implementation", "config", "source"), rows))
        parts.append("ops in the StableHLO:")
        parts.append(format_table(
            ("op", "implementation", "config", "arguments", "instructions"),
            [[o.op, o.implementation, o.config, o.arguments, o.instructions] for o in self.ops],
        ))
        parts.append("custom calls: " + (", ".join(self.custom_calls) or "(none)"))
        return "\n".join(parts)


def inspect_path(source: str | os.PathLike[str], *,
                 load_artifact_dir: Callable[[Path], Any],
                 deserialize: Callable[[bytes, str], str]) -> Inspection:
    """Inspects an artifact directory, a serialized `.stablehlo` file, a text file, or text.
    `deserialize(data, what)` is the module text of a serialized program; its errors name
    `what` (the file)."""
    path = Path(source) if not _looks_like_text(source) else None
    if path is None:
        return Inspection.from_text(str(source))
    if path.is_dir():
        artifact = load_artifact_dir(path)
        return Inspection.from_text(artifact.mlir_text(), manifest=artifact.manifest,
                                    what=f"the artifact {path}")
    if not path.is_file():
        raise FileNotFoundError(f"inspect: {path} is neither a file nor an artifact directory")
    data = spec.read_binary_file(path, what=str(path))
    try:
        text = data.decode()
    except UnicodeDecodeError:
        text = None
    if text is None or (path.suffix == ".stablehlo" and not _is_text(text)):
        return Inspection.from_text(deserialize(data, str(path)), what=str(path))
    if not (_is_text(text) or METADATA_KEY in text):
        # A JSON file or notes: "no tokamax_pass ops" would be a wrong answer.
        raise ValueError(f"inspect: {path} is not StableHLO/MLIR or HLO text (it starts "
                         f"{text.lstrip()[:30]!r}), a serialized .stablehlo file or an "
                         f"artifact directory")
    return Inspection.from_text(text, what=str(path))


def _looks_like_text(source: Any) -> bool:
    return isinstance(source, str) and ("\n" in source or METADATA_KEY in source
                                        or source.lstrip().startswith(("module", "HloModule")))


def _is_text(text: str) -> bool:
    return text.lstrip().startswith(("module", "HloModule", "#loc", "func"))
