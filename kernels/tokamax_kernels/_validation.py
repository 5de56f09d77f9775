"""Argument checks shared by the op families: each error names the argument and the fix."""

from __future__ import annotations

from typing import Any

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
