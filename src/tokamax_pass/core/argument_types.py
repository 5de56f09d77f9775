"""Whether a value read from a spec fits the type an op's `_fwd` annotates its parameter with.

A bound-arguments spec read from a file names an op and its arguments; a value of the
wrong kind (`"is_causal": "yes"`, `"scale": "x"`, a string where an array goes) was
accepted and failed later, deep inside a kernel. `fits` answers for the annotations op
signatures use (arrays, numbers, bools, strings, enums, tuples, unions, `Literal`,
`Callable`); an annotation it does not know accepts anything, so a user's own op with
unusual annotations still loads.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from tokamax_pass.core import spec

# Parameters of `_fwd` that are not arguments of the call.
_NOT_ARGUMENTS = ("self", "config", "return_residuals")


@dataclasses.dataclass(frozen=True)
class CallSignature:
    """What an op's call takes, from the `_fwd` methods of its class and its bases: an
    implementation's `_fwd` may take `**statics` that its family's `_fwd` names and types.

    `parameters`: each name's parameter as the nearest `_fwd` declares it; `takes_any`:
    whether every `_fwd` takes any keyword; `types`: each name's resolved annotation,
    where it resolves (a name imported only for type checking does not: not checked).
    """

    parameters: Mapping[str, inspect.Parameter]
    takes_any: bool
    types: Mapping[str, Any]


@functools.cache
def call_signature(op_cls: type) -> CallSignature:
    parameters: dict[str, inspect.Parameter] = {}
    types_: dict[str, Any] = {}
    takes_any = True
    for klass in op_cls.__mro__:
        fwd = klass.__dict__.get("_fwd")
        if fwd is None:
            continue
        own = inspect.signature(fwd).parameters
        takes_any = takes_any and any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in own.values())
        for name, parameter in own.items():
            if name not in _NOT_ARGUMENTS and parameter.kind not in _VARIADIC:
                parameters.setdefault(name, parameter)
        for name, hint in _resolved_types(fwd).items():
            types_.setdefault(name, hint)
    return CallSignature(parameters, takes_any, types_)


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _resolved_types(function: Callable[..., Any]) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - any failure to evaluate an annotation
        return {}
    hints.pop("return", None)
    return hints


def fits(value: Any, hint: Any) -> bool:
    """Whether `value` (as `spec.decode` gives it: arrays as `jax.ShapeDtypeStruct`, lists
    as tuples) can be an argument annotated `hint`."""
    if hint is Any or hint is inspect.Parameter.empty or isinstance(hint, (str, typing.TypeVar)):
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, h) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return callable(value)
    if origin in (tuple, collections.abc.Sequence):
        return _fits_sequence(value, typing.get_args(hint))
    if hint is jax.Array or hint is np.ndarray:
        return isinstance(value, jax.ShapeDtypeStruct)
    if hint is bool:
        return isinstance(value, (bool, np.bool_))
    if hint is int:
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
            value, bool)
    if isinstance(hint, type) and origin is None:
        return isinstance(value, hint)
    return True


def _fits_sequence(value: Any, args: tuple[Any, ...]) -> bool:
    if not isinstance(value, tuple):
        return False
    if not args:
        return True
    if (len(args) == 2 and args[1] is Ellipsis) or len(args) == 1:
        return all(fits(v, args[0]) for v in value)
    return len(value) == len(args) and all(fits(v, a) for v, a in zip(value, args, strict=True))


def describe(value: Any) -> str:
    """A value in a message: an array spec's dtype and shape, else a short repr."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return f"an array {np.dtype(value.dtype).name}{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def type_name(hint: Any) -> str:
    """An annotation in a message (`jax.Array | None`, `bool`)."""
    if isinstance(hint, type) and typing.get_origin(hint) is None:
        return "jax.Array" if hint is jax.Array else hint.__name__
    return str(hint).replace("typing.", "")


def check_arguments(op_cls: type, arguments: Mapping[str, Any]) -> None:
    """`spec.SpecError` naming what is wrong with `arguments` (decoded) for a call of
    `op_cls`: an unknown name, a missing required argument, a value of the wrong kind."""
    signature = call_signature(op_cls)
    name = op_cls.__name__
    unknown = set() if signature.takes_any else set(arguments) - set(signature.parameters)
    if unknown:
        raise spec.SpecError(f"{name} takes no arguments named {sorted(unknown)}")
    missing = [k for k, p in signature.parameters.items()
               if p.default is inspect.Parameter.empty and k not in arguments]
    if missing:
        raise spec.SpecError(f"{name} is missing the arguments {missing}")
    for key, value in arguments.items():
        hint = signature.types.get(key, Any)
        if not fits(value, hint):
            raise spec.SpecError(f"{name}: argument {key!r} must be {type_name(hint)}, got "
                                 f"{describe(value)}")


def check_op_fields(op: Any, op_base: type) -> None:
    """`spec.SpecError` naming the field where an op read from a spec holds a value of
    another kind than its class annotates, through the ops it holds (`vjp`, an
    `AutodiffVjp`'s `forward`): unchecked, `interpret: "no"` would be taken as true, and a
    `config` of another op's config class (or `5`) or a `vjp` of `5` would load and fail
    only when the op runs. `op_base` is `Op` (its type parameter names a config's annotation)."""
    cls: type = type(op)
    hints = _op_field_types(cls, op_base)
    for field in dataclasses.fields(op):
        if not field.init or field.metadata.get(spec.NOT_IN_SPEC):
            continue
        value = getattr(op, field.name)
        config_cls = getattr(cls, "config_cls", None)
        if field.name == "config" and isinstance(config_cls, type):
            hint: Any = config_cls | None
        else:
            hint = hints.get(field.name, Any)
        if not fits(value, hint):
            raise spec.SpecError(f"{cls.__name__}: field {field.name!r} must be "
                                 f"{type_name(hint)}, got {describe(value)}")
        if isinstance(value, op_base):
            check_op_fields(value, op_base)


@functools.cache
def _op_field_types(cls: type, op_base: type) -> dict[str, Any]:
    """The resolved annotations of an op class's fields (none where they do not resolve)."""
    params = {p.__name__: p for p in getattr(op_base, "__type_params__", ())}
    try:
        return typing.get_type_hints(cls, localns=params)
    except Exception:  # noqa: BLE001 - any failure to evaluate an annotation
        return {}
