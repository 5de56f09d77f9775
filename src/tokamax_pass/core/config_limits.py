"""Upper bounds on a config's integer fields, checked wherever a config enters: in code
(an op built with `config=`) and from a file (`spec.decode_config`, `spec.decode`).

A config's own class checks what its kernel needs (multiples, powers of two, minimums);
these bounds stop sizes no hardware runs, which would otherwise be sized into memory
(a chunk of 1e9 asks for hundreds of GiB) before anything fails.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Block, chunk and tile sizes: 2**20 rows or columns is above any GPU's or TPU's
# on-chip memory for one tile and above every chunk the XLA paths use.
MAX_SIZE = 2**20
# Software pipeline depth (SMEM slots, Triton stages).
MAX_STAGES = 8
# Warps per Triton program: 1024 threads per block.
MAX_WARPS = 32

_BY_NAME = (("stages", MAX_STAGES), ("warps", MAX_WARPS))


def limit_of(field_name: str) -> int:
    """The upper bound of an integer config field, by what its name says it counts."""
    for word, limit in _BY_NAME:
        if word in field_name:
            return limit
    return MAX_SIZE


def check(config: Any) -> None:
    """`ValueError` naming the field and its limit for an integer field above it."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return
    for field in dataclasses.fields(config):
        value = getattr(config, field.name, None)
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        limit = limit_of(field.name)
        if value > limit:
            raise ValueError(f"{type(config).__name__}.{field.name}={value} is above its "
                             f"limit of {limit}")
