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


def numpy_floats_as_jax(tree: Any) -> Any:
    """`tree` with its NumPy floating arrays as JAX arrays of the dtype JAX computes them in
    (float32 for NumPy's default float64 without x64), so the checks compare the dtypes JAX
    uses: a NumPy float64 array beside a JAX float32 one, or beside a `jax.grad` tracer of
    another NumPy array, was a mismatch ("query, key and value must share a dtype, got
    float32, float64, float64" for three NumPy arrays)."""
    def canonical(x: Any) -> Any:
        if isinstance(x, np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x)
        return x

    return jax.tree.map(canonical, tree)


def sub_byte_integers_as_int32(value: Any) -> Any:
    """`value` as int32 where it is an array of a sub-byte integer dtype (int2, int4,
    uint4, ...), else as it is. JAX promotes those with no other dtype ("1-bit, 2-bit and
    4-bit integers do not support implicit promotion"), so an int4 length or index array
    failed deep inside an op with a `TypePromotionError` naming no argument; int32 holds
    every value they can, so the cast changes none."""
    dtype = getattr(value, "dtype", None)
    try:
        narrow = (dtype is not None and jnp.issubdtype(dtype, jnp.integer)
                  and jnp.iinfo(dtype).bits < 8)
    except TypeError:  # not a NumPy/JAX dtype (a PRNG key's): the op's checks name it
        return value
    if not narrow:
        return value
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(value.shape, jnp.int32, sharding=value.sharding)
    return value.astype(jnp.int32)


def require_rank(name: str, value: Any, ranks: tuple[int, ...] | range, *, op: str) -> None:
    require_array(name, value, op=op)
    if value.ndim not in ranks:
        expected = " or ".join(str(r) for r in ranks) if isinstance(ranks, tuple) else (
            f"at least {ranks.start}"
        )
        raise ValueError(f"{op}: {name} must have rank {expected}, got shape {tuple(value.shape)}")


def require_float(name: str, value: Any, *, op: str) -> None:
    require_array(name, value, op=op)
    # `value.dtype` as it is: `jnp.dtype` of a PRNG key array's dtype raised a TypeError
    # ("Cannot interpret 'key<fry>' as a data type") that did not name the argument.
    if value.dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise ValueError(
            f"{op}: {name} must be a floating-point array (f16, bf16, f32, f64), got {value.dtype}"
        )


def require_shape(name: str, value: Any, shape: tuple[int, ...], *, op: str, why: str) -> None:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{op}: {name} must have shape {tuple(shape)} ({why}), got {tuple(value.shape)}"
        )


def reject_traced(name: str, value: Any, *, op: str) -> None:
    """`ValueError` for a static argument (one that chooses the program: a flag, an axis,
    a number) holding a traced value, saying how to keep it static: `jax.jit(op)(...,
    is_causal=True)` traces keyword arguments too, and the checks of the value itself said
    that `True` "must be True or False"."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(value)):
        raise ValueError(
            f"{op}: {name} is a static argument and cannot be a traced value, got {value!r}: "
            f"pass a Python value, not a jit argument (jax.jit traces keyword arguments too: "
            f"list {name!r} in static_argnames, or bind it with functools.partial)")


def canonical_axis(axis: int, ndim: int, *, op: str, name: str = "axis") -> int:
    reject_traced(name, axis, op=op)
    if isinstance(axis, np.integer):
        axis = int(axis)
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ValueError(f"{op}: {name} must be an integer, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{op}: {name}={axis!r} is out of range for an array of rank {ndim}")
    return axis % ndim


def require_bool(name: str, value: Any, *, op: str) -> bool:
    """`value` as a Python bool; `ValueError` for a traced one (`reject_traced`),
    `TypeError` for anything else (`bool("no")` is True)."""
    reject_traced(name, value, op=op)
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be True or False, got {value!r}")
    return bool(value)


def static_number(name: str, value: Any, *, op: str, minimum: float | None,
                  inclusive: bool = False) -> float:
    """`value` as a finite Python float above `minimum` (or equal, if `inclusive`; any
    finite number if `minimum` is `None`).

    A static argument: a Python or NumPy number, or a concrete scalar array; a traced
    value cannot choose the program (`reject_traced`), and NaN or infinity would silently
    give NaN or degenerate outputs.
    """
    reject_traced(name, value, op=op)
    real = isinstance(value, (int, float, np.integer, np.floating)) or (
        isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0
        and jnp.issubdtype(value.dtype, jnp.floating))
    if isinstance(value, (bool, np.bool_)) or not real:
        raise ValueError(f"{op}: {name} must be a real number, got {value!r}")
    number = float(value)
    if minimum is None:
        bound, in_range = "", True
    else:
        bound = f" >= {minimum:g}" if inclusive else f" > {minimum:g}"
        in_range = number >= minimum if inclusive else number > minimum
    if not (math.isfinite(number) and in_range):
        raise ValueError(f"{op}: {name} must be a finite number{bound}, got {value!r}")
    return number


def require_sizes_dtype_holds(name: str, sizes: Any, rows: int, *, op: str,
                              rows_of: str) -> None:
    """A group-size dtype that can count all `rows`: `jax.lax.ragged_dot` sums the sizes
    in their own dtype, so int8 sizes over 128+ rows wrapped and silently put rows in the
    wrong groups. Checked from the dtype alone, so traced sizes are covered too; a symbolic
    row count (`jax.export`) asks for a dtype that counts any int32 number of rows."""
    largest = int(jnp.iinfo(sizes.dtype).max)
    if not isinstance(rows, (int, np.integer)):
        rows = int(jnp.iinfo(jnp.int32).max)
    if largest < rows:
        raise ValueError(
            f"{op}: {name} of dtype {sizes.dtype} (at most {largest}) cannot count the "
            f"{rows} rows of {rows_of}: their running sum would wrap and put rows in the "
            f"wrong groups; pass {name}.astype(jnp.int32)")
