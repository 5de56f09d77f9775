"""One serialization layer: arg specs, configs and ops as JSON.

Every place that writes something a human or another process reads back (op
metadata in StableHLO, bound-argument lists, autotuning results, caches,
artifact manifests) goes through these functions, so a shape is always spelled
`"bf16[32,2048,16,64]"` and an op always by its import path.

Reading never imports what a file names: an op class, config, enum or function in a
spec is looked up in an allowlist (the library's op families and their configs, the
`jax.nn` activations, and what `register_serializable` adds), so a file cannot run code.
Input is bounded too (`MAX_JSON_CHARS`, `MAX_DEPTH`, `MAX_ITEMS`, `MAX_STRING_CHARS`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import json
import math
import os
import re
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from tokamax_pass.core import config_limits

SCHEMA_VERSION = 1

# Bounds on what a loader reads: a JSON text's length, its nesting, a list's or an
# object's items, a string value's length.
MAX_JSON_CHARS = 256 * 2**20
MAX_DEPTH = 64
MAX_ITEMS = 2**16
MAX_STRING_CHARS = 2**12
# An array spec's rank and the digits of each dimension; XLA's own limit on a dimension
# and on an array's bytes (an int64) is checked too: a spec becomes a program (autotuning
# a bound-arguments file, an export's arguments), where a larger one failed deep in MLIR.
MAX_RANK = 16
MAX_DIM_DIGITS = 20
MAX_XLA_SIZE = 2**63 - 1

_DTYPE_NAMES: dict[str, str] = {
    "bool": "bool",
    "int4": "s4",
    "int8": "s8",
    "int16": "s16",
    "int32": "s32",
    "int64": "s64",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float64": "f64",
    "float8_e4m3fn": "f8e4m3fn",
    "float8_e5m2": "f8e5m2",
}
_SHORT_TO_DTYPE = {short: name for name, short in _DTYPE_NAMES.items()}
_ARRAY_SPEC = re.compile(r"^([a-z0-9]+)\[([0-9,]*)\]$")
# What only an array spec starts with (a dtype and a bracket): such a string that is not a
# whole spec is a damaged one, not a string argument.
_ARRAY_SPEC_START = re.compile(r"^\s*[a-z]+[0-9]*\[")


# A dataclass field's metadata key: a field marked with it is left out of its spec (how
# to call an op, not what the op is: `Op.bypass_device_check`).
NOT_IN_SPEC = "tokamax_pass_not_in_spec"


class SpecError(ValueError):
    """A JSON spec that cannot be read back (corrupt, unknown op, newer schema)."""


def short_dtype(dtype: Any) -> str:
    name = np.dtype(dtype).name
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise SpecError(f"dtype {name!r} has no short spec name") from None


def is_array(value: Any) -> bool:
    """True for anything with a shape and dtype that travels as a kernel operand."""
    return isinstance(value, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, jax.core.Tracer)) or (
        hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, np.dtype)
        and not isinstance(value, (np.generic, type))
    )


def has_symbolic_dims(tree: Any) -> bool:
    """True where an array in `tree` (arrays, tracers, avals, `ShapeDtypeStruct`s) has a
    dimension that is not an integer: `jax.export`'s symbolic dimensions."""
    return any(jax.export.is_symbolic_dim(d) for leaf in jax.tree.leaves(tree)
               if is_array(leaf) for d in leaf.shape)


def array_spec(value: Any) -> str:
    """`"bf16[32,2048,16,64]"` for an array, tracer or ShapeDtypeStruct; a symbolic
    dimension (`jax.export.symbolic_shape`) as its expression, `"f32[2*b,16]"` (shown, never
    parsed back: `parse_array_spec` takes integers only)."""
    dims = (str(d).replace(" ", "") if jax.export.is_symbolic_dim(d) else str(int(d))
            for d in value.shape)
    return f"{short_dtype(value.dtype)}[{','.join(dims)}]"


