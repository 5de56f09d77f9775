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
from tokamax_pass.autotuning.entry import Measurement
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


def test_args_and_kwargs_repeat_a_call_whose_statics_the_kernel_takes_as_keywords():
    """`XlaChunkedDotProductAttention._fwd` takes `scale`, `is_causal` and the window as
    `**statics`: they are keywords of the call too."""
    from tokamax_kernels.attention.xla_chunked import XlaChunkedDotProductAttention

    q, k, v = (random_normal(i, (2, 16, 2, 8)) for i in (7, 8, 9))
    ba = XlaChunkedDotProductAttention().bind(q, k, v, scale=0.3, is_causal=True,
                                              local_window_size=(3, 0))
    assert {"scale", "is_causal", "local_window_size"} <= set(ba.kwargs)
    expected = tokamax.dot_product_attention(q, k, v, scale=0.3, is_causal=True,
                                             local_window_size=(3, 0), implementation="xla")
    assert_close(ba.op(*ba.args, **ba.kwargs), expected)


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
    # Upstream hands out its in-memory cache; ours is a snapshot, so a write that would
    # change nothing raises rather than being dropped.
    with pytest.raises(TypeError, match="read-only snapshot.*cache_results=True"):
        cached[ba.autotuning_cache_key] = {}
    with pytest.raises(TypeError, match="read-only snapshot"):
        del cached[ba.autotuning_cache_key]
    with pytest.raises(TypeError):  # each call's measurements too
        cached[ba.autotuning_cache_key][configs[0]] = None
    assert cached[ba.autotuning_cache_key].fastest_config in configs  # upstream's type
    assert set(op.get_autotuning_cache()[ba.autotuning_cache_key]) == set(configs)


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
    from tokamax_pass.autotuning.entry import Entry
    from tokamax_pass.autotuning.result import AutotuningResult

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


# --- constructed and called as upstream Tokamax's -------------------------------------

def _loss_call(seed=20):
    op = XlaChunkedLinearSoftmaxCrossEntropyLoss()
    x, weights = random_normal(seed, (2, 6, 16)), random_normal(seed + 1, (16, 24))
    labels = jax.random.randint(jax.random.key(seed + 2), (2, 6), 0, 24)
    return op.bind(x, labels, weights)


def test_benchmark_data_takes_upstreams_fields_in_their_order():
    data = BenchmarkData(1.5, 0.5, (2.0, 4.0), {"method": "wallclock"})
    assert (data.compile_time_ms, data.lower_time_ms, data.peak_memory_mb) == (1.5, 0.5, None)
    assert data.method == "wallclock" and data.median_evaluation_time_ms == 3.0
    assert BenchmarkData(compile_time_ms=1.0, lower_time_ms=2.0, evaluation_times_ms=(1.0,),
                         metadata={}, peak_memory_mb=3.0).asdict()["peak_memory_mb"] == 3.0


def test_autotuning_result_is_built_and_replaced_as_upstreams():
    import dataclasses

    from tokamax_pass.autotuning.entry import AutotuningData

    ba = _loss_call()
    fast, slow = XlaChunkedLossConfig(6, 8), XlaChunkedLossConfig(12, 24)
    data = {fast: BenchmarkData(1.0, 1.0, (0.5,), {}), slow: BenchmarkData(1.0, 1.0, (0.9,), {}),
            XlaChunkedLossConfig(2, 8): RuntimeError("out of memory")}
    result = tokamax.AutotuningResult(H200, ((ba, data),), tokamax_version="0.0.17")
    assert result.tokamax_version == "0.0.17"
    ((read_ba, read),) = result.data
    assert isinstance(read, AutotuningData) and read.fastest_config == fast
    assert read[XlaChunkedLossConfig(2, 8)].error == "RuntimeError: out of memory"
    assert set(read.prune_errors()) == {fast, slow}
    assert read_ba.cache_key == ba.cache_key
    again = tokamax.AutotuningResult(device_kind=H200, data=result.data)
    assert again.best_config(ba) == fast
    emptied = dataclasses.replace(result, data=())
    assert len(emptied) == 0 and emptied.tokamax_version == "0.0.17"


