"""`Candidate`: what a plain-JAX pattern makes of the code it matched."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What a pattern makes of one equation (or of the region of equations it ends):
    `function(*inputs)` computing its outputs through an op, or `None` and the `reason`
    it is left alone. `inputs`: the variables the function takes, the equation's own
    operands where `None`. `region`: the equations the function replaces, where a
    pattern records them (the gated linear unit's, whose ragged dots a grouped unit
    takes from the `ragged_dot` pattern)."""

    pattern: str
    function: Callable[..., Any] | None
    reason: str = ""
    inputs: Sequence[Any] | None = None
    region: Sequence[Any] = ()
