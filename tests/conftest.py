"""Shared test helpers: random inputs, dtype-aware tolerances, the H200 lowering target."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Relative tolerance (to the reference's scale) by the dtype the op computes in.
TOLERANCE = {
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.bfloat16): 2e-2,
    jnp.dtype(jnp.float16): 5e-3,
}

H200 = "NVIDIA H200"


def random_normal(seed: int, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """Fresh random normal inputs (never zeros)."""
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def assert_close(actual, expected, dtype=None, *, scale_rtol: float | None = None) -> None:
    """`actual` matches `expected` within the dtype's tolerance relative to `expected`'s scale."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    dtype = jnp.dtype(dtype or jnp.float32)
    rtol = scale_rtol if scale_rtol is not None else TOLERANCE[dtype]
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    err = float(np.max(np.abs(actual - expected)))
    assert err <= rtol * scale, f"max abs error {err:.3g} > {rtol:g} * scale {scale:.3g}"


def reference_precision():
    """Context for float32 references at HIGHEST matmul precision."""
    return jax.default_matmul_precision("highest")


def gpu_available() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def measured(device_kind: str, times: dict, *args, **kwargs):
    """An `AutotuningResult` for `device_kind` timing each op of `times` (`{op: ms}`) on
    `op.bind(*args, **kwargs)` with its heuristics config: evidence for `None` to act on."""
    from tokamax_pass import AutotuningResult, core
    from tokamax_pass.autotuning import keys
    from tokamax_pass.autotuning.result import Entry, Measurement

    entries = []
    for op, ms in times.items():
        bound = keys.canonical(op.bind(*args, **kwargs))
        with core.targeting(device_kind):
            config = bound.heuristics_config
        entries.append(Entry(bound, {config: Measurement((ms,))}, keys.provenance(bound.op)))
    return AutotuningResult(device_kind, entries)