def test_dump_cache_str_is_a_cache_file(tmp_path, monkeypatch):
    from tokamax_pass.autotuning import cache as cache_lib

    ba = _loss_call()
    config = XlaChunkedLossConfig(6, 8)
    result = tokamax.AutotuningResult("cpu", [(ba, {config: BenchmarkData(1, 1, (0.5,), {})})])
    monkeypatch.setenv(cache_lib.ENV_CACHE_DIR, str(tmp_path))
    cache_lib._USER.invalidate()
    (tmp_path / "cpu.json").write_text(result.dump_cache_str())
    cache_lib._USER.invalidate()
    assert ba.cached_autotuning_data.fastest_config == config
    assert ba.default_config == config


def test_bound_arguments_members_of_upstream():
    ba = _loss_call()
    assert list(ba.signature.parameters)[:3] == ["x", "labels", "weights"]
    assert ba.vmap_axis_sizes == ()
    assert ba.cached_autotuning_data is None
    assert ba.default_config == ba.get_config() == ba.heuristics_config
    with pytest.raises(ValueError, match="no config found"):
        ba.get_config(allow_heuristics=False)
    fast, slow = XlaChunkedLossConfig(6, 8), XlaChunkedLossConfig(12, 24)
    with tokamax.AutotuningResult("cpu", [(ba, {fast: Measurement((0.5,)),
                                                slow: Measurement((0.9,))})]):
        assert ba.cached_autotuning_data.fastest_config == fast
        assert ba.default_config == ba.get_config() == fast
        assert ba.get_config(check_autotuning_cache=False) == ba.heuristics_config
    tuned = ba.get_config(autotune_configs=[slow], cache_autotuning_results=True)
    assert tuned == slow and ba.op.get_autotuning_cache()[ba.autotuning_cache_key]
    assert ba.cached_autotuning_data.fastest_config == slow
    with tokamax.config.ignore_autotuning_cache(True):
        assert ba.cached_autotuning_data is None


def test_bound_arguments_vmap_axis_sizes_and_benchmark():
    x = random_normal(23, (3, 2, 5, 16))
    found = tokamax.autotuning.get_bound_args(jax.vmap(lambda x: LayerNorm()(x)), x)
    (ba,) = found
    assert ba.vmap_axis_sizes == (3,)
    data = LayerNorm().bind(random_normal(24, (2, 5, 16))).benchmark("forward_and_vjp")
    assert isinstance(data, BenchmarkData) and len(data.evaluation_times_ms) >= 1


def test_vjp_arg_spec_binds_the_vjp_op():
    x, scale = random_normal(25, (2, 5, 16)), random_normal(26, (16,))
    ba = LayerNorm().bind(x, scale, None)
    spec = ba.vjp_arg_spec
    out, residuals = LayerNorm()(x, scale, None, return_residuals=True)
    assert spec["out"].shape == spec["dout"].shape == out.shape == x.shape
    assert [r.shape for r in jax.tree.leaves(spec["residuals"])] == [
        r.shape for r in jax.tree.leaves(residuals)]
    vjp_ba = ba.op.vjp_op().bind(**spec)
    assert vjp_ba.arguments["x"] is x


def test_op_members_of_upstream():
    op = LayerNorm()
    assert op.supports_symbolic_shapes and op.supports_batched_args_capture
    assert list(op.signature.parameters)[:3] == ["x", "scale", "offset"]
    x = random_normal(27, (2, 5, 16))
    assert op.bind(x, return_residuals=True).cache_key == op.bind(x).cache_key
    out, residuals = op(x, return_residuals=True)
    assert_close(out, op(x)) and residuals is not None
    bypassed = op.replace(bypass_device_check=True)
    assert bypassed.bypass_device_check and bypassed == op
    assert tokamax.core.spec.encode(bypassed) == tokamax.core.spec.encode(op)


def test_bypass_device_check_skips_the_device_check():
    from tokamax_kernels.layer_norm import PallasTritonLayerNorm

    x = random_normal(28, (2, 5, 16))
    with pytest.raises(NotImplementedError, match="runs on"):
        PallasTritonLayerNorm()(x)
    # Past the check, Pallas itself refuses to lower a Triton kernel for the CPU.
    with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
        PallasTritonLayerNorm(bypass_device_check=True)(x)


