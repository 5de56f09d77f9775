"""Shared test helpers: random inputs, dtype-aware tolerances, the H200 lowering target."""

from __future__ import annotations

import json
import math
import os

FAKE_DEVICES = 8
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _with_fake_devices(flags: str) -> str:
    """`flags` (an `XLA_FLAGS` value) with the host platform's device count set to
    `FAKE_DEVICES`, whatever it said before: the sharding tests need 8 CPU devices, and a
    `setdefault` left them out whenever `XLA_FLAGS` was already set."""
    kept = [f for f in flags.split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    return " ".join([*kept, f"{_DEVICE_COUNT_FLAG}={FAKE_DEVICES}"])


os.environ["XLA_FLAGS"] = _with_fake_devices(os.environ.get("XLA_FLAGS", ""))

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


def normal_values(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """`jax.random.normal(key, shape, float32).astype(dtype)`, value for value, from a
    compiled program that only depends on `shape`'s size class.

    With partitionable Threefry (`jax_threefry_partitionable`, JAX's default) each element
    depends on the key and its flat index alone: the first `size` values of a longer
    stream are the values at `shape`. The stream's length is the next power of two (at
    least 1024), so one compiled sampler serves every shape of a size class, where calling
    `jax.random.normal` at each new shape (and casting it eagerly) compiles new programs;
    the slice, reshape and cast run in NumPy (ml_dtypes rounds to nearest even, as XLA's
    convert does). Under a trace (inside `jit`, `vmap`, ...) it is `jax.random.normal`'s
    own call."""
    if isinstance(key, jax.core.Tracer):
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)
    size = math.prod(shape)
    length = max(1024, 1 << max(size - 1, 0).bit_length())
    stream = np.asarray(jax.random.normal(key, (length,), jnp.float32))
    return jnp.asarray(stream[:size].reshape(shape).astype(jnp.dtype(dtype)))


def random_normal(seed: int, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """Fresh random normal inputs (never zeros): `jax.random.normal(key(seed), shape)`
    cast to `dtype`."""
    return normal_values(jax.random.key(seed), shape, dtype)


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


def per_batch_element(fn, *arrays):
    """`fn(*arrays)` computed one batch element (leading axis) at a time, concatenated.

    A float32 attention reference materializes S x S logits per head: at the benchmark
    shapes one batch element fits where the whole batch may not, and every element is
    still compared (a kernel that mixes up batch elements must fail)."""
    jitted = jax.jit(fn)
    parts = [jitted(*(x[i:i + 1] for x in arrays)) for i in range(arrays[0].shape[0])]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def gpu_available() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


@pytest.fixture(autouse=True)
def user_cache_dir(tmp_path_factory, monkeypatch):
    """Every test reads and writes a fresh, empty user autotuning cache, never the real one
    (whose entries would answer `autotune` and `implementation=None` differently per machine)."""
    from tokamax_pass.autotuning import cache

    path = tmp_path_factory.mktemp("user_cache")
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(path))
    return path


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path_factory, monkeypatch):
    """Every test reads calibration files from a fresh, empty folder, never the shipped
    ones (which change what `implementation=None` predicts as they are refitted); tests
    of predictions write the files they need there."""
    from tokamax_pass.core import calibration

    path = tmp_path_factory.mktemp("calibration")
    monkeypatch.setenv(calibration.ENV_DIR, str(path))
    return path


@pytest.fixture
def rewritten(monkeypatch):
    """`optimize` keeps every rewrite candidate, though the plain path is chosen on CPU:
    a test then compares the values and gradients of the program the rewrite makes (the
    op's `xla` path and its VJP) with `jax.jit` of the user's function."""
    from tokamax_pass.passes import rewrite

    monkeypatch.setattr(rewrite, "rewrite_wins", lambda chosen: True)


@pytest.fixture
def fake_devices() -> None:
    """Fails (never skips) a test that needs `FAKE_DEVICES` devices where there are fewer."""
    if jax.device_count() < FAKE_DEVICES:
        pytest.fail(
            f"needs {FAKE_DEVICES} devices, found {jax.device_count()} "
            f"({jax.default_backend()}): conftest sets {_DEVICE_COUNT_FLAG}={FAKE_DEVICES} in "
            "XLA_FLAGS before JAX starts; on an accelerator host run with JAX_PLATFORMS=cpu")


def covering_cases(items: list, required: frozenset[str] = frozenset()) -> list:
    """Of one test function's parametrized `items`, a fixed subset in which every value
    of every `parametrize` axis (one decorator's list, by its case ids) appears at least
    once: the cases whose node ids are in `required` first, then greedily the case that
    takes the most values not yet taken, the first in collection order on ties. Ids, not
    the values themselves: every xdist worker must keep the same cases."""
    values = {id(item): set(enumerate(item.callspec._idlist)) for item in items}
    missing = set().union(*values.values())
    kept = [item for item in items if item.nodeid in required]
    for item in kept:
        missing -= values[id(item)]
    while missing:
        best = max(items, key=lambda item: len(values[id(item)] & missing))
        kept.append(best)
        missing -= values[id(best)]
    return kept


