"""One serialization layer: arg specs, configs and ops as JSON.

Every place that writes something a human or another process reads back (op
metadata in StableHLO, bound-argument lists, autotuning results, caches,
artifact manifests) goes through these functions, so a shape is always spelled
`"bf16[32,2048,16,64]"` and an op always by its import path.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

SCHEMA_VERSION = 1

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


def array_spec(value: Any) -> str:
    """`"bf16[32,2048,16,64]"` for an array, tracer or ShapeDtypeStruct."""
    return f"{short_dtype(value.dtype)}[{','.join(str(int(d)) for d in value.shape)}]"


def parse_array_spec(text: str) -> jax.ShapeDtypeStruct:
    match = _ARRAY_SPEC.match(text.replace(" ", ""))
    if match is None or match.group(1) not in _SHORT_TO_DTYPE:
        raise SpecError(f"{text!r} is not an array spec like 'bf16[32,2048,16,64]'")
    dims = match.group(2)
    shape = tuple(int(d) for d in dims.split(",")) if dims else ()
    dtype = jax.numpy.dtype(_SHORT_TO_DTYPE[match.group(1)])
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


def import_object(path: str) -> Any:
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name, attr_path = ".".join(parts[:split]), parts[split:]
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            for attr in attr_path:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise SpecError(f"cannot import {path!r}")


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
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
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


def decode(value: Any) -> Any:
    """Inverse of `encode`; arrays come back as `jax.ShapeDtypeStruct`."""
    if isinstance(value, str):
        return parse_array_spec(value) if _ARRAY_SPEC.match(value) else value
    if isinstance(value, list):
        return tuple(decode(v) for v in value)
    if isinstance(value, dict):
        if "dtype" in value:
            return np.dtype(jax.numpy.dtype(value["dtype"]))
        if "enum" in value:
            return import_object(value["enum"])[value["name"]]
        if "dataclass" in value:
            if value["dataclass"] is None:
                raise SpecError(
                    f"{value['repr']} was defined inside a function when this spec was written; "
                    "define it at module level to make it reloadable"
                )
            cls = import_object(value["dataclass"])
            return cls(**{k: decode(v) for k, v in value["fields"].items()})
        if "callable" in value:
            if value["callable"] is None:
                raise SpecError(
                    f"{value['repr']} was not importable by name when this spec was written; "
                    "use a module-level function (e.g. jax.nn.gelu) to make it reloadable"
                )
            return import_object(value["callable"])
        raise SpecError(f"unknown encoded value {value!r}")
    return value


def encode_config(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    return {f.name: encode(getattr(config, f.name)) for f in dataclasses.fields(config)}


def decode_config(config_cls: type, data: Mapping[str, Any] | None) -> Any:
    if data is None:
        return None
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = set(data) - names
    if unknown:
        raise SpecError(f"{config_cls.__name__} has no fields {sorted(unknown)}")
    return config_cls(**{k: decode(v) for k, v in data.items()})


def dumps(obj: Any) -> str:
    """Canonical JSON (sorted keys, no spaces): equal specs give equal strings."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def loads(text: str, *, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{what} is not valid JSON: {e}") from None


def check_schema(data: Mapping[str, Any], *, what: str) -> None:
    version = data.get("schema_version")
    if not isinstance(version, int):
        raise SpecError(f"{what} has no integer 'schema_version'")
    if version > SCHEMA_VERSION:
        raise SpecError(
            f"{what} was written with schema version {version}, newer than this "
            f"tokamax_pass understands ({SCHEMA_VERSION}); upgrade tokamax_pass to read it"
        )