def test_an_op_without_symbolic_shapes_says_so():
    import dataclasses

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Fixed(LayerNorm):
        supports_symbolic_shapes = False

    (b,) = jax.export.symbolic_shape("b")
    shaped = jax.ShapeDtypeStruct((b, 16), jnp.float32)
    with pytest.raises(NotImplementedError, match="does not support symbolic shapes"):
        jax.eval_shape(Fixed(), shaped)
    assert jax.eval_shape(LayerNorm(), shaped).shape == (b, 16)


def test_keyword_names_of_upstream(tmp_path):
    from tokamax_pass import benchmarking
    from tokamax_pass.autotuning import bound_args_from_json, bound_args_to_json

    ba = LayerNorm().bind(random_normal(29, (2, 3, 8)))
    path = tmp_path / "calls.json"
    assert bound_args_to_json([ba], filename=path) == path.read_text()
    (read,) = bound_args_from_json(json_string=path.read_text())
    assert read.cache_key == ba.cache_key
    result = tokamax.AutotuningResult("cpu", [(ba, {ba.heuristics_config: Measurement((1.0,))})])
    with open(tmp_path / "r.json", "w") as fp:
        result.dump(fp=fp)
    with open(tmp_path / "r.json") as fp:
        assert tokamax.AutotuningResult.load(fp=fp) == result
    assert tokamax.AutotuningResult.loads(json_data=result.dumps()) == result
    with pytest.raises(TypeError, match="got text and its other name json_data"):
        tokamax.AutotuningResult.loads(result.dumps(), json_data=result.dumps())
    f_std, arrays = benchmarking.standardize_function(jnp.sin, random_normal(30, (4,)))
    run = benchmarking.compile_benchmark(f=f_std, x=arrays)
    assert len(run(x=arrays, iterations=1).evaluation_times_ms) == 1
    assert tokamax.core.snake_case_name(op=LayerNorm) == "layer_norm"


def test_register_benchmark_names_the_missing_package(monkeypatch):
    import sys

    from tokamax_pass import benchmarking

    monkeypatch.setitem(sys.modules, "google_benchmark", None)
    with pytest.raises(ImportError, match="google_benchmark package"):
        benchmarking.register_benchmark("sin", "jnp", jnp.sin, {"x": random_normal(31, (4,))})


class _FakeGoogleBenchmark:
    """What `register_benchmark` uses of `google_benchmark`: options and `register`."""

    kMicrosecond = "us"

    def __init__(self):
        self.registered = {}
        passthrough = lambda *args: (lambda f: f)
        self.option = type("option", (), {"unit": staticmethod(passthrough),
                                          "use_manual_time": staticmethod(passthrough),
                                          "iterations": staticmethod(passthrough)})

    def register(self, f, name):
        self.registered[name] = f


class _State:
    def __init__(self):
        self.runs, self.times, self.label, self.skipped = 1, [], None, None

    def __bool__(self):
        self.runs -= 1
        return self.runs >= 0

    def set_iteration_time(self, seconds):
        self.times.append(seconds)

    def set_label(self, label):
        self.label = label

    def skip_with_error(self, message):
        self.skipped = message


def test_benchmark_registrar_registers_ops_with_their_config(monkeypatch):
    import sys

    from tokamax_pass import benchmarking

    fake = _FakeGoogleBenchmark()
    monkeypatch.setitem(sys.modules, "google_benchmark", fake)
    op = XlaChunkedLinearSoftmaxCrossEntropyLoss()
    kwargs = {"x": jax.ShapeDtypeStruct((2, 6, 16), jnp.float32),
              "labels": jax.ShapeDtypeStruct((2, 6), jnp.int32),
              "weights": jax.ShapeDtypeStruct((16, 24), jnp.float32)}
    registrar = benchmarking.get_benchmark_registrar({"chunked": op, "sin": jnp.sin})
    registrar("loss", "chunked", kwargs, method="wallclock", iterations=2)
    registrar("sine", "sin", lambda: {"x": random_normal(32, (4,))}, mode="forward")
    assert set(fake.registered) == {"loss_forward_chunked", "sine_forward_sin"}
    state = _State()
    fake.registered["loss_forward_chunked"](state)
    assert state.skipped is None and state.times[0] > 0
    assert "min=" in state.label and "XlaChunkedLossConfig" in state.label
    benchmarking.register_benchmark("bad", "impl", lambda x: x.no_such, {"x": 1.0},
                                    raise_on_error=False)
    state = _State()
    fake.registered["bad_forward_impl"](state)
    assert "no_such" in state.skipped
