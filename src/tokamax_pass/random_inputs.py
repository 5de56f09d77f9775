"""Random inputs for timing: arrays made for the abstract arguments of a call
(`jax.ShapeDtypeStruct`s), all of them by one compiled program."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def random_array(key: jax.Array | int, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A random array: normal floats, ints in [0, 128), fair bools (never all zeros).
    `key`: a `jax.random.key`, or an int seed."""
    if isinstance(key, int) and not isinstance(key, bool):
        key = jax.random.key(key)
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)
    if dtype == jnp.bool_:
        return jax.random.bernoulli(key, 0.5, shape)
    if jnp.issubdtype(dtype, jnp.integer):
        high = min(128, int(jnp.iinfo(dtype).max) + 1)
        return jax.random.randint(key, shape, 0, high, jnp.int32).astype(dtype)
    raise ValueError(f"cannot make random inputs of dtype {dtype}")


# Where a random array goes: its position among the arrays, its shape and dtype name.
_Slot = tuple[int, tuple[int, ...], str]


def _abstract_slots(arrays: Sequence[Any]) -> tuple[_Slot, ...]:
    slots = tuple((i, a) for i, a in enumerate(arrays) if isinstance(a, jax.ShapeDtypeStruct))
    for i, a in slots:
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            raise ValueError(
                f"standardize_function: array argument {i} is a jax.ShapeDtypeStruct of PRNG "
                f"keys ({a.dtype}); random inputs are made for numbers only: pass real keys "
                f"(jax.random.split(jax.random.key(0), n))")
        if any(isinstance(d, int) and d < 0 for d in a.shape):
            # jax.ShapeDtypeStruct takes it; XLA failed with "invalid tensor dimension size".
            raise ValueError(
                f"standardize_function: array argument {i} is a jax.ShapeDtypeStruct of "
                f"shape {tuple(a.shape)}; dimensions must be >= 0")
    return tuple((i, tuple(a.shape), jnp.dtype(a.dtype).name) for i, a in slots)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _random_leaves(slots: tuple[_Slot, ...], count: int, seed: jax.Array) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(seed), max(count, 1))
    return [random_array(keys[i], shape, dtype) for i, shape, dtype in slots]


def random_initialize(arrays: Sequence[Any], seed: int,
                      program: Callable[[int], list[Any]] | None = None) -> list[Any]:
    """Concrete arrays stay as given; abstract ones (`ShapeDtypeStruct`) become random.

    All of them come from one compiled program (`program`, from
    `compile_random_initialize`, where it was compiled ahead): made one array at a time,
    each shape and dtype compiled programs of its own, and an autotuner preparing a
    wave's inputs while candidates compiled waited seconds on them.
    """
    slots = _abstract_slots(arrays)
    if not slots:
        return list(arrays)
    made = iter((program or functools.partial(_random_leaves, slots, len(arrays)))(seed))
    return [next(made) if isinstance(a, jax.ShapeDtypeStruct) else a for a in arrays]


def compile_random_initialize(arrays: Sequence[Any], seed: int) -> Callable[[int], list[Any]]:
    """`random_initialize`'s program for these arrays, compiled now (no device work), to
    pass it as `program`."""
    return _random_leaves.lower(_abstract_slots(arrays), len(arrays), seed).compile()