def _cases_named_by_mutations() -> frozenset[str]:
    """The test cases the mutation check runs (`tests/mutation/patches/`): a covering
    subset keeps them, so that CI runs each on the unbroken code too."""
    try:
        from mutation.mutation_patch import all_mutations
    except ImportError:  # a copy of the tests without the mutation check (Bazel's sources)
        return frozenset()
    return frozenset(test for mutation in all_mutations() for test in mutation.tests)


def cases_named_in(args: list[str], invocation_dir: str) -> frozenset[tuple[str, str]]:
    """`(file, case)` of each parametrized case the command line names one by one
    (`tests/x.py::test_f[a-b]`, the file resolved from where pytest was started): a
    covering subset keeps every one of them."""
    named = set()
    for arg in args:
        path, sep, rest = arg.partition("::")
        test, bracket, ids = rest.partition("[")  # ids may hold "::" themselves
        if sep and bracket:
            named.add((os.path.realpath(os.path.join(invocation_dir, path)),
                       test.rpartition("::")[2] + bracket + ids))
    return frozenset(named)


def items_named(items: list, named: frozenset[tuple[str, str]]) -> set[str]:
    """The node ids of `items` that `named` (`cases_named_in`) names."""
    return {item.nodeid for item in items
            if (os.path.realpath(item.path), item.name) in named}


def kept_cases(grids: list[list], variants: list[list], named: frozenset[str]) -> set[int]:
    """The `id`s of the cases CI runs: each `exhaustive` grid's covering subset, each
    `variants` function's first case, and every case whose node id is in `named`."""
    kept = set()
    for grid in grids:
        kept |= set(map(id, covering_cases(grid, named)))
    for group in variants:
        kept |= {id(group[0])} | {id(item) for item in group if item.nodeid in named}
    return kept


def _parametrized(items: list, marker: str) -> dict[tuple, list]:
    """The cases of each test function marked `marker` that are not marked slow already."""
    functions: dict[tuple, list] = {}
    for item in items:
        if (item.get_closest_marker(marker) and hasattr(item, "callspec")
                and not item.get_closest_marker("slow")):
            functions.setdefault((item.path, item.originalname), []).append(item)
    return functions


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the `slow` marks added here
def pytest_collection_modifyitems(config, items):
    grids, variants = _parametrized(items, "exhaustive"), _parametrized(items, "variants")
    cases = [item for group in (*grids.values(), *variants.values()) for item in group]
    named = _cases_named_by_mutations() if cases else frozenset()
    on_command_line = cases_named_in(config.args, str(config.invocation_params.dir))
    named |= items_named(cases, on_command_line)
    kept = kept_cases(list(grids.values()), list(variants.values()), named)
    for item in cases:
        if id(item) not in kept:
            item.add_marker(pytest.mark.slow)
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def measured(device_kind: str, times: dict, *args, vmap=(), **kwargs):
    """An `AutotuningResult` for `device_kind` timing each op of `times` (`{op: ms}`) on
    `op.bind(*args, **kwargs)` (under the `jax.vmap` levels `vmap`, as
    `BoundArguments.vmap` records them) with its heuristics config: evidence for `None`."""
    from tokamax_pass import AutotuningResult, core
    from tokamax_pass.autotuning import keys
    from tokamax_pass.autotuning.entry import Entry, Measurement

    entries = []
    for op, ms in times.items():
        bound = keys.canonical(op.bind(*args, **kwargs).replace(vmap=tuple(vmap)))
        with core.targeting(device_kind):
            config = bound.heuristics_config
        entries.append(Entry(bound, {config: Measurement((ms,))}, keys.provenance(bound.op)))
    return AutotuningResult(device_kind, entries)


def calibrate(folder, efficiencies, device_kind=H200):
    """A calibration for `device_kind` in which each op named in `efficiencies` reaches
    that efficiency everywhere (one far point: every call takes the op's median)."""
    from tokamax_pass import core
    from tokamax_pass.core import calibration

    points = [{"op": op, "dtype": dtype, "flops": 1.0, "bytes": 1.0, "efficiency": e}
              for op, e in efficiencies.items() for dtype in ("bfloat16", "float32")]
    (folder / f"{core.device.device_kind_key(device_kind)}.json").write_text(json.dumps({
        "schema": calibration.SCHEMA, "version": calibration.VERSION,
        "device_kind": device_kind,
        "ceilings": {"bf16_tflops": 700.0, "f32_tflops": 50.0, "hbm_tbps": 4.0},
        "points": points}))
