"""Benchmarking on CPU: the seed snippet, every mode and method, the cupti error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from tokamax_pass import benchmarking


def _loss(x, scale):
    return jnp.sum(tokamax.layer_norm(x, scale=scale, offset=None) ** 2)


def _inputs():
    return random_normal(0, (4, 32, 2, 16), jnp.bfloat16), random_normal(1, (16,))


def test_seed_document_benchmarking_snippet():
    x, scale = _inputs()
    f = jax.grad(_loss)
    f_std, args = tokamax.benchmarking.standardize_function(f, kwargs={'x': x, 'scale': scale})
    run = tokamax.benchmarking.compile_benchmark(f_std, args)
    bench: tokamax.benchmarking.BenchmarkData = run(args)
    assert bench.method in ("profiler", "wallclock")
    assert len(bench.evaluation_times_ms) == benchmarking.DEFAULT_ITERATIONS
    assert all(t > 0 for t in bench.evaluation_times_ms)
    assert bench.lower_time_ms > 0 and bench.compile_time_ms > 0 and bench.peak_memory_mb > 0
    assert bench.temp_memory_mb >= 0
    assert min(bench.evaluation_times_ms) <= bench.median_evaluation_time_ms
    assert len(run(args, iterations=10).evaluation_times_ms) == 10
    assert_close(jax.jit(f_std)(args), f(x, scale), jnp.bfloat16)


@pytest.mark.parametrize("method", ["profiler", "wallclock"])
def test_cpu_methods(method):
    x = random_normal(0, (128, 128))
    f_std, args = benchmarking.standardize_function(lambda x: jnp.tanh(x @ x), x)
    bench = benchmarking.compile_benchmark(f_std, args)(args, method=method, iterations=3)
    assert bench.method == method and len(bench.evaluation_times_ms) == 3
    assert all(0 < t < 1e4 for t in bench.evaluation_times_ms)


def test_cupti_on_cpu_is_a_clear_error_and_unknown_methods_are_rejected():
    f_std, args = benchmarking.standardize_function(jnp.sin, random_normal(0, (8,)))
    run = benchmarking.compile_benchmark(f_std, args)
    with pytest.raises(ValueError, match="method='cupti'.*on cpu.*method=None"):
        run(args, method="cupti")
    with pytest.raises(ValueError, match="method must be one of"):
        run(args, method="stopwatch")
    with pytest.raises(ValueError, match="iterations"):
        run(args, iterations=0)


def test_abstract_inputs_become_random_normal_and_statics_are_baked_in():
    f = lambda x, n, *, power: jnp.sum(x ** power) * n
    f_std, args = benchmarking.standardize_function(
        f, jax.ShapeDtypeStruct((64,), jnp.float32), 3, kwargs={"power": 2})
    [x] = args
    assert x.shape == (64,) and float(jnp.std(x)) > 0.5 and not bool(jnp.any(x == 0))
    assert_close(f_std(args), 3 * jnp.sum(x ** 2))
    f_std, args = benchmarking.standardize_function(
        f, jax.ShapeDtypeStruct((64,), jnp.float32), 3, kwargs={"power": 2}, seed=None)
    assert isinstance(args[0], jax.ShapeDtypeStruct)


def test_random_array_takes_a_key_or_an_int_seed():
    from_seed = benchmarking.random_array(3, (128,), jnp.bfloat16)
    from_key = benchmarking.random_array(jax.random.key(3), (128,), jnp.bfloat16)
    assert from_seed.dtype == jnp.bfloat16 and bool(jnp.all(from_seed == from_key))
    assert float(jnp.std(from_seed.astype(jnp.float32))) > 0.5


def test_vjp_modes_compute_gradients():
    x, scale = _inputs()
    f_std, args = benchmarking.standardize_function(_loss, x, scale, mode="forward_and_vjp")
    out, (grads,) = jax.jit(f_std)(args)
    expected = jax.vjp(_loss, x, scale)[1](out)
    assert_close(grads[0], expected[0], jnp.bfloat16)
    assert_close(grads[1], expected[1], jnp.bfloat16)
    # The cotangent is the output behind a barrier: XLA may not fuse the backward with
    # the expression that made it (no training step could).
    assert "optimization_barrier" in jax.jit(f_std).lower(args).as_text()
    f_std, args = benchmarking.standardize_function(_loss, x, scale, mode="vjp")
    dout = args[-1]
    grads = jax.jit(f_std)(args)
    expected = jax.vjp(_loss, x, scale)[1](dout)
    assert_close(grads[0], expected[0], jnp.bfloat16)
    bench = benchmarking.compile_benchmark(f_std, args)(args, iterations=2)
    assert len(bench.evaluation_times_ms) == 2
    with pytest.raises(ValueError, match="mode must be"):
        benchmarking.standardize_function(_loss, x, scale, mode="backward")
