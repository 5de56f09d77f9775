"""Argument checks shared by the op families: each error names the argument and the fix."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_pass.core import spec

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def require_array(name: str, value: Any, *, op: str) -> None:
    if not spec.is_array(value):
        raise ValueError(f"{op}: {name} must be an array, got {type(value).__name__}")


def require_rank(name: str, value: Any, ranks: tuple[int, ...] | range, *, op: str) -> None:
    require_array(name, value, op=op)
    if value.ndim not in ranks:
        expected = " or ".join(str(r) for r in ranks) if isinstance(ranks, tuple) else (
            f"at least {ranks.start}"
        )
        raise ValueError(f"{op}: {name} must have rank {expected}, got shape {tuple(value.shape)}")


def require_float(name: str, value: Any, *, op: str) -> None:
    require_array(name, value, op=op)
    if jnp.dtype(value.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise ValueError(
            f"{op}: {name} must be a floating-point array (f16, bf16, f32, f64), got {value.dtype}"
        )


def require_shape(name: str, value: Any, shape: tuple[int, ...], *, op: str, why: str) -> None:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{op}: {name} must have shape {tuple(shape)} ({why}), got {tuple(value.shape)}"
        )


def canonical_axis(axis: int, ndim: int, *, op: str, name: str = "axis") -> int:
    if isinstance(axis, np.integer):
        axis = int(axis)
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ValueError(f"{op}: {name} must be an integer, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{op}: {name}={axis!r} is out of range for an array of rank {ndim}")
    return axis % ndim


def require_bool(name: str, value: Any, *, op: str) -> bool:
    """`value` as a Python bool; `TypeError` for anything else (`bool("no")` is True, and a
    traced flag cannot choose the program)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be True or False, got {value!r}")
    return bool(value)


def static_number(name: str, value: Any, *, op: str, minimum: float,
                  inclusive: bool) -> float:
    """`value` as a finite Python float above `minimum` (or equal, if `inclusive`).

    A static argument: a Python or NumPy number, or a concrete scalar array; a traced
    value cannot choose the program, and NaN or infinity would silently give NaN or
    degenerate outputs.
    """
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{op}: {name} is a static argument and cannot be a traced value "
                         f"(pass a Python number, not a jit argument), got {value!r}")
    real = isinstance(value, (int, float, np.integer, np.floating)) or (
        isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0
        and jnp.issubdtype(value.dtype, jnp.floating))
    if isinstance(value, (bool, np.bool_)) or not real:
        raise ValueError(f"{op}: {name} must be a real number, got {value!r}")
    number = float(value)
    in_range = number >= minimum if inclusive else number > minimum
    if not (math.isfinite(number) and in_range):
        bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
        raise ValueError(f"{op}: {name} must be a finite number {bound}, got {value!r}")
    return number


def require_sizes_dtype_holds(name: str, sizes: Any, rows: int, *, op: str,
                              rows_of: str) -> None:
    """A group-size dtype that can count all `rows`: `jax.lax.ragged_dot` sums the sizes
    in their own dtype, so int8 sizes over 128+ rows wrapped and silently put rows in the
    wrong groups. Checked from the dtype alone, so traced sizes are covered too."""
    largest = int(jnp.iinfo(sizes.dtype).max)
    if largest < rows:
        raise ValueError(
            f"{op}: {name} of dtype {sizes.dtype} (at most {largest}) cannot count the "
            f"{rows} rows of {rows_of}: their running sum would wrap and put rows in the "
            f"wrong groups; pass {name}.astype(jnp.int32)")