def parse_array_spec(text: str) -> jax.ShapeDtypeStruct:
    """The `jax.ShapeDtypeStruct` of `"bf16[32,2048]"`; `SpecError` for a text that is
    not one (listing the dtype spellings), or an array XLA cannot hold: a dimension, or
    the array's bytes, above `MAX_XLA_SIZE`."""
    match = _ARRAY_SPEC.match(text.replace(" ", ""))
    if match is None or match.group(1) not in _SHORT_TO_DTYPE:
        raise SpecError(f"{text[:80]!r} is not an array spec like 'bf16[32,2048,16,64]' "
                        f"(dtypes as StableHLO spells them: bf16, f16, f32, f64, s8, s32, "
                        f"s64, u8, u32, bool, ...)")
    dims = match.group(2).split(",") if match.group(2) else []
    if len(dims) > MAX_RANK or not all(d.isdigit() and len(d) <= MAX_DIM_DIGITS for d in dims):
        raise SpecError(f"{text[:80]!r}: an array spec has at most {MAX_RANK} dimensions, "
                        f"each an integer of at most {MAX_DIM_DIGITS} digits")
    shape = tuple(int(d) for d in dims)
    dtype = jax.numpy.dtype(_SHORT_TO_DTYPE[match.group(1)])
    if any(d > MAX_XLA_SIZE for d in shape):
        raise SpecError(f"{text!r} has a dimension above {MAX_XLA_SIZE} (2**63 - 1), the "
                        f"largest XLA can hold")
    if math.prod(shape) * dtype.itemsize > MAX_XLA_SIZE:
        raise SpecError(f"{text!r} holds more than {MAX_XLA_SIZE} (2**63 - 1) bytes, the "
                        f"most XLA can address")
    return jax.ShapeDtypeStruct(shape, dtype)


def import_path(obj: Any) -> str:
    """`module.QualName` of a class or function, checked to import back."""
    target = getattr(obj, "__wrapped__", obj)
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    # A `functools.partial` or a callable instance has no name of its own to import.
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise SpecError(f"{obj!r} is not importable by name (no __module__/__qualname__: "
                        "a functools.partial or a callable instance)")
    path = f"{module}.{qualname}"
    if "<" in path:
        raise SpecError(f"{obj!r} is not importable by name (a lambda or local object)")
    return path


_REGISTER_FIX = ("register it with `tokamax_pass.register_serializable(obj)` in the code "
                 "that loads the file (before loading)")
_ALLOWED: dict[str, Any] = {}
# Op classes (and their config classes) this process has lowered calls of, by import
# path: a spec may name them unregistered, as they are code the program already ran
# (`remember_lowered`). The latest class of a path wins (a redefined class).
_LOWERED_HERE: dict[str, Any] = {}
# Library modules whose import registers the built-in op families (fixed here; never
# taken from a file).
_BUILTIN_MODULES = (
    "tokamax_pass.core",
    "tokamax_kernels.attention",
    "tokamax_kernels.layer_norm",
    "tokamax_kernels.ragged_dot",
    "tokamax_kernels.gated_linear_unit",
    "tokamax_kernels.linear_softmax_cross_entropy_loss",
)


def _builtin_functions() -> dict[str, Callable[..., Any]]:
    """The functions ops take as arguments (GLU activations), by their public names."""
    nn_names = ("celu", "elu", "gelu", "hard_sigmoid", "hard_silu", "hard_swish", "hard_tanh",
                "identity", "leaky_relu", "log_sigmoid", "mish", "relu", "relu6", "selu",
                "sigmoid", "silu", "soft_sign", "softplus", "sparse_plus", "sparse_sigmoid",
                "squareplus", "swish")
    table = {f"jax.nn.{n}": getattr(jax.nn, n) for n in nn_names if hasattr(jax.nn, n)}
    table["jax.numpy.tanh"] = jax.numpy.tanh
    return table


@functools.cache
def _load_builtins() -> None:
    for name, function in _builtin_functions().items():
        register_serializable(function, name=name)
    for enum_cls in (jax.lax.Precision, jax.lax.DotAlgorithmPreset):
        register_serializable(enum_cls)
    for module in _BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:  # a kernel package missing its own dependency
                raise
    core = importlib.import_module("tokamax_pass.core")
    for cls in (core.NullConfig, core.AutodiffVjp):
        if not is_registered(cls):
            register_serializable(cls)
    # `NullConfig`'s former import path, which saved specs and profiles' stamps name.
    _ALLOWED.setdefault("tokamax_pass.core.op.NullConfig", core.NullConfig)


