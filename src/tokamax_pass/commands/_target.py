"""Shared parsing for commands that take `MODULE:FUNCTION --args SPEC ...`."""

from __future__ import annotations

import argparse
import importlib
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
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"expected MODULE:FUNCTION, got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise SystemExit(f"{target} is not callable")
    return jax.grad(obj) if grad else obj


def parse_args(specs: list[str]) -> list[jax.ShapeDtypeStruct]:
    try:
        return [spec.parse_array_spec(s) for s in specs]
    except spec.SpecError as e:
        raise SystemExit(f"--args: {e}") from None
