"""Checks in upstream Tokamax's terms, for the compatibility suite.

Upstream's tests compare with `chex.assert_trees_all_close` (elementwise
`|actual - expected| <= atol + rtol * |expected|`, on every leaf of a tree) and
draw their inputs from seeded random normals; these helpers do the same here, so a
case ported from upstream keeps upstream's shapes and tolerances.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import normal_values

# `implementation=None` runs the XLA path on CPU, as `"xla"` does: its cases repeat the
# `"xla"` ones there and run with the slow set (`pytest -m slow`).
NONE_ON_CPU = pytest.param(None, marks=pytest.mark.slow)


def assert_trees_all_close(actual, expected, *, atol: float = 1e-6, rtol: float = 1e-6) -> None:
    """Every leaf of `actual` within `atol + rtol * |expected|` of `expected`'s (chex's rule)."""
    actual_leaves, actual_tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert actual_tree == expected_tree, (actual_tree, expected_tree)
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        a = np.asarray(jnp.asarray(a, jnp.float32))
        e = np.asarray(jnp.asarray(e, jnp.float32))
        np.testing.assert_allclose(a, e, atol=atol, rtol=rtol)


def random_arrays(seed: int, *shapes_and_dtypes) -> list[jax.Array]:
    """One random array per `(shape, dtype)`: normal for floats, fair coin for bools."""
    keys = jax.random.split(jax.random.key(seed), len(shapes_and_dtypes))
    arrays = []
    for key, (shape, dtype) in zip(keys, shapes_and_dtypes, strict=True):
        if jnp.dtype(dtype) == jnp.bool_:
            arrays.append(jax.random.bernoulli(key, shape=shape))
        else:
            arrays.append(normal_values(key, shape, dtype))
    return arrays


def as_float32(tree):
    """`tree` with its floating arrays in (at least) float32: upstream's reference inputs."""
    def cast(x):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(jnp.promote_types(x.dtype, jnp.float32))
        return x
    return jax.tree.map(cast, tree)