def register_serializable[T](obj: T, *, name: str | None = None) -> T:
    """Allows specs to name `obj` (an `Op` subclass, a config dataclass, an enum or a
    function), so results, caches and bound-argument files that use it load.

    Usable as a decorator. An `Op` subclass brings its `config_cls`. `name` adds another
    name to accept besides the import path `encode` writes. Returns `obj`.
    """
    kind = _kind_of(obj)
    if kind is None:
        raise TypeError(f"register_serializable: {obj!r} is not a dataclass, an enum class or "
                        "a function")
    names = [import_path(obj)] + ([name] if name is not None else [])
    for key in names:
        known = _ALLOWED.get(key)
        if known is not None and known is not obj:
            raise ValueError(f"register_serializable: {key!r} is already registered for "
                             f"{known!r}")
    for key in names:
        _ALLOWED[key] = obj
    config_cls = getattr(obj, "config_cls", None)
    if kind == "dataclass" and dataclasses.is_dataclass(config_cls) and isinstance(
            config_cls, type):
        _ALLOWED.setdefault(import_path(config_cls), config_cls)
    return obj


def remember_lowered(op_cls: type) -> None:
    """Lets specs name `op_cls` and its `config_cls` without registration: this process
    lowered a call of it, so a spec naming it names code the program already ran (an op
    a user wrote reads back from the programs `autotune(f)` lowers, as upstream
    Tokamax's do). Registered objects keep their entries; classes without an import
    path (local classes) are left out."""
    for cls in (op_cls, getattr(op_cls, "config_cls", None)):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            continue
        try:
            path = import_path(cls)
        except SpecError:
            continue
        if path not in _ALLOWED:
            _LOWERED_HERE[path] = cls


def lowered_classes() -> int:
    """How many classes `remember_lowered` lets specs name: a file read before another
    joined them may read otherwise after."""
    return len(_LOWERED_HERE)


def is_registered(obj: Any) -> bool:
    try:
        return _ALLOWED.get(import_path(obj)) is obj
    except SpecError:
        return False


def _kind_of(obj: Any) -> str | None:
    if isinstance(obj, type):
        if issubclass(obj, enum.Enum):
            return "enum"
        return "dataclass" if dataclasses.is_dataclass(obj) else None
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)) or (
            callable(obj) and hasattr(obj, "__qualname__")):
        return "callable"
    return None


def resolve(path: Any, *, kind: str) -> Any:
    """The registered object a spec names, or a `SpecError` naming the entry and the fix.

    Nothing is imported on a file's say: an unknown name is an error, whatever module
    it points into.
    """
    if not isinstance(path, str) or len(path) > MAX_STRING_CHARS:
        raise SpecError(f"a {kind!r} entry must name a registered object, got {path!r}")
    if path not in _ALLOWED:
        _load_builtins()
    obj = _ALLOWED.get(path, _LOWERED_HERE.get(path))
    if obj is None:
        raise SpecError(f"{kind} {path!r} is not a registered serializable object, so it is "
                        f"not loaded (files never name code to import); if it is yours, "
                        f"{_REGISTER_FIX}, or run a call of it in this process first")
    if _kind_of(obj) != kind:
        raise SpecError(f"{path!r} is registered as a {_kind_of(obj)}, not a {kind}")
    return obj


