"""Kinds and bounds of a config's fields, checked wherever a config enters: in code (an
op built with `config=`) and from a file (`spec.decode_config`, `spec.decode`).

A field annotated `int`, `bool` or `str` holds a value of that kind (`true`, `1.5` or
`"64"` where an int goes would reach the kernel's compiler and fail there, or never, and
a Triton warp count of `null` would be kept). A config's own class checks what its kernel
needs (multiples, powers of two, minimums); these bounds stop sizes no hardware runs,
which would otherwise be sized into memory (a chunk of 1e9 asks for hundreds of GiB)
before anything fails, and pipeline depths and warp counts no compiler takes.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

import numpy as np

# Block, chunk and tile sizes: 2**20 rows or columns is above any GPU's or TPU's
# on-chip memory for one tile and above every chunk the XLA paths use.
MAX_SIZE = 2**20
# Software pipeline depth (SMEM slots, Triton stages).
MAX_STAGES = 8
# Warps per Triton program: 1024 threads per block.
MAX_WARPS = 32

_BY_NAME = (("stages", MAX_STAGES), ("warps", MAX_WARPS))
# What a value of each checked annotation may be (a bool is no int).
_KINDS: dict[Any, tuple[type, ...]] = {
    int: (int, np.integer), bool: (bool, np.bool_), str: (str,)}


def limit_of(field_name: str) -> int:
    """The upper bound of an integer config field, by what its name says it counts."""
    for word, limit in _BY_NAME:
        if word in field_name:
            return limit
    return MAX_SIZE


@functools.cache
def _field_kinds(config_cls: type) -> dict[str, Any]:
    """Each field's annotation where it is `int`, `bool` or `str` (an annotation that does
    not resolve, or another one, is not checked)."""
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # noqa: BLE001 - any failure to evaluate an annotation
        return {}
    return {name: hint for name, hint in hints.items() if hint in _KINDS}


def check(config: Any) -> None:
    """`TypeError` naming the field for a value of another kind than its annotation's;
    `ValueError` naming the field and its limit for an integer above it, a stage or warp
    count below 1, or a warp count that is not a power of 2."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return
    kinds = _field_kinds(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name, None)
        where = f"{type(config).__name__}.{field.name}"
        hint = kinds.get(field.name)
        if hint is not None and (not isinstance(value, _KINDS[hint]) or (
                hint is int and isinstance(value, (bool, np.bool_)))):
            raise TypeError(f"{where} must be {hint.__name__}, got {value!r:.80}")
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            continue
        limit = limit_of(field.name)
        if value > limit:
            raise ValueError(f"{where}={value} is above its limit of {limit}")
        if limit != MAX_SIZE and value < 1:
            raise ValueError(f"{where}={value} must be at least 1")
        if limit == MAX_WARPS and value & (value - 1):
            raise ValueError(f"{where}={value} must be a power of 2 (Triton's warp counts)")
