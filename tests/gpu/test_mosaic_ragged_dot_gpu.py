"""Mosaic GPU ragged dot on the H200: numerics of every variant against a float32 reference,
deterministic reruns, and (run as a script) device timings against JAX's `ragged_dot_mgpu`
and `jax.lax.ragged_dot`.

    PYTHONPATH=src:kernels python3 tests/gpu/test_mosaic_ragged_dot_gpu.py   # writes $OUT
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_kernels.ragged_dot import PallasMosaicGpuRaggedDot, ragged_dot
from tokamax_kernels.ragged_dot.pallas_mosaic_gpu import Config

try:
    import pytest
except ImportError:  # the device image may run this file as a plain script
    pytest = None

# (M, K, N, group sizes): uneven groups, an empty group, rows past the last group, tiny M.
SMALL_CASES = [
    (1000, 256, 512, (300, 0, 457, 13, 200)),
    (1024, 256, 512, (128, 0, 256, 512, 128)),
    (96, 128, 128, (40, 0, 56)),
    # Few rows a group (a decode step): 64 groups of 0-47 rows, starting off the 8-row grid.
    (1536, 256, 256, tuple(int(s) for s in np.random.RandomState(0).randint(0, 48, 64))),
]
BENCH = (16384, 4096, 4096, (2070, 2092, 2015, 2002, 2059, 2064, 2064, 2018))
# bf16 rounding of the output is ~2e-3 relative; allow a little headroom.
REL_TOL = 4e-3


def _inputs(m, k, n, sizes, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    g = len(sizes)
    lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dout = jax.random.normal(keys[2], (m, n), jnp.float32).astype(jnp.bfloat16)
    return lhs, rhs, dout, jnp.asarray(sizes, jnp.int32)


def _reference(variant, a, b, sizes):
    """float32 HIGHEST reference by explicit per-group slices (no jax.lax.ragged_dot)."""
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    dot = lambda x, y: jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    if variant == "drhs":
        out = np.zeros((len(sizes), a.shape[1], b.shape[1]), np.float32)
    else:
        cols = b.shape[2] if variant == "forward" else b.shape[1]
        out = np.zeros((a.shape[0], cols), np.float32)
    for gi in range(len(sizes)):
        rows = slice(starts[gi], starts[gi + 1])
        if variant == "forward":
            out[rows] = dot(a[rows], b[gi])
        elif variant == "dlhs":
            out[rows] = dot(a[rows], b[gi].T)
        else:
            out[gi] = dot(a[rows].T, b[rows])
    return out


def _operands(variant, lhs, rhs, dout):
    return {"forward": (lhs, rhs), "dlhs": (dout, rhs), "drhs": (lhs, dout)}[variant]


def _rel_err(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _check_variant(variant, m, k, n, sizes, config=None):
    lhs, rhs, dout, gs = _inputs(m, k, n, sizes)
    a, b = _operands(variant, lhs, rhs, dout)
    op = PallasMosaicGpuRaggedDot(config=config)
    fn = jax.jit(lambda x, y, s: op(x, y, s, variant=variant))
    out = fn(a, b, gs)
    ref = _reference(variant, a, b, sizes)
    err = _rel_err(out, ref)
    again = fn(a, b, gs)
    identical = bool(np.array_equal(np.asarray(out), np.asarray(again)))
    out32 = np.asarray(jnp.asarray(out, jnp.float32))
    exact_zero = True
    if variant == "drhs":
        exact_zero = all(not out32[gi].any() for gi, s in enumerate(sizes) if s == 0)
    elif sum(sizes) < m:
        exact_zero = not out32[sum(sizes):].any()
    return err, identical, exact_zero


if pytest is not None:
    @pytest.mark.gpu
    @pytest.mark.parametrize("variant", ["forward", "dlhs", "drhs"])
    @pytest.mark.parametrize("case", SMALL_CASES + [BENCH])
    def test_variant_matches_f32_reference(variant, case):
        err, identical, exact_zero = _check_variant(variant, *case)
        assert err <= REL_TOL, f"relative error {err:.3g}"
        assert identical, "reruns differ"
        assert exact_zero, "empty groups / rows past the groups are not zero"

    @pytest.mark.gpu
    def test_gradient_matches_f32_reference():
        m, k, n, sizes = SMALL_CASES[0]
        lhs, rhs, dout, gs = _inputs(m, k, n, sizes)
        _, vjp = jax.vjp(lambda x, w: ragged_dot(x, w, gs, implementation="mosaic"), lhs, rhs)
        dlhs, drhs = vjp(dout)
        assert _rel_err(dlhs, _reference("dlhs", dout, rhs, sizes)) <= REL_TOL
        assert _rel_err(drhs, _reference("drhs", lhs, dout, sizes)) <= REL_TOL


# ---------------------------------------------------------------------------------------------
# Script mode: one device run that checks and times everything, results to $OUT.

def _time(fn, *args, iterations=20):
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(*args))
    _, times = profiler.measure(fn, iterations=iterations)(*args)
    return statistics.median(times)


def main() -> None:
    out_dir = os.environ.get("OUT", ".")
    results: dict = {"device": jax.devices()[0].device_kind, "numerics": [], "timings": []}
    t0 = time.time()

    def save():
        with open(os.path.join(out_dir, "mosaic_ragged_dot.json"), "w") as f:
            json.dump(results, f, indent=1)

    def record(kind, **row):
        row["t"] = round(time.time() - t0, 1)
        results[kind].append(row)
        print(kind, row, flush=True)
        save()

    check = "--skip-numerics" not in sys.argv
    for case in (SMALL_CASES + [BENCH]) if check else []:
        for variant in ("forward", "dlhs", "drhs"):
            try:
                err, identical, zero = _check_variant(variant, *case)
                record("numerics", variant=variant, m=case[0], k=case[1], n=case[2],
                       sizes=list(case[3]), rel_err=err, identical=identical, zeros_ok=zero,
                       ok=err <= REL_TOL and identical and zero)
            except Exception as e:  # noqa: BLE001 (record and go on)
                record("numerics", variant=variant, m=case[0], error=repr(e)[:2000])

    m, k, n, sizes = BENCH
    flops = 2 * m * k * n
    lhs, rhs, dout, gs = _inputs(m, k, n, sizes)

    def timed(name, fn, *args, mult=1):
        try:
            ms = _time(jax.jit(fn), *args)
            record("timings", name=name, ms=ms, tflops=mult * flops / ms / 1e9)
            return ms
        except Exception as e:  # noqa: BLE001
            record("timings", name=name, error=repr(e)[:2000])
            return None

    def ours(variant, config=None):
        op = PallasMosaicGpuRaggedDot(config=config)
        return lambda x, y, s: op(x, y, s, variant=variant)

    timed("jax.lax.ragged_dot fwd", lambda x, w, s: jax.lax.ragged_dot(x, w, s), lhs, rhs, gs)
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        timed("ragged_dot_mgpu fwd (128,128,64,6,8)", lambda x, w, s: ragged_dot_mgpu.ragged_dot(
            x, w, group_sizes=s, block_m=128, block_n=128, block_k=64, max_concurrent_steps=6,
            grid_block_n=8), lhs, rhs, gs)
    except ImportError as e:
        record("timings", name="ragged_dot_mgpu", error=repr(e))
    timed("ours fwd (heuristics)", ours("forward"), lhs, rhs, gs)
    timed("ours dlhs (heuristics)", ours("dlhs"), dout, rhs, gs)
    timed("ours drhs (heuristics)", ours("drhs"), lhs, dout, gs)

    def fwd_bwd(impl):
        def f(x, w, s, dy):
            out, vjp = jax.vjp(lambda a, b: impl(a, b, s), x, w)
            return out, *vjp(dy)
        return f

    timed("ours fwd+bwd (heuristics)",
          fwd_bwd(lambda a, b, s: ragged_dot(a, b, s, implementation="mosaic")),
          lhs, rhs, gs, dout, mult=3)
    timed("jax.lax.ragged_dot fwd+bwd", fwd_bwd(jax.lax.ragged_dot), lhs, rhs, gs, dout, mult=3)

    sweep = [
        ("forward", Config(num_stages=4, grid_minor_dim=1, grid_tile_width=4)),
        ("forward", Config(num_stages=4, grid_minor_dim=1, grid_tile_width=16)),
        ("forward", Config(num_stages=4, grid_minor_dim=0, grid_tile_width=8)),
        ("forward", Config(num_stages=3, epi_n=128)),
        ("forward", Config(tile_k=128, num_stages=2)),
        ("forward", Config(tile_n=64, num_stages=6)),
        ("dlhs", Config(num_stages=4, grid_minor_dim=0, grid_tile_width=8)),
        ("dlhs", Config(num_stages=4, grid_minor_dim=1, grid_tile_width=16)),
        ("drhs", Config(num_stages=4, grid_minor_dim=0, grid_tile_width=8)),
        ("drhs", Config(num_stages=4, grid_minor_dim=1, grid_tile_width=16)),
        ("drhs", Config(tile_k=128, num_stages=2)),
        ("drhs", Config(tile_m=64, tile_n=128, num_stages=5)),
        ("forward", Config(num_stages=4, grid_minor_dim=1, grid_tile_width=2)),
        ("dlhs", Config(num_stages=3, epi_n=128)),
    ]
    numbers = [a for a in sys.argv[1:] if not a.startswith("--")]
    budget = float(numbers[0]) if numbers else 230.0
    for variant, config in sweep:
        if time.time() - t0 > budget:
            record("timings", name=f"ours {variant} {config}", error="skipped: time budget")
            continue
        args = _operands(variant, lhs, rhs, dout) + (gs,)
        timed(f"ours {variant} {config}", ours(variant, config), *args)
    save()


if __name__ == "__main__":
    main()