def encode(value: Any) -> Any:
    """A JSON-able form of an argument, config field or op field."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if is_array(value):
        return array_spec(value)
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return {"dtype": np.dtype(value).name}
    if isinstance(value, enum.Enum):
        return {"enum": import_path(type(value)), "name": value.name}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)
                  if not f.metadata.get(NOT_IN_SPEC)}
        try:
            return {"dataclass": import_path(type(value)), "fields": fields}
        except SpecError:
            # A class defined inside a function: recorded, but it cannot be loaded back.
            return {"dataclass": None, "repr": type(value).__qualname__, "fields": fields}
    if callable(value):
        try:
            return {"callable": import_path(value)}
        except SpecError:
            # Still recorded (for reading), but cannot be imported back.
            return {"callable": None, "repr": repr(value)}
    raise SpecError(f"cannot serialize {value!r} of type {type(value).__name__}")


def decode(value: Any, _depth: int = 0) -> Any:
    """Inverse of `encode`; arrays come back as `jax.ShapeDtypeStruct`.

    Classes and functions are looked up with `resolve` (never imported); a dataclass is
    built from its fields, so a config's own checks run on what a file holds.
    """
    if _depth > MAX_DEPTH:
        raise SpecError(f"a spec nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        if len(value) > MAX_STRING_CHARS:
            raise SpecError(f"a spec string of {len(value)} characters (at most "
                            f"{MAX_STRING_CHARS}): {value[:40]!r}...")
        return parse_array_spec(value) if _ARRAY_SPEC_START.match(value) else value
    if isinstance(value, list):
        _check_items(value)
        return tuple(decode(v, _depth + 1) for v in value)
    if isinstance(value, dict):
        _check_items(value)
        return _decode_object(value, _depth)
    return value


def _check_items(value: list[Any] | dict[str, Any]) -> None:
    if len(value) > MAX_ITEMS:
        raise SpecError(f"a spec list or object of {len(value)} items (at most {MAX_ITEMS})")


def _decode_object(value: dict[str, Any], depth: int) -> Any:
    if "dtype" in value:
        name = value["dtype"]
        if not isinstance(name, str) or name not in _DTYPE_NAMES:
            raise SpecError(f"unknown dtype {name!r}; known: {sorted(_DTYPE_NAMES)}")
        return np.dtype(jax.numpy.dtype(name))
    if "enum" in value:
        enum_cls = resolve(value["enum"], kind="enum")
        try:
            return enum_cls[value.get("name")]
        except (KeyError, TypeError):
            raise SpecError(f"{enum_cls.__name__} has no member {value.get('name')!r}") from None
    if "dataclass" in value:
        if value["dataclass"] is None:
            raise SpecError(
                f"{value.get('repr')!r} was defined inside a function when this spec was "
                "written; define it at module level and register it to make it reloadable"
            )
        cls = resolve(value["dataclass"], kind="dataclass")
        fields = value.get("fields", {})
        if not isinstance(fields, dict):
            raise SpecError(f"{value['dataclass']!r}: 'fields' must be an object, got {fields!r}")
        _check_items(fields)
        return construct(cls, {k: decode(v, depth + 1) for k, v in fields.items()})
    if "callable" in value:
        if value["callable"] is None:
            raise SpecError(
                f"{value.get('repr')!r} was not importable by name when this spec was written; "
                "use a module-level function (e.g. jax.nn.gelu) to make it reloadable"
            )
        return resolve(value["callable"], kind="callable")
    raise SpecError(f"unknown encoded value {str(value)[:200]}")


def construct(cls: type, fields: Mapping[str, Any]) -> Any:
    """`cls(**fields)` for a registered dataclass, its own checks' errors as `SpecError`.

    A field `encode` leaves out (`NOT_IN_SPEC`: how to call an op, like
    `bypass_device_check`) is not taken from a file either."""
    names = {f.name for f in dataclasses.fields(cls) if f.init and not f.metadata.get(NOT_IN_SPEC)}
    unknown = set(fields) - names
    if unknown:
        raise SpecError(f"{cls.__name__} has no fields {sorted(unknown)} a spec may give")
    try:
        return cls(**fields)  # an op checks its config's limits itself (`Op.__post_init__`)
    except (TypeError, ValueError) as e:
        raise SpecError(f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"
                        f" was rejected: {e}") from None


def encode_config(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    return {f.name: encode(getattr(config, f.name)) for f in dataclasses.fields(config)}


def decode_config(config_cls: type, data: Mapping[str, Any] | None) -> Any:
    """The config `data` holds, checked by `config_cls` itself (its limits: its
    `ValueError` or `TypeError` passes through)."""
    if data is None:
        return None
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = set(data) - names
    if unknown:
        raise SpecError(f"{config_cls.__name__} has no fields {sorted(unknown)}")
    config = config_cls(**{k: decode(v) for k, v in data.items()})
    config_limits.check(config)
    return config


def dumps(obj: Any) -> str:
    """Canonical JSON (sorted keys, no spaces): equal specs give equal strings."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _read_bounded(path: str | os.PathLike[str], *, limit: int | None, what: str,
                  beyond: str) -> bytes:
    """The bytes of the file at `path`: `SpecError` (`what` is N bytes long, `beyond`) for
    one above `limit` bytes, found before it is read where its size is known (a sparse
    file of a terabyte is never read into memory), or while it is read (a pipe, whose
    size reads 0, or a file that grows)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = _read_at_most(f, size, limit) if limit is None or size <= limit else b""
    length = max(size, len(data))
    if limit is not None and length > limit:
        raise SpecError(f"{what} is {length} bytes long, {beyond}")
    return data


# How many bytes a read asks for once a file has given its stated size (a pipe states 0).
_READ_BLOCK = 1 << 20


def _read_at_most(f: Any, size: int, limit: int | None) -> bytes:
    """`f`'s bytes to its end or to one past `limit`: its stated `size` (and one more) in
    one read, then blocks, none asking for more than is left below the limit."""
    chunks, length = [], 0
    while limit is None or length <= limit:
        wanted = max(size + 1 - length, _READ_BLOCK)
        chunk = f.read(wanted if limit is None else min(wanted, limit + 1 - length))
        if not chunk:
            break
        chunks.append(chunk)
        length += len(chunk)
    return b"".join(chunks)


def read_file(path: str | os.PathLike[str], *, what: str) -> bytes:
    """The bytes of the JSON file at `path`: `SpecError` for one above `MAX_JSON_CHARS`
    bytes (every writer here writes ASCII JSON, a byte per character)."""
    return _read_bounded(path, limit=MAX_JSON_CHARS, what=what,
                         beyond=f"above the {MAX_JSON_CHARS} a loader reads")


def physical_memory_bytes() -> int | None:
    """This machine's physical memory, where the OS tells it."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such name here, or no `sysconf`
        return None


