"""Cache keys and provenance: what makes two measurements interchangeable.

A measurement is keyed by the op implementation (its import path and fields,
with `config` and `vjp` stripped), the device kind and the argument spec.
Provenance records what produced it (library and jax versions, a hash of the
implementation's code) so a stale entry can be recognized and ignored. The hash covers
the code's syntax tree without docstrings: editing a comment or a docstring keeps the
entries, editing a statement stales them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import sys
from collections.abc import Mapping
from typing import Any

import jax

from tokamax_pass.core import spec
from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.core.op import Op, SizeLike
from tokamax_pass.version import __version__


def canonical_op(op: Op) -> Op:
    """The op as a cache key sees it: no pinned config, no custom VJP link."""
    return op.replace(config=None, vjp=None)


def canonical(ba: BoundArguments) -> BoundArguments:
    return ba.replace(op=canonical_op(ba.op))


def op_key(op: Op) -> str:
    return spec.dumps(spec.encode(canonical_op(op)))


def entry_key(ba: BoundArguments) -> tuple[str, str]:
    """`(op key, argument key)` of a bound call."""
    return op_key(ba.op), ba.cache_key


def library_version() -> str:
    return __version__


@functools.cache
def _module_hash(module_name: str) -> str:
    module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(module) if module is not None else module_name
    except (OSError, TypeError):
        source = module_name
    return hashlib.sha256(code_text(source).encode()).hexdigest()[:16]


def code_text(source: str) -> str:
    """`source`'s syntax tree without docstrings or positions, as text: what the code does,
    not how it is commented or laid out."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def _helper_modules(module_name: str) -> set[str]:
    """`module_name` and, transitively, the modules of its package it takes functions or
    submodules from: a kernel's implementation module and the kernel bodies it calls."""
    package = module_name.rpartition(".")[0]
    found, todo = set(), [module_name]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            source = (value.__name__ if inspect.ismodule(value)
                      else value.__module__ if inspect.isfunction(value) else None)
            if source and source.rpartition(".")[0] == package and source != "__main__":
                todo.append(source)
    return found


def _op_modules(op: Op) -> list[str]:
    """The modules whose source defines what `op` computes (nested ops and the kernel
    modules of its package that it calls included)."""
    names = sorted(_helper_modules(type(op).__module__))
    for field in dataclasses.fields(op):
        value = getattr(op, field.name)
        if isinstance(value, Op) and field.name not in ("vjp", "config"):
            names.extend(_op_modules(value))
    return names


def source_hash(op: Op) -> str:
    """A short hash of the source of the op's implementation module(s)."""
    digest = hashlib.sha256()
    for name in sorted(set(_op_modules(op))):
        digest.update(_module_hash(name).encode())
    return digest.hexdigest()[:16]


def provenance(op: Op) -> dict[str, Any]:
    return {
        "tokamax_pass": library_version(),
        "jax": jax.__version__,
        "source_hash": source_hash(op),
    }


def stale_reason(op: Op, recorded: Mapping[str, Any] | None) -> str | None:
    """Why a recorded provenance does not match this process, or `None`."""
    if not recorded:
        return "it has no provenance"
    current = provenance(op)
    for name, label in (("source_hash", "the implementation's source"),
                        ("tokamax_pass", "the tokamax_pass version"), ("jax", "the jax version")):
        if recorded.get(name) != current[name]:
            return f"{label} changed ({recorded.get(name)} -> {current[name]})"
    return None


def similarity(ba: BoundArguments) -> tuple[str, tuple[int, ...]]:
    """`(category, sizes)`: calls of one category differ only in array sizes, so a
    measurement at one stands in for its neighbours (see `cache.nearest_measured`).

    The category holds the op (config stripped), every static argument and each
    array's dtype and rank, after the op's `similarity_arguments` dropped what its speed
    does not depend on; `sizes` lists the arrays' dimensions, the `SizeLike` numbers and
    the vmap sizes.
    """
    sizes: list[int] = []

    def strip(value: Any) -> Any:
        if isinstance(value, SizeLike):
            sizes.append(value.value)
            return "size"
        if spec.is_array(value):
            sizes.extend(int(d) for d in value.shape)
            return f"{jax.numpy.dtype(value.dtype).name}[rank {len(value.shape)}]"
        if isinstance(value, (tuple, list)):
            return [strip(v) for v in value]
        if isinstance(value, dict):
            return {k: strip(v) for k, v in sorted(value.items())}
        return spec.encode(value)

    arguments = strip(ba.op.similarity_arguments(dict(ba.arguments)))
    vmap = [list(level.axes) for level in ba.vmap]
    sizes.extend(level.size for level in ba.vmap)
    category = spec.dumps({"op": op_key(ba.op), "arguments": arguments, "vmap": vmap})
    return category, tuple(sizes)
