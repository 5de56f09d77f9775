"""Finding the op calls in a program: from a callable, a `Lowered`, StableHLO/HLO text.

Every instruction an op call lowers to carries the frontend attribute
`tokamax_pass_spec` (the call's `BoundArguments` JSON, config included). Here
the attribute values are collected, decoded, stripped of their config and
deduplicated, giving abstract `BoundArguments` (`ShapeDtypeStruct` arguments).
MLIR text quotes the value and escapes characters as `\\XX` hex pairs (`\\22` is a
quote); HLO text (`compiled.as_text()`) writes the JSON object bare
(`tokamax_pass_spec={...}`): both are read. A callable is lowered afresh with
`primitive.specs_only`: each call's spec is recorded as it is lowered and its kernel is
never built. Under a `jax.set_mesh` mesh an op call is a `custom_partitioning` whose
per-device call is lowered only when the program is compiled: a callable's program is
then compiled too, and the specs of the calls lowered meanwhile are read.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Iterable, Sequence
from typing import IO, Any

import jax

from tokamax_pass.autotuning import keys, result
from tokamax_pass.core import checks, spec
from tokamax_pass.core.atomic_io import write_atomic
from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.core.caller_warnings import skip_unreadable, warn_at_caller
from tokamax_pass.core.primitive import METADATA_KEY, recording_lowerings, specs_only

BOUND_ARGS_FORMAT = "tokamax_pass.BoundArgumentsList"
_PARTITIONED_CALL = "CustomSPMDPartitioning"  # the custom call of `custom_partitioning`
# `tokamax_pass_spec = "..."` (MLIR) or `tokamax_pass_spec={...}` (HLO text).
_ATTRIBUTE = re.compile(METADATA_KEY + r'\s*=\s*(?:"((?:[^"\\]|\\.)*)"|(?=\{))')
_MLIR_ESCAPE = re.compile(r"\\([0-9A-Fa-f]{2})")


def _unescape(value: str) -> str:
    """A quoted attribute's text, unescaped; `spec.SpecError` for escapes no JSON string
    has (`\\q`)."""
    if "\\22" in value or "\\5C" in value:
        return _MLIR_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), value)
    try:
        return json.loads(f'"{value}"')
    except ValueError as e:
        raise spec.SpecError(f"a {METADATA_KEY} attribute is not a valid quoted string: "
                             f"{e}") from None


# How StableHLO/MLIR and HLO text starts (`tokamax_pass.inspect` reads files by the same).
_PROGRAM_STARTS = ("module", "HloModule", "#loc", "func")


def specs_from_text(text: str) -> list[str]:
    """The distinct spec JSON strings in StableHLO (MLIR) or HLO text, in program order.

    An attribute that cannot be read (a bad escape, a truncated object) is skipped with a
    warning naming why, so the program's other calls are still found; where none can be
    read, its `spec.SpecError` is raised."""
    specs: dict[str, None] = {}
    unreadable: list[spec.SpecError] = []
    for match in _ATTRIBUTE.finditer(text):
        try:
            if match.group(1) is not None:
                specs.setdefault(_unescape(match.group(1)))
            else:
                value, _ = spec.raw_decode(text, match.end(),
                                           what=f"a {METADATA_KEY} attribute")
                specs.setdefault(spec.dumps(value))
        except spec.SpecError as e:
            unreadable.append(e)
    skip_unreadable(specs, unreadable, "an op call")
    return list(specs)


def dedupe(bound: Iterable[BoundArguments]) -> list[BoundArguments]:
    """Configs stripped (`op.replace(config=None)`), duplicates dropped, order kept."""
    seen: dict[tuple[str, str], BoundArguments] = {}
    for ba in bound:
        stripped = ba.replace(op=ba.op.replace(config=None))
        seen.setdefault(keys.entry_key(stripped), stripped)
    return list(seen.values())


def bound_args_from_specs(specs: Iterable[str]) -> list[BoundArguments]:
    """The op calls the specs name. A spec that cannot be read back (a GLU activation
    given as a lambda or a local function is not importable by name) is skipped with a
    warning naming it, so the program's other calls are still found and tuned; if no
    spec can be read, its error is raised."""
    found, unreadable = [], []
    for text in specs:
        try:
            found.append(BoundArguments.from_json(text))
        except spec.SpecError as e:
            unreadable.append((_op_name(text), e))
    if unreadable and not found:
        raise unreadable[0][1]
    for name, error in unreadable:
        warn_at_caller(f"skipping a {name} call, which cannot be tuned: {error}")
    return dedupe(found)


def _op_name(text: str) -> str:
    """The op class a spec names (for messages), or "op" where it cannot be read."""
    try:
        return spec.loads(text, what="op metadata")["op"]["dataclass"].rpartition(".")[2]
    except (ValueError, KeyError, TypeError, AttributeError):
        return "op"


def _program_specs(f: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[str]:
    if isinstance(f, str):
        _reject_further_arguments("StableHLO/HLO text", "text", args, kwargs)
        found = specs_from_text(f)
        if not found and not f.lstrip().startswith(_PROGRAM_STARTS):
            # A path or a typo found no op and tuned nothing, silently.
            raise ValueError(
                f"get_bound_args: a str must be StableHLO/MLIR or HLO text (it starts with "
                f"one of {_PROGRAM_STARTS}), got {f[:60]!r}; for a file, pass its text "
                f"(pathlib.Path(path).read_text())")
        return found
    if isinstance(f, jax.stages.Lowered):
        _reject_further_arguments("a jax.stages.Lowered", "lowered", args, kwargs)
        return specs_from_text(f.as_text())
    if isinstance(f, jax.stages.Compiled):
        _reject_further_arguments("a jax.stages.Compiled", "compiled", args, kwargs)
        text = f.as_text()
        if text is None:
            raise ValueError("get_bound_args: this jax.stages.Compiled has no program text "
                             "to read op calls from; pass the jax.stages.Lowered instead")
        return specs_from_text(text)
    if not callable(f):
        raise TypeError(
            f"get_bound_args: expected a callable, a jax.stages.Lowered or StableHLO text, "
            f"got {type(f).__name__}"
        )
    with recording_lowerings() as lowered_specs, specs_only():
        lowered = _fresh_jit(f, args, kwargs).lower(*args, **kwargs)
        if _PARTITIONED_CALL in lowered.as_text():
            lowered.compile()
    return list(dict.fromkeys(lowered_specs))


def _reject_further_arguments(what: str, name: str, args: Sequence[Any],
                              kwargs: dict[str, Any]) -> None:
    """`TypeError` naming the arguments given after a program that was already traced
    (`Lowered`, `Compiled`, text): its op calls were fixed when it was lowered, and
    arguments of other shapes were silently ignored."""
    if not args and not kwargs:
        return
    extra = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
    raise TypeError(
        f"get_bound_args: {what} takes no further arguments (its op calls were fixed when "
        f"it was lowered), got {len(extra)} more: {', '.join(extra)}; call "
        f"get_bound_args({name}) alone, or pass the function itself to trace it at these "
        f"arguments: get_bound_args(f, *args)")


def _describe(value: Any) -> str:
    """An extra argument in a message: an array's dtype and shape, else a short repr."""
    if spec.is_array(value):
        return f"{value.dtype}{list(value.shape)} array"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _fresh_jit(f: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`f` under a new `jax.jit` (arguments with no array inside static), so its program is
    lowered and compiled afresh: one compiled from a cache would lower no call."""

    def static(value: Any) -> bool:
        return not any(spec.is_array(leaf) for leaf in jax.tree.leaves(value))

    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [
        (f"argument {k!r}", v) for k, v in kwargs.items()]
    for name, value in named:
        if static(value) and not _hashable(value):
            raise TypeError(
                f"get_bound_args: {name} ({type(value).__name__}) holds no array, so it is "
                f"passed as a static argument, which must be hashable; pass arrays or "
                f"jax.ShapeDtypeStruct (a tuple for a static sequence), got {value!r:.80}")
    return jax.jit(lambda *a, **k: f(*a, **k),  # noqa: PLW0108 - a new function: a fresh trace
                   static_argnums=[i for i, a in enumerate(args) if static(a)],
                   static_argnames=[k for k, v in kwargs.items() if static(v)])


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def get_bound_args(f: Any, *args: Any, **kwargs: Any) -> list[BoundArguments]:
    """Every distinct op call in `f(*args, **kwargs)`, configs stripped.

    `f` is a callable (plain or jitted; `jax.grad(f)` includes the VJP ops), a
    `jax.stages.Lowered`, a `jax.stages.Compiled` or StableHLO/HLO text. `args` and
    `kwargs` are a callable's; a program already lowered (`Lowered`, `Compiled`, text)
    takes none (a `TypeError` naming them).
    """
    return bound_args_from_specs(_program_specs(f, args, kwargs))


def _as_list(f_or_list: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[BoundArguments]:
    if isinstance(f_or_list, BoundArguments):
        return [f_or_list]
    if isinstance(f_or_list, (list, tuple)) and all(
            isinstance(b, BoundArguments) for b in f_or_list):
        return dedupe(f_or_list)
    return get_bound_args(f_or_list, *args, **kwargs)


def bound_args_to_json(f_or_list: Any, path: str | os.PathLike | IO[str] | None = None,
                       *args: Any, filename: str | os.PathLike | None = None,
                       **kwargs: Any) -> str:
    """Writes the op calls of `f` (or a list of `BoundArguments`) as a JSON document.

    Returns the JSON text; writes it to `path` (a path or an open file) when given
    (`filename=`: upstream Tokamax's name for it). `path` comes before `f`'s arguments and
    is checked before `f` is traced.
    """
    if filename is not None:
        if path is not None:
            raise TypeError("bound_args_to_json: got path and its other name filename; "
                            "give one")
        path = filename
    if isinstance(path, (str, os.PathLike)):
        path = checks.file_to_write("bound_args_to_json", "path", path)
    elif path is not None and not callable(getattr(path, "write", None)):
        # `bound_args_to_json(f, x, scale)`, as `autotune(f, x, scale)` is called: `x` was
        # taken for the path, and `f` failed to trace without it.
        raise TypeError(f"bound_args_to_json: path must be None, a path or a writable file, "
                        f"got {type(path).__name__}; f's arguments follow it: "
                        f"bound_args_to_json(f, path, *args)")
    bound = _as_list(f_or_list, args, kwargs)
    text = json.dumps({
        "format": BOUND_ARGS_FORMAT,
        "schema_version": spec.SCHEMA_VERSION,
        "bound_arguments": [
            ba.replace(op=ba.op.replace(config=None)).to_spec() for ba in bound
        ],
    }, indent=1, sort_keys=True)
    if isinstance(path, pathlib.Path):
        write_atomic(path, text)
    elif path is not None:
        path.write(text)
    return text


def bound_args_from_json_file(filename: str | os.PathLike) -> list[BoundArguments]:
    """Reads the file `bound_args_to_json` wrote (upstream Tokamax's name for reading a
    path; `bound_args_from_json` takes a path, a file or the text)."""
    if not isinstance(filename, (str, os.PathLike)):
        raise TypeError(f"bound_args_from_json_file: filename must be a path, got "
                        f"{type(filename).__name__}")
    return bound_args_from_json(pathlib.Path(filename))


def bound_args_from_json(source: str | os.PathLike | IO[str] = checks.NOT_GIVEN, *,
                         strict: bool = True,
                         json_string: str = checks.NOT_GIVEN) -> list[BoundArguments]:
    """Reads a list written by `bound_args_to_json` or `xplane_to_bound_args`.

    `source` is a path, an open file or the JSON text itself. A bare JSON list of
    `{"op": ..., "arguments": ...}` objects is accepted too. Each entry is checked against
    its op's signature and `bind` (names, required arguments, kinds of values, shapes): a
    bad one is a `spec.SpecError` naming it, or with `strict=False` it is skipped with a
    `BadEntryWarning`. `json_string=` is upstream Tokamax's name for `source`.
    """
    source = checks.one_of("bound_args_from_json", "source", source, "json_string",
                           json_string)
    what = "bound-arguments JSON"
    if hasattr(source, "read"):
        text = source.read()
    elif isinstance(source, os.PathLike) or (
            isinstance(source, str) and not source.lstrip().startswith(("{", "["))):
        what = f"bound-arguments file {os.fspath(source)!r}"
        path = checks.file_to_read("bound_args_from_json", "source", source)
        text = result.decode_text(spec.read_file(path, what=what), what=what)
    elif isinstance(source, str):
        text = source
    else:
        raise TypeError(f"bound_args_from_json: source must be a path, an open file or JSON "
                        f"text, got {type(source).__name__}")
    data = spec.loads(text, what=what)
    if isinstance(data, dict):
        if data.get("format") != BOUND_ARGS_FORMAT:
            raise spec.SpecError(f"{what} is not a tokamax_pass bound-arguments list")
        spec.check_schema(data, what=what)
        data = data.get("bound_arguments")
    if not isinstance(data, list):
        raise spec.SpecError(f"{what} must hold a list of bound arguments")
    if len(data) > spec.MAX_ITEMS:
        raise spec.SpecError(f"{what} holds {len(data)} bound arguments, above the "
                             f"{spec.MAX_ITEMS} a file may list")
    found = []
    for i, item in enumerate(data):
        try:
            found.append(BoundArguments.from_spec(item))
        except spec.SpecError as e:
            error = spec.SpecError(f"{what}: entry {i}: {e}")
            if strict:
                raise error from None
            warn_at_caller(f"skipping an entry that cannot be read (the others load): {error}",
                           result.BadEntryWarning)
    return found