def read_binary_file(path: str | os.PathLike[str], *, what: str) -> bytes:
    """The bytes of a binary file a loader reads whole (a serialized program): `SpecError`
    for one larger than this machine's memory."""
    memory = physical_memory_bytes()
    return _read_bounded(path, limit=memory, what=what,
                         beyond=f"more than this machine's {memory} bytes of memory: not a "
                                f"file a loader reads whole")


def loads(text: str, *, what: str) -> Any:
    """`json.loads` of a text within `MAX_JSON_CHARS` and `MAX_DEPTH` (checked first, so a
    deeply nested document is a `SpecError`, not a `RecursionError`), whose objects name
    each key once."""
    if len(text) > MAX_JSON_CHARS:
        raise SpecError(f"{what} is {len(text)} characters long, above the {MAX_JSON_CHARS} "
                        f"a loader reads")
    check_depth(text, what=what)
    try:
        data = json.loads(text, object_pairs_hook=object_of_unique_keys)
    except RepeatedKeyError as e:
        raise SpecError(f"{what} gives the key {e.args[0]!r:.80} twice in one object (JSON "
                        f"keeps the last: the first value would be dropped, silently)") from None
    except ValueError as e:  # `JSONDecodeError`, or an integer too long to convert
        raise SpecError(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise SpecError(f"{what} is nested too deeply") from None
    if _SURROGATE.search(text):
        _check_unicode(data, what=what)
    return data


# A surrogate code point, escaped (`\ud800`) or as it is: half of a pair at best.
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")


def _check_unicode(data: Any, *, what: str) -> None:
    """`SpecError` where a string of `data` holds a lone surrogate (JSON's `"\\ud800"`
    escape reads as one): it is no Unicode text, and printing it or writing it as UTF-8
    raised a bare `UnicodeEncodeError` far from the file (`tokamax-pass inspect`)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise SpecError(f"{what} holds a string with a lone surrogate (a \\ud800-\\udfff "
                        f"escape that is not half of a pair): not Unicode text") from None


class RepeatedKeyError(Exception):
    """A JSON object that names one key twice (hand-merged files: two `"entries"`)."""


def object_of_unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        keys = [k for k, _ in pairs]
        raise RepeatedKeyError(next(k for i, k in enumerate(keys) if k in keys[:i]))
    return found


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?')
_BRACKETS = re.compile(r"[\[\]{}]")


def check_depth(text: str, *, what: str, limit: int = MAX_DEPTH) -> None:
    """`SpecError` if the JSON `text` nests lists and objects deeper than `limit`."""
    depth = 0
    for match in _BRACKETS.finditer(_JSON_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            if depth > limit:
                raise SpecError(f"{what} nests JSON deeper than {limit} levels")
        else:
            depth -= 1


def raw_decode(text: str, start: int, *, what: str) -> tuple[Any, int]:
    """`json.JSONDecoder.raw_decode` of the value at `text[start:]` (an object or list
    embedded in other text), bounded like `loads`."""
    end = _value_end(text, start)
    return loads(text[start:end], what=what), end


def _value_end(text: str, start: int) -> int:
    """Where the bracketed JSON value at `start` ends (the text's end if it never does)."""
    depth = 0
    for match in _TOKENS.finditer(text, start):
        token = match.group()
        if token in "[{":
            depth += 1
        elif token in "]}":
            depth -= 1
            if depth == 0:
                return match.end()
    return len(text)


_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def check_schema(data: Mapping[str, Any], *, what: str) -> None:
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise SpecError(f"{what} has no integer 'schema_version'")
    if version < 1:
        raise SpecError(f"{what} has schema version {version}, which no tokamax_pass writes "
                        f"(versions start at 1)")
    if version > SCHEMA_VERSION:
        raise SpecError(
            f"{what} was written with schema version {version}, newer than this "
            f"tokamax_pass understands ({SCHEMA_VERSION}); upgrade tokamax_pass to read it"
        )

