"""Shared parsing for commands that take `MODULE:FUNCTION --args SPEC ...`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import jax

from tokamax_pass.core import spec


def add_function_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument("function", nargs=None if required else "?",
                        help="MODULE:FUNCTION, e.g. my_model:loss")
    parser.add_argument("--args", nargs="*", default=[], metavar="SPEC",
                        help="positional argument shapes, e.g. 'bf16[32,2048,16,64]' 'f32[64]'")
    parser.add_argument("--grad", action="store_true",
                        help="use jax.grad(FUNCTION), so the VJP ops are included")


def load_function(target: str, grad: bool = False) -> Callable[..., Any]:
    """`MODULE:FUNCTION` imported from the working directory first, as `python -m` would
    (the console script does not put it on `sys.path`); a one-line `SystemExit` saying
    what could not be imported and why."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"expected MODULE:FUNCTION, got {target!r}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything on import
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise SystemExit(f"cannot import {module_name!r} (from {target!r}, working directory "
                         f"{cwd}): {reason}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SystemExit(f"cannot import {target!r}: {module_name!r} "
                             f"({getattr(obj, '__file__', None) or module_name}) has no "
                             f"{attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SystemExit(f"{target} is not callable")
    return jax.grad(obj) if grad else obj


def parse_args(specs: list[str], *, symbolic: bool = False) -> list[jax.ShapeDtypeStruct]:
    """`--args` specs as `jax.ShapeDtypeStruct`s; a one-line `SystemExit` naming a bad one.
    Where `symbolic`, a dimension may be a name or an expression of names, as
    `jax.export.symbolic_shape` reads them (`'f32[b,2*t,64]'`): one name is one dimension
    in every spec."""
    named = [s for s in specs if _has_names(s)]
    if named and not symbolic:
        raise SystemExit(f"--args: {named[0][:80]!r} names a dimension: this command runs "
                         f"concrete shapes (`export` takes symbolic ones)")
    scope = jax.export.SymbolicScope()
    try:
        return [_symbolic_spec(s, scope) if s in named else spec.parse_array_spec(s)
                for s in specs]
    except spec.SpecError as e:
        raise SystemExit(f"--args: {e}") from None


def _has_names(text: str) -> bool:
    _, _, dims = text.partition("[")
    return any(character.isalpha() or character == "_" for character in dims)


def _symbolic_spec(text: str, scope: Any) -> jax.ShapeDtypeStruct:
    """`_has_names` `text` with its dimensions read by `jax.export.symbolic_shape`; its
    dtype and rank checked as a concrete spec's."""
    dtype_text, _, rest = text.replace(" ", "").partition("[")
    if not rest.endswith("]"):
        raise spec.SpecError(f"{text[:80]!r} is not an array spec like 'f32[b,2048]': its "
                             f"dimensions end with ']'")
    dims = rest.removesuffix("]")
    concrete = spec.parse_array_spec(f"{dtype_text}[{','.join('1' for _ in dims.split(','))}]")
    try:
        shape = jax.export.symbolic_shape(dims, scope=scope)
    except (ValueError, TypeError) as e:
        raise spec.SpecError(f"{text[:80]!r}: its dimensions are no symbolic shape: "
                             f"{' '.join(str(e).split())[:200]}") from None
    return jax.ShapeDtypeStruct(shape, concrete.dtype)
