"""Whether a candidate's output matches the reference output of its op call."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# Allowed max error relative to the reference output's largest magnitude.
NUMERICS_RTOL = {jnp.dtype(jnp.float32): 1e-2, jnp.dtype(jnp.float64): 1e-6}
DEFAULT_NUMERICS_RTOL = 6e-2


@jax.jit
def _error_statistics(actual: jax.Array, expected: jax.Array) -> tuple[jax.Array, ...]:
    """(finite pattern differs, any finite, reference scale, max error) over finite entries.

    Reduced on the device, so checking a config moves four scalars to the host rather
    than both outputs (a large op's output is hundreds of MB).
    """
    a32, e32 = actual.astype(jnp.float32), expected.astype(jnp.float32)
    finite = jnp.isfinite(e32)
    return (jnp.any(jnp.isfinite(a32) != finite), jnp.any(finite),
            jnp.max(jnp.where(finite, jnp.abs(e32), 0.0), initial=0.0),
            jnp.max(jnp.where(finite, jnp.abs(a32 - e32), 0.0), initial=0.0))


def numerics_error(actual: Any, expected: Any) -> str | None:
    """Why `actual` does not match the reference `expected`, or `None`."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        if jnp.shape(a) != jnp.shape(e):
            return f"wrong numerics: shape {jnp.shape(a)} != reference {jnp.shape(e)}"
        differs, any_finite, scale, err = jax.device_get(_error_statistics(a, e))
        if differs:
            return "wrong numerics: non-finite values where the reference is finite (or vice versa)"
        if not any_finite:
            continue
        rtol = NUMERICS_RTOL.get(jnp.dtype(a.dtype), DEFAULT_NUMERICS_RTOL)
        scale = max(float(scale), 1e-6)
        if err > rtol * scale:
            return f"wrong numerics: max error {err:.3g} > {rtol:g} x reference scale {scale:.3g}"
    return None
