"""Upstream Tokamax's autotuning entry points: `AutotuningResult.data`,
`BoundArguments.args`/`.kwargs`/`.autotune()`, `Op.get_autotuning_cache`,
`Autotuner.autotune`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from conftest import H200, assert_close, measured, random_normal
from tokamax_kernels.layer_norm import LayerNorm
from tokamax_kernels.linear_softmax_cross_entropy_loss import (
    XlaChunkedLinearSoftmaxCrossEntropyLoss,
    XlaChunkedLossConfig,
)
from tokamax_pass.autotuning import Autotuner
from tokamax_pass.autotuning.result import Measurement
from tokamax_pass.benchmarking import BenchmarkData


def _layer_norm_reference(x, scale, offset, epsilon=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + epsilon) * scale + offset


def test_bound_arguments_args_and_kwargs_repeat_the_call():
    x, scale, offset = random_normal(0, (2, 5, 16)), random_normal(1, (16,)), random_normal(
        2, (16,))
    ba = LayerNorm().bind(x, scale, offset, epsilon=1e-5)
    assert [a.shape for a in ba.args] == [(2, 5, 16), (16,), (16,)]
    assert ba.kwargs["epsilon"] == 1e-5 and ba.kwargs["axis"] == 2
    assert_close(ba.op(*ba.args, **ba.kwargs), _layer_norm_reference(x, scale, offset, 1e-5))


def test_autotuning_result_data_pairs_bound_arguments_with_measurements():
    x = random_normal(3, (2, 8, 16))
    result = measured(H200, {LayerNorm(): 0.25}, x, None, None)
    ((ba, data),) = result.data
    assert isinstance(ba, tokamax.BoundArguments) and ba.args[0].shape == (2, 8, 16)
    ((config, measurement),) = data.items()
    assert isinstance(measurement, Measurement) and measurement.median_ms == 0.25


def test_bound_arguments_autotune_measures_and_caches():
    op = XlaChunkedLinearSoftmaxCrossEntropyLoss()
    x, weights = random_normal(4, (2, 12, 16)), random_normal(5, (16, 40))
    labels = jax.random.randint(jax.random.key(6), (2, 12), 0, 40)
    ba = op.bind(x, labels, weights)
    configs = [XlaChunkedLossConfig(8, 16), XlaChunkedLossConfig(24, 40)]
    assert op.get_autotuning_cache() == {}
    data = ba.autotune(configs, autotuner=Autotuner(iterations=2, method="wallclock"))
    assert set(data) == set(configs)
    assert all(m.ok and len(m.evaluation_times_ms) >= 1 for m in data.values())
    cached = op.get_autotuning_cache()
    assert len(cached) == 1
    (cached_data,) = cached.values()
    assert set(cached_data) == set(configs)
    assert XlaChunkedLinearSoftmaxCrossEntropyLoss(
        config=configs[0]).get_autotuning_cache() == cached  # pinned configs aside
    assert LayerNorm().get_autotuning_cache() == {}


def test_bound_arguments_autotune_without_caching_leaves_the_cache():
    op = XlaChunkedLinearSoftmaxCrossEntropyLoss()
    x, weights = random_normal(7, (2, 6, 16)), random_normal(8, (16, 24))
    labels = jax.random.randint(jax.random.key(9), (2, 6), 0, 24)
    data = op.bind(x, labels, weights).autotune(
        [XlaChunkedLossConfig(6, 8)], autotuner=Autotuner(iterations=1, method="wallclock"),
        cache_results=False)
    assert list(data) == [XlaChunkedLossConfig(6, 8)]
    assert op.get_autotuning_cache() == {}


def test_autotuner_autotune_times_each_config_of_a_factory():
    x = jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)
    w = random_normal(10, (16, 16))

    def factory(power):
        if power < 0:
            raise ValueError("no negative powers")
        return lambda x, w: jnp.tanh(x @ w) ** power

    tuner = Autotuner(iterations=2, method="wallclock")
    results = tuner.autotune(factory, [1, 2, -1], x, w=w)
    assert list(results) == [1, 2, -1]
    assert all(isinstance(results[c], BenchmarkData) for c in (1, 2))
    assert isinstance(results[-1], ValueError)
    timed_out = tuner.autotune(factory, [1, 2], x, w=w, timeout=0)
    assert all(isinstance(r, TimeoutError) for r in timed_out.values())


def test_autotuner_autotune_rejects_a_bad_autotuner_argument():
    x = random_normal(11, (2, 4, 8))
    with pytest.raises(TypeError, match="Autotuner"):
        LayerNorm().bind(x).autotune(autotuner="fast")


def test_dumps_prunes_errors_and_names_the_version_as_upstream():
    from tokamax_pass.autotuning import keys
    from tokamax_pass.autotuning.result import AutotuningResult, Entry

    op = XlaChunkedLinearSoftmaxCrossEntropyLoss()
    x, weights = random_normal(12, (2, 6, 16)), random_normal(13, (16, 24))
    labels = jax.random.randint(jax.random.key(14), (2, 6), 0, 24)
    ba = keys.canonical(op.bind(x, labels, weights))
    good, bad = XlaChunkedLossConfig(6, 8), XlaChunkedLossConfig(12, 24)
    entry = Entry(ba, {good: Measurement((0.5,)), bad: Measurement(error="failed to compile")},
                  keys.provenance(op))
    result = AutotuningResult(H200, [entry])
    assert result.tokamax_version == result.tokamax_pass_version == tokamax.__version__
    (all_data,) = [d for _, d in AutotuningResult.loads(result.dumps())]
    (pruned,) = [d for _, d in AutotuningResult.loads(result.dumps(prune_errors=True))]
    assert set(all_data) == {good, bad} and set(pruned) == {good}


def test_bound_args_from_json_file_reads_what_bound_args_to_json_wrote(tmp_path):
    from tokamax_pass.autotuning import bound_args_from_json_file, bound_args_to_json

    ba = LayerNorm().bind(random_normal(15, (2, 3, 8)))
    path = tmp_path / "calls.json"
    bound_args_to_json([ba], path)
    (read,) = bound_args_from_json_file(path)
    assert read.cache_key == ba.cache_key and type(read.op) is LayerNorm
    with pytest.raises(TypeError, match="path"):
        bound_args_from_json_file(open(path))  # noqa: SIM115 - a file is the wrong type


def test_autotune_takes_progress_bar(capsys):
    op = XlaChunkedLinearSoftmaxCrossEntropyLoss()
    x, weights = random_normal(16, (2, 6, 16)), random_normal(17, (16, 24))
    labels = jax.random.randint(jax.random.key(18), (2, 6), 0, 24)
    result = tokamax.autotune([op.bind(x, labels, weights)], progress_bar=False, max_configs=1,
                              iterations=1, method="wallclock")
    assert len(result) == 1
    assert "%|" not in capsys.readouterr().err
    tokamax.autotune([op.bind(x, labels, weights)], progress_bar=True, max_configs=1,
                     iterations=1, method="wallclock", ignore_cache=True)
    assert "%|" in capsys.readouterr().err


def test_benchmark_reads_upstreams_xprof_as_the_profiler():
    data = tokamax.benchmark(lambda x: jnp.sin(x) @ x.T, random_normal(19, (2, 64)),
                             method="xprof", iterations=1)
    assert data.method == "profiler" and data.metadata == {"method": "profiler"}
