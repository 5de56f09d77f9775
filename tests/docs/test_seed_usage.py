"""The snippets of the two Tokamax user documents (`shared/seed-usage.md`), as written.

Only `import tokamax` reads `import tokamax_pass as tokamax`, shapes are scaled down
for CPU, and the GPU-only implementations (`triton`, `mosaic`) raise
`NotImplementedError` here, as the documents say they must where they cannot run.
Every test runs with an empty temporary user cache (the conftest's `user_cache_dir`), so
`autotune` must measure each op call itself; the tests check what it returned.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

import tokamax_pass as tokamax
from conftest import assert_close


def loss(x, scale):
    x = tokamax.layer_norm(
        x, scale=scale, offset=None, implementation="triton"
    )
    x = tokamax.dot_product_attention(x, x, x, implementation="xla_chunked")
    x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=None)
    x = tokamax.dot_product_attention(x, x, x, implementation="mosaic")
    return jnp.sum(x)


def cpu_loss(x, scale):
    """`loss` with the GPU-only implementations replaced by `None` (what runs on CPU)."""
    x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=None)
    x = tokamax.dot_product_attention(x, x, x, implementation="xla_chunked")
    x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=None)
    x = tokamax.dot_product_attention(x, x, x, implementation=None)
    return jnp.sum(x)


def tuned_calls(result: tokamax.AutotuningResult) -> dict[str, list]:
    """`{op class name: [Entry, ...]}` of `result`; every entry has a working config."""
    calls: dict[str, list] = {}
    for entry in result.entries:
        assert entry.fastest is not None, f"every config failed: {entry}"
        assert entry.best_time_ms > 0
        calls.setdefault(type(entry.bound.op).__name__, []).append(entry)
    return calls


def seed_inputs():
    channels, seq_len, batch_size, num_heads = (16, 64, 2, 2)  # (64, 2048, 32, 16) on a GPU
    scale = jax.random.normal(jax.random.key(0), (channels,), dtype=jnp.float32)
    x = jax.random.normal(
        jax.random.key(1),
        (batch_size, seq_len, num_heads, channels),
        dtype=jnp.bfloat16,
    )
    return x, scale


def test_document_1_gpu_implementations_raise_on_cpu():
    x, scale = seed_inputs()
    f_grad = jax.jit(jax.grad(loss))
    with pytest.raises(NotImplementedError, match="cuda"):
        f_grad(x, scale)


def test_document_1_gradient_autotuning_serialization_and_benchmarking():
    x, scale = seed_inputs()
    f_grad = jax.jit(jax.grad(cpu_loss))
    out = f_grad(x, scale)

    autotune_result: tokamax.AutotuningResult = tokamax.autotune(f_grad, x, scale)
    # The tunable calls of the gradient: the chunked attention forward and its VJP.
    calls = tuned_calls(autotune_result)
    assert set(calls) == {"XlaChunkedDotProductAttention", "XlaChunkedDotProductAttentionVjp"}
    for (entry,) in calls.values():
        assert entry.bound.arguments["query"].shape == x.shape
    with autotune_result:
        out_autotuned = f_grad(x, scale)
    assert_close(out_autotuned, out, jnp.bfloat16)

    autotune_result_json: str = autotune_result.dumps()
    autotune_result = tokamax.AutotuningResult.loads(autotune_result_json)
    assert autotune_result.dumps() == autotune_result_json
    assert set(tuned_calls(autotune_result)) == set(calls)

    f_grad_exported = export.export(f_grad, disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(scale.shape, scale.dtype),
    )
    assert_close(f_grad_exported.call(x, scale), out, jnp.bfloat16)

    f = cpu_loss
    f_std, args = tokamax.benchmarking.standardize_function(f, kwargs={'x': x, 'scale': scale})
    run = tokamax.benchmarking.compile_benchmark(f_std, args)
    bench: tokamax.benchmarking.BenchmarkData = run(args)
    assert bench.median_evaluation_time_ms > 0
    assert len(run(args, iterations=10).evaluation_times_ms) == 10
    with pytest.raises(ValueError, match="cupti"):
        run(args, method='cupti')


def test_document_2_callable_with_keyword_arguments():
    x, scale = seed_inputs()
    args = {"x": x, "scale": scale}
    f = jax.jit(cpu_loss)
    autotune_result: tokamax.AutotuningResult = tokamax.autotune(f, **args)
    (entry,) = tuned_calls(autotune_result)["XlaChunkedDotProductAttention"]
    assert entry.bound.arguments["query"].shape == x.shape
    assert set(tuned_calls(autotune_result)) == {"XlaChunkedDotProductAttention"}
    with autotune_result:
        out_autotuned = f(**args)
    assert_close(out_autotuned, cpu_loss(**args), jnp.bfloat16)


def test_document_2_bound_arguments_and_merging(tmp_path):
    x = jax.random.normal(jax.random.key(2), (64, 16), jnp.float32)
    y = jax.random.normal(jax.random.key(3), (4, 16, 8), jnp.float32)
    group = jnp.asarray([10, 0, 30, 24], jnp.int32)
    q = jax.random.normal(jax.random.key(4), (1, 128, 2, 16), jnp.float32)
    k, v = q + 1, q - 1
    # The documents bind TPU classes; these are the implementations that run on CPU.
    ragged_dot_ba = tokamax.RaggedDot.bind(x, y, group)
    attention_ba = tokamax.XlaChunkedDotProductAttention.bind(q, k, v)

    autotune_result: tokamax.AutotuningResult = tokamax.autotune(
        [ragged_dot_ba, attention_ba], all_implementations=True)
    # Every implementation that runs here, of both families: ragged dot's one (XLA) and
    # attention's XLA and chunked ones.
    assert set(tuned_calls(autotune_result)) == {
        "RaggedDot", "DotProductAttention", "XlaChunkedDotProductAttention"}
    with autotune_result:
        out = jax.jit(lambda q, k, v: tokamax.dot_product_attention(q, k, v))(q, k, v)
    assert_close(out, tokamax.dot_product_attention(q, k, v, implementation="xla"))

    path_to_file_1, path_to_file_2 = tmp_path / "1.json", tmp_path / "2.json"
    autotune_result.dump(path_to_file_1)
    tokamax.autotune([attention_ba]).dump(str(path_to_file_2))
    autotune_result_1 = tokamax.AutotuningResult.load(path_to_file_1)
    autotune_result_2 = tokamax.AutotuningResult.load(path_to_file_2)
    assert set(tuned_calls(autotune_result_2)) == {"XlaChunkedDotProductAttention"}
    merged_results = autotune_result_1 | autotune_result_2
    with merged_results:
        assert_close(tokamax.ragged_dot(x, y, group), jax.lax.ragged_dot(
            x, y, group, precision=jax.lax.Precision.HIGHEST))
