"""Autotuning on CPU: the seed snippets, a user-defined op, contexts, JSON, discovery."""

from __future__ import annotations

import io
import json
import math

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from _tunable_ops import (
    ChunkConfig,
    ChunkedMatmul,
    SlowLoweringMatmul,
    XlaChunkedMatmul,
    chunked_matmul,
)
from conftest import assert_close, random_normal
from tokamax_pass.autotuning import discovery, keys
from tokamax_pass.autotuning.entry import Entry, Measurement
from tokamax_pass.core import current_target, selection, spec

M, K, N = 16, 64, 32


@pytest.fixture(autouse=True)
def _empty_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKAMAX_PASS_CACHE_DIR", str(tmp_path / "cache"))


def _inputs():
    return random_normal(0, (M, K)), random_normal(1, (K, N))


def _result(times_by_config, op=None, device_kind=None):
    x, w = _inputs()
    ba = keys.canonical((op or XlaChunkedMatmul()).bind(jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                       jax.ShapeDtypeStruct(w.shape, w.dtype)))
    data = {c: Measurement(evaluation_times_ms=(t,)) for c, t in times_by_config.items()}
    kind = device_kind or current_target().device_kind
    return tokamax.AutotuningResult(kind, [Entry(ba, data, keys.provenance(ba.op))])


def _chosen_configs(f, *args):
    """The configs stamped on the op calls of `f` when lowered now."""
    text = jax.jit(f).lower(*args).as_text()
    return [json.loads(s)["op"]["fields"]["config"] for s in discovery.specs_from_text(text)]


def test_user_defined_op_autotune_keeps_failures_and_picks_a_correct_config():
    x, w = _inputs()
    result = tokamax.autotune([XlaChunkedMatmul().bind(x, w)], progress=False)
    [(ba, data)] = list(result)
    assert type(ba.op) is XlaChunkedMatmul and ba.op.config is None
    assert set(data) == {ChunkConfig(32), ChunkConfig(64), ChunkConfig(16), ChunkConfig(0),
                         ChunkConfig(56)}
    assert data[ChunkConfig(0)].error.startswith("compile error")
    assert data[ChunkConfig(56)].error.startswith("wrong numerics")
    best = result.best_config(ba)
    assert best in {ChunkConfig(16), ChunkConfig(32), ChunkConfig(64)}
    assert all(m.ok for c, m in data.items() if c.chunk in (16, 32, 64))
    f = lambda x, w: chunked_matmul(x, w, implementation="xla_chunked")
    with result:
        assert _chosen_configs(f, x, w) == [{"dataclass": spec.import_path(ChunkConfig),
                                            "fields": {"chunk": best.chunk}}]
        assert_close(jax.jit(f)(x, w), x @ w)


def test_autotune_skips_cached_ops_unless_ignore_cache():
    x, w = _inputs()
    with _result({ChunkConfig(16): 1.0}):
        assert len(tokamax.autotune([XlaChunkedMatmul().bind(x, w)], progress=False)) == 0
        tuned = tokamax.autotune([XlaChunkedMatmul().bind(x, w)], ignore_cache=True,
                                 progress=False)
    assert len(tuned) == 1


def test_function_jitted_outside_retraces_inside_the_context():
    x, w = _inputs()
    traces = []

    @jax.jit
    def f(x, w):
        traces.append(1)
        return chunked_matmul(x, w, implementation="xla_chunked")

    f(x, w)
    result = _result({ChunkConfig(16): 1.0, ChunkConfig(64): 2.0})
    with result:
        f(x, w)
        assert _chosen_configs(f, x, w)[0]["fields"] == {"chunk": 16}
    assert len(traces) == 2
    f(x, w)
    assert len(traces) == 2  # back to the first trace
    assert _chosen_configs(f, x, w)[0]["fields"] == {"chunk": K // 2}  # heuristics


def test_nested_contexts_innermost_wins():
    x, w = _inputs()
    f = lambda x, w: chunked_matmul(x, w, implementation="xla_chunked")
    outer, inner = _result({ChunkConfig(16): 1.0}), _result({ChunkConfig(64): 1.0})
    with outer:
        with inner:
            assert _chosen_configs(f, x, w)[0]["fields"] == {"chunk": 64}
            with outer:
                assert _chosen_configs(f, x, w)[0]["fields"] == {"chunk": 16}
            assert _chosen_configs(f, x, w)[0]["fields"] == {"chunk": 64}
        assert _chosen_configs(f, x, w)[0]["fields"] == {"chunk": 16}
    assert tokamax.autotuning.active_results() == ()


def _chosen_class(f, *args):
    text = jax.jit(f).lower(*args).as_text()
    return json.loads(discovery.specs_from_text(text)[0])["op"]["dataclass"].rsplit(".")[-1]


def _xla_entry(time_ms, shape=(M, K, N)):
    m, k, n = shape
    bound = keys.canonical(ChunkedMatmul().bind(jax.ShapeDtypeStruct((m, k), jnp.float32),
                                                jax.ShapeDtypeStruct((k, n), jnp.float32)))
    return Entry(bound, {tokamax.NullConfig(): Measurement((time_ms,))},
                 keys.provenance(bound.op))


def _chunked_entry(time_ms, shape=(M, K, N), dtype=jnp.float32):
    m, k, n = shape
    bound = keys.canonical(XlaChunkedMatmul().bind(jax.ShapeDtypeStruct((m, k), dtype),
                                                   jax.ShapeDtypeStruct((k, n), dtype)))
    return Entry(bound, {ChunkConfig(16): Measurement((time_ms,))}, keys.provenance(bound.op))


def test_implementation_none_runs_a_kernel_only_where_measured_faster():
    x, w = _inputs()
    f = lambda x, w: chunked_matmul(x, w)
    kind = current_target().device_kind
    # Nothing measured: the plain-JAX path, although the kernel comes first in the family.
    assert _chosen_class(f, x, w) == "ChunkedMatmul"
    with tokamax.AutotuningResult(kind, [_chunked_entry(0.5)]):  # the xla path unmeasured
        assert _chosen_class(f, x, w) == "ChunkedMatmul"
    with tokamax.AutotuningResult(kind, [_chunked_entry(5.0), _xla_entry(1.0)]):
        assert _chosen_class(f, x, w) == "ChunkedMatmul"
    with tokamax.AutotuningResult(kind, [_chunked_entry(0.5), _xla_entry(1.0)]):
        assert _chosen_class(f, x, w) == "XlaChunkedMatmul"
    # Faster, but within the noise margin: the plain path stays.
    within = 1.0 - selection.TIE_MARGIN / 2
    with tokamax.AutotuningResult(kind, [_chunked_entry(within), _xla_entry(1.0)]):
        assert _chosen_class(f, x, w) == "ChunkedMatmul"


def test_a_measured_neighbouring_shape_stands_in_for_an_unmeasured_one():
    x, w = _inputs()
    f = lambda x, w: chunked_matmul(x, w)
    kind = current_target().device_kind
    near, far, farther = (M * 2, K, N), (M * 4, K, N), (M * 8, K, N)
    with tokamax.AutotuningResult(kind, [_chunked_entry(0.5, near), _xla_entry(1.0, near)]):
        assert _chosen_class(f, x, w) == "XlaChunkedMatmul"
    with tokamax.AutotuningResult(kind, [_chunked_entry(0.6, far), _xla_entry(1.0, far)]):
        assert _chosen_class(f, x, w) == "ChunkedMatmul"  # beyond MAX_RATIO: not a neighbour
    # Within FAR_RATIO, a kernel that won by DOMINANT_WIN there counts; beyond it, not.
    with tokamax.AutotuningResult(kind, [_chunked_entry(0.4, far), _xla_entry(1.0, far)]):
        assert _chosen_class(f, x, w) == "XlaChunkedMatmul"
    with tokamax.AutotuningResult(kind, [_chunked_entry(0.1, farther),
                                         _xla_entry(1.0, farther)]):
        assert _chosen_class(f, x, w) == "ChunkedMatmul"
    # A near neighbour outranks a far dominant one.
    with tokamax.AutotuningResult(kind, [_chunked_entry(0.1, far), _xla_entry(1.0, far),
                                         _chunked_entry(3.0, near), _xla_entry(1.0, near)]):
        assert _chosen_class(f, x, w) == "ChunkedMatmul"
    # The nearest neighbour decides: a slow kernel next door outweighs a fast one farther.
    with tokamax.AutotuningResult(kind, [
            _chunked_entry(0.5, (M * 2, K * 2, N)), _xla_entry(1.0, (M * 2, K * 2, N)),
            _chunked_entry(3.0, near), _xla_entry(1.0, near)]):
        assert _chosen_class(f, x, w) == "ChunkedMatmul"
    # Another dtype is another kind of call, never a neighbour.
    bf16 = _chunked_entry(0.5, near, jnp.bfloat16)
    with tokamax.AutotuningResult(kind, [bf16, _xla_entry(1.0, near)]):
        assert _chosen_class(f, x, w) == "ChunkedMatmul"


def test_ranking_keeps_the_given_order_within_the_tie_margin():
    times = [1.0, 1.03, 0.99, 2.0, 1.5]
    assert selection._rank_by_time(range(5), times) == [0, 1, 2, 4, 3]
    assert selection._rank_by_time([0, 1], [3.0, 1.0]) == [1, 0]
    assert selection._rank_by_time([0, 1, 2], [math.inf, 2.0, 1.0]) == [2, 1, 0]  # failed: last


def test_a_candidate_that_failed_every_config_ranks_last():
    """The family's first choice failed every config (out of memory, say): `None` takes
    the measured one instead of falling back to the family order."""
    x, w = _inputs()
    f = lambda x, w: chunked_matmul(x, w)
    reference = _result({ChunkConfig(16): 2.0}, ChunkedMatmul()).entries[0]
    xla = Entry(reference.bound, {tokamax.NullConfig(): Measurement((3.0,))},
                reference.provenance)
    chunked = _result({ChunkConfig(16): 1.0}).entries[0]
    failed_chunked = Entry(chunked.bound, {ChunkConfig(16): Measurement(error="out of memory")},
                           chunked.provenance)
    kind = current_target().device_kind
    with tokamax.AutotuningResult(kind, [xla, failed_chunked]):
        text = jax.jit(f).lower(x, w).as_text()
    chosen = json.loads(discovery.specs_from_text(text)[0])["op"]["dataclass"]
    assert chosen.rsplit(".")[-1] == "ChunkedMatmul"


def test_json_round_trips_paths_and_files(tmp_path):
    result = _result({ChunkConfig(16): 1.0, ChunkConfig(64): 2.0})
    assert tokamax.AutotuningResult.loads(result.dumps()) == result
    path = tmp_path / "r.json"
    result.dump(path)
    assert tokamax.AutotuningResult.load(path) == result
    assert tokamax.AutotuningResult.load(str(path)) == result
    buffer = io.StringIO()
    result.dump(buffer)
    buffer.seek(0)
    loaded = tokamax.AutotuningResult.load(buffer)
    assert loaded == result and loaded.best_config(next(iter(loaded))[0]) == ChunkConfig(16)


def test_corrupt_and_newer_schema_give_clear_errors(tmp_path):
    text = _result({ChunkConfig(16): 1.0}).dumps()
    with pytest.raises(spec.SpecError, match="not valid JSON"):
        tokamax.AutotuningResult.loads(text[: len(text) // 2])
    newer = json.loads(text)
    newer["schema_version"] = spec.SCHEMA_VERSION + 1
    with pytest.raises(spec.SpecError, match="upgrade tokamax_pass"):
        tokamax.AutotuningResult.loads(json.dumps(newer))
    with pytest.raises(spec.SpecError, match="not a tokamax_pass AutotuningResult"):
        tokamax.AutotuningResult.loads('{"schema_version": 1}')


def test_merge_right_wins_and_device_kinds_must_match():
    a = _result({ChunkConfig(16): 1.0, ChunkConfig(64): 3.0})
    b = _result({ChunkConfig(64): 0.5})
    merged = a | b
    [(ba, data)] = list(merged)
    assert data[ChunkConfig(64)].median_ms == 0.5 and data[ChunkConfig(16)].median_ms == 1.0
    assert merged.best_config(ba) == ChunkConfig(64)
    with pytest.raises(ValueError, match="different device kinds"):
        a | _result({ChunkConfig(16): 1.0}, device_kind="NVIDIA H200")


def test_merge_keeps_no_measurement_of_other_code():
    """An entry measured on other source (a kernel edit, then a retune) is replaced
    whole: its configs the retune did not time must not come back stamped fresh."""
    old = _result({ChunkConfig(16): 1.0, ChunkConfig(64): 3.0})
    [entry] = old.entries
    stale = Entry(entry.bound, entry.data, dict(entry.provenance, source_hash="0" * 16))
    stale_result = tokamax.AutotuningResult(old.device_kind, [stale])
    merged = stale_result | _result({ChunkConfig(64): 0.5})
    [(_, data)] = list(merged)
    assert list(data) == [ChunkConfig(64)]
    [entry] = merged.entries
    assert keys.stale_reason(entry.bound.op, entry.provenance) is None


def test_repr_is_a_table():
    text = repr(_result({ChunkConfig(16): 1.0, ChunkConfig(0): 2.0}))
    assert "XlaChunkedMatmul" in text and "chunk=16" in text and "f32[16,64]" in text
    assert "best config" in text.splitlines()[1]


def test_get_bound_args_accepts_callables_lowered_and_text():
    x, w = _inputs()
    f = lambda x, w: jnp.sum(chunked_matmul(x, w, implementation="xla_chunked") ** 2)
    forward = tokamax.autotuning.get_bound_args(f, x, w)
    assert [type(b.op).__name__ for b in forward] == ["XlaChunkedMatmul"]
    assert forward[0].op.config is None
    assert forward[0].arguments["x"] == jax.ShapeDtypeStruct((M, K), jnp.float32)
    lowered = jax.jit(jax.grad(f)).lower(x, w)
    for source in (lowered, lowered.as_text(), lowered.compile().as_text()):
        names = sorted(type(b.op).__name__ for b in tokamax.autotuning.get_bound_args(source))
        assert names == ["AutodiffVjp", "XlaChunkedMatmul"]
    assert len(tokamax.autotuning.get_bound_args(jax.jit(jax.grad(f)), x, w)) == 2


def test_an_op_call_that_cannot_be_read_back_is_skipped_with_a_warning():
    """A GLU with a lambda activation cannot be keyed in a cache: it does not stop the
    whole autotune (the program's other calls are found), and alone it still raises."""
    x, w = _inputs()
    glu_w = jnp.ones((K, 2, 4), jnp.float32)

    def f(x, w):
        y = tokamax.gated_linear_unit(x, glu_w, activation=lambda g: g * 2.0)
        return jnp.sum(chunked_matmul(y, w[:4], implementation="xla_chunked"))

    with pytest.warns(UserWarning, match="skipping a GatedLinearUnit call.*module-level"):
        found = tokamax.autotuning.get_bound_args(f, x, w)
    assert [type(b.op).__name__ for b in found] == ["XlaChunkedMatmul"]
    with pytest.raises(spec.SpecError, match="module-level function"):
        tokamax.autotuning.get_bound_args(
            lambda x: tokamax.gated_linear_unit(x, glu_w, activation=lambda g: g), x)


def test_get_bound_args_builds_no_kernel_and_leaves_the_programs_it_lowered_whole(
        monkeypatch):
    """A callable's op calls are found without building their kernels (`specs_only`):
    the ragged dot's gradient is made of ragged-dot calls (dlhs, drhs), which are found
    as the compiled program holds them, while every call that makes no op call of its own
    is lowered to a stand-in. The stand-ins never leak: the function jitted before and
    after computes the real gradient, and a thread lowering meanwhile gets the real op."""
    import threading

    from tokamax_pass.core import primitive

    lhs, rhs = random_normal(0, (64, 32)), random_normal(1, (4, 32, 16))
    sizes = jnp.array([10, 30, 0, 24], jnp.int32)
    stood_in = []
    original = primitive._stand_in
    monkeypatch.setattr(primitive, "_stand_in",
                        lambda avals: stood_in.append(len(avals)) or original(avals))
    g = jax.grad(lambda a, b: jnp.sum(tokamax.ragged_dot(a, b, sizes) ** 2), argnums=(0, 1))
    found = discovery.get_bound_args(g, lhs, rhs)
    names = sorted(f"{type(b.op).__name__} {b.arguments['variant']}" for b in found)
    assert names == ["RaggedDot dlhs", "RaggedDot drhs", "RaggedDot forward",
                     "RaggedDotVjp forward"]
    assert len(stood_in) == 3  # the three ragged dots; their gradient's own body is lowered
    # The program text holds them too, all but the gradient whose instructions are all
    # its ragged dots' (each instruction carries the innermost call's spec).
    text = jax.jit(g).lower(lhs, rhs).as_text()
    assert {b.to_json() for b in discovery.get_bound_args(text)} < {b.to_json() for b in found}

    x, w = _inputs()
    f = jax.grad(lambda x, w: jnp.sum(chunked_matmul(x, w, implementation="xla_chunked")
                                      ** 2))
    expected = jax.grad(lambda x, w: jnp.sum(jnp.dot(x, w, precision="highest") ** 2))(x, w)
    assert_close(jax.jit(f)(x, w), expected)
    assert len(discovery.get_bound_args(f, x, w)) == 2
    assert_close(jax.jit(lambda x, w: f(x, w))(x, w), expected)  # traced and lowered anew
    outputs = []
    with primitive.specs_only():
        thread = threading.Thread(
            target=lambda: outputs.append(jax.jit(lambda x, w: f(x, w))(x, w)))
        thread.start()
        thread.join()
    assert_close(outputs[0], expected)


def test_bound_args_json_round_trip(tmp_path):
    x, w = _inputs()
    f = jax.grad(lambda x, w: jnp.sum(chunked_matmul(x, w, implementation="xla_chunked")))
    bound = tokamax.autotuning.get_bound_args(f, x, w)
    path = tmp_path / "bound_args.json"
    text = tokamax.autotuning.bound_args_to_json(f, path, x, w)
    for source in (path, str(path), text, io.StringIO(text)):
        loaded = tokamax.autotuning.bound_args_from_json(source)
        assert [b.to_json() for b in loaded] == [b.to_json() for b in bound]
    with pytest.raises(spec.SpecError, match="not valid JSON"):
        tokamax.autotuning.bound_args_from_json("[{")


def _seed_loss(x, scale):
    x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=None)
    x = tokamax.dot_product_attention(x, x, x, implementation="xla_chunked")
    x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=None)
    x = tokamax.dot_product_attention(x, x, x, implementation=None)
    return jnp.sum(x)


def _seed_inputs():
    channels, seq_len, batch_size, num_heads = (16, 64, 2, 2)
    scale = jax.random.normal(jax.random.key(0), (channels,), dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(1), (batch_size, seq_len, num_heads, channels),
                          dtype=jnp.bfloat16)
    return x, scale


def test_seed_document_autotuning_snippets():
    x, scale = _seed_inputs()
    f_grad = jax.jit(jax.grad(_seed_loss))
    out = f_grad(x, scale)
    autotune_result: tokamax.AutotuningResult = tokamax.autotune(f_grad, x, scale, progress=False)
    names = {type(ba.op).__name__ for ba, _ in autotune_result}
    assert names == {"XlaChunkedDotProductAttention", "XlaChunkedDotProductAttentionVjp"}
    assert all(m.ok for _, data in autotune_result for m in data.values())
    with autotune_result:
        out_autotuned = f_grad(x, scale)
    assert_close(out_autotuned, out, jnp.bfloat16)
    autotune_result_json: str = autotune_result.dumps()
    autotune_result = tokamax.AutotuningResult.loads(autotune_result_json)
    with autotune_result:
        assert_close(f_grad(x, scale), out, jnp.bfloat16)


def test_search_space_is_pruned_around_the_heuristics():
    from tokamax_pass.autotuning.autotuner import _distance, candidate_configs

    ba = tokamax.PallasTritonLayerNorm.bind(
        jax.ShapeDtypeStruct((65536, 4096), jnp.bfloat16), None, None)
    with tokamax.core.targeting("NVIDIA H200"):
        heuristics = ba.heuristics_config
        everything = candidate_configs(ba)
        pruned = candidate_configs(ba, max_configs=8)
    assert len(everything) > 8 and len(pruned) == 8
    assert pruned[0] == everything[0] == heuristics
    left_out = set(everything) - set(pruned)
    assert max(_distance(c, heuristics) for c in pruned) <= min(
        _distance(c, heuristics) for c in left_out)


def test_autotune_times_the_config_none_runs_today_first():
    """A measured config outside the search around the heuristics (as 12 of the H200
    library entries hold) is timed too, first, so tuned cannot settle below untuned."""
    from tokamax_pass.autotuning import api, keys
    from tokamax_pass.autotuning.autotuner import candidate_configs
    from tokamax_pass.autotuning.entry import Entry, Measurement

    ba = keys.canonical(tokamax.PallasTritonLayerNorm.bind(
        jax.ShapeDtypeStruct((65536, 4096), jnp.bfloat16), None, None))
    with tokamax.core.targeting("NVIDIA H200"):
        everything = candidate_configs(ba)
        nearest = candidate_configs(ba, max_configs=6)
        assert api.with_current_config(ba, nearest, 6, "NVIDIA H200") == nearest  # unmeasured
        far = everything[-1]
        assert far not in nearest
        shipped = tokamax.AutotuningResult("NVIDIA H200", [
            Entry(ba, {far: Measurement((1.0,))}, keys.provenance(ba.op))])
        with shipped:
            planned = api.with_current_config(ba, nearest, 6, "NVIDIA H200")
    assert planned[0] == far and len(planned) == 6
    assert planned[1:] == nearest[:5]


def test_all_implementations_tunes_every_vjp_op_the_backward_can_pick():
    """`None` ranks a backward pass's VJP ops by measurement too, so tuning with
    `all_implementations` measures the VJP op of every forward implementation."""
    q = random_normal(0, (1, 32, 2, 16))
    f = jax.grad(lambda q: tokamax.dot_product_attention(q, q, q, is_causal=True).sum())
    result = tokamax.autotune(f, q, all_implementations=True, ignore_cache=True,
                              progress=False, max_configs=2, iterations=1)
    ops = {type(ba.op).__name__ for ba, _ in result}
    assert {"XlaChunkedDotProductAttentionVjp", "XlaDotProductAttentionVjp"} <= ops
    assert {"XlaChunkedDotProductAttention", "DotProductAttention"} <= ops


def test_untimed_programs_compile_without_xla_gemm_autotuning(monkeypatch):
    """A VJP call's residuals and the reference outputs run once: they skip XLA's GEMM
    autotuning (which serializes with the candidates' compiles on a GPU); the candidates,
    which are timed, keep it."""
    from tokamax_pass.autotuning import timing_inputs

    options = []
    original_jit = jax.jit

    def jit(fun, **kwargs):
        options.append(kwargs.get("compiler_options"))
        return original_jit(fun, **kwargs)

    monkeypatch.setattr(jax, "jit", jit)
    q = random_normal(0, (1, 32, 2, 16))
    f = jax.grad(lambda q: tokamax.dot_product_attention(
        q, q, q, implementation="xla_chunked").sum())
    result = tokamax.autotune(f, q, ignore_cache=True, progress=False, max_configs=2,
                              iterations=1)
    assert {type(ba.op).__name__ for ba, _ in result} == {
        "XlaChunkedDotProductAttention", "XlaChunkedDotProductAttentionVjp"}
    untimed = [o for o in options if o == timing_inputs.UNTIMED_COMPILER_OPTIONS]
    assert len(untimed) == 3  # two references and the VJP call's residuals
    assert None in options  # the candidates


def test_a_reference_that_fails_on_the_device_leaves_numerics_unchecked(monkeypatch):
    """A reference output whose device run fails (out of memory) only says so when it is
    awaited: the call's configs are then timed unchecked, not all failed in their
    numerics checks."""
    from tokamax_pass.autotuning import autotuner, timing_inputs

    class FailsWhenAwaited:
        def block_until_ready(self):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 48.00GiB")

    monkeypatch.setattr(timing_inputs, "run_untimed", lambda *args: FailsWhenAwaited())
    x, w = _inputs()
    [entry] = autotuner.Autotuner(iterations=2).tune_many(
        [(keys.canonical(XlaChunkedMatmul().bind(x, w)), None)])
    assert entry.data[ChunkConfig(0)].error.startswith("compile error")
    assert entry.data[ChunkConfig(56)].ok  # wrong, but nothing to check it against
    assert entry.data[ChunkConfig(16)].ok


def test_several_calls_compile_together_then_time_in_order():
    """Calls of one wave are compiled in one pool before any is timed; each keeps its
    own failures, and entries come back in the order of the calls."""
    from tokamax_pass.autotuning.autotuner import Autotuner

    x, w = _inputs()
    wide = random_normal(2, (K, 2 * N))
    calls = [keys.canonical(XlaChunkedMatmul().bind(x, w)),
             keys.canonical(XlaChunkedMatmul().bind(x, wide))]
    entries = Autotuner(iterations=2).tune_many([(ba, None) for ba in calls])
    assert [entry.bound for entry in entries] == calls
    for entry in entries:
        assert entry.data[ChunkConfig(0)].error.startswith("compile error")
        assert entry.data[ChunkConfig(56)].error.startswith("wrong numerics")
        assert entry.data[ChunkConfig(16)].ok


def test_calls_differing_only_in_dtype_are_timed_on_inputs_of_their_own_dtype():
    """Calls share inputs and a reference output only when their argument specs agree
    dtypes included: a bfloat16 call of a float32 call's shapes gets bfloat16 inputs."""
    from tokamax_pass.autotuning.autotuner import Autotuner

    x, w = _inputs()
    calls = [keys.canonical(XlaChunkedMatmul().bind(x, w)),
             keys.canonical(XlaChunkedMatmul().bind(x.astype(jnp.bfloat16),
                                                    w.astype(jnp.bfloat16)))]
    entries = Autotuner(iterations=1).tune_many([(ba, None) for ba in calls])
    for entry in entries:
        assert all(entry.data[ChunkConfig(c)].ok for c in (16, 32, 64)), entry.data
        assert entry.data[ChunkConfig(56)].error.startswith("wrong numerics")


def test_the_numerics_check_rejects_one_wrong_element_among_many_right_ones():
    """The check bounds the largest error, not the average: one element off by a third
    of the output's scale in a 64 x 64 output is wrong numerics; float32 rounding is not."""
    from tokamax_pass.autotuning.numerics import numerics_error

    expected = random_normal(3, (64, 64))
    scale = float(jnp.max(jnp.abs(expected)))
    one_wrong = expected.at[17, 41].add(scale / 3)
    assert (numerics_error(one_wrong, expected) or "").startswith("wrong numerics: max error")
    assert numerics_error((one_wrong, expected), (expected, expected)) is not None
    rounded = expected * (1 + 1e-6 * random_normal(4, (64, 64)))
    assert numerics_error(rounded, expected) is None


def test_worker_processes_lower_candidates_with_the_same_outcomes(monkeypatch):
    """Candidates exported by worker processes compile and time like local ones; one a
    worker cannot export (chunk 0 raises) falls back to local lowering and its error."""
    from tokamax_pass.autotuning import lowering
    from tokamax_pass.autotuning.autotuner import Autotuner

    exported = []
    original = lowering.deserialized
    monkeypatch.setattr(lowering, "deserialized",
                        lambda blob: exported.append(blob) or original(blob))
    x, w = _inputs()
    slow = keys.canonical(SlowLoweringMatmul().bind(x, w))
    fast = keys.canonical(XlaChunkedMatmul().bind(x, w))
    entries = Autotuner(iterations=2, lowering_processes=2).tune_many([(slow, None),
                                                                       (fast, None)])
    # Only the slow-lowering op's candidates go to the workers: chunks 16, 32, 56, 64
    # (chunk 0 fails in the worker too, then locally).
    assert len(exported) == 4
    for entry in entries:
        assert entry.data[ChunkConfig(0)].error.startswith("compile error")
        assert entry.data[ChunkConfig(56)].error.startswith("wrong numerics")
        assert all(entry.data[ChunkConfig(c)].ok for c in (16, 32, 64))


def test_autotune_starts_requested_workers_before_tracing(monkeypatch):
    """`autotune(lowering_processes=N)` starts the workers first and lends them to every
    wave; they export the slow-lowering op's candidates and are closed at the end."""
    from tokamax_pass.autotuning import lowering

    started, closed, exported = [], [], []
    original_init, original_close = lowering.ExportWorkers.__init__, lowering.ExportWorkers.close
    original_deserialized = lowering.deserialized

    def init(self, processes):
        started.append(processes)
        original_init(self, processes)

    def close(self):
        closed.append(True)
        original_close(self)

    monkeypatch.setattr(lowering.ExportWorkers, "__init__", init)
    monkeypatch.setattr(lowering.ExportWorkers, "close", close)
    monkeypatch.setattr(lowering, "deserialized",
                        lambda blob: exported.append(blob) or original_deserialized(blob))
    x, w = _inputs()
    result = tokamax.autotune([SlowLoweringMatmul().bind(x, w)], lowering_processes=2,
                              iterations=2, progress=False)
    assert started == [2] and closed == [True] and len(exported) == 4
    assert len(result) == 1
    assert lowering.start_early(None) is None  # on a CPU backend nothing starts by default
    assert lowering.start_early(0) is None


def test_mosaic_gpu_ops_are_declared_slow_to_lower():
    from tokamax_kernels.attention import (
        PallasMosaicGpuFlashAttention,
        PallasMosaicGpuFlashAttentionVjp,
        PallasTritonFlashAttention,
    )
    from tokamax_kernels.ragged_dot import PallasMosaicGpuRaggedDot

    assert PallasMosaicGpuFlashAttention.slow_lowering
    assert PallasMosaicGpuFlashAttentionVjp.slow_lowering
    assert PallasMosaicGpuRaggedDot.slow_lowering
    assert not PallasTritonFlashAttention.slow_lowering


def test_a_worker_exports_a_mosaic_kernel_for_the_h200():
    """What a worker runs: the export of a Mosaic GPU candidate from this CPU machine."""
    from tokamax_kernels.attention import PallasMosaicGpuFlashAttention
    from tokamax_pass.autotuning import lowering

    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    op = PallasMosaicGpuFlashAttention()
    with tokamax.core.targeting("NVIDIA H200"):
        ba = keys.canonical(op.bind(q, q, q))
        config = ba.heuristics_config
    blob = lowering.export_candidate(op.replace(config=config), ba.vmap, dict(ba.arguments),
                                     "cuda", "NVIDIA H200")
    text = jax.export.deserialize(bytearray(blob)).mlir_module()
    assert text.count("mosaic_gpu_v2") == 1


def test_shared_inputs_are_timed_on_one_array():
    """A VJP call whose forward got one array as query, key and value is timed and
    checked with one array under the three names, its gradient summed into the first."""
    from tokamax_pass.autotuning import timing_inputs

    x = random_normal(0, (1, 64, 2, 16))
    f = jax.grad(lambda x: tokamax.dot_product_attention(
        x, x, x, implementation="xla_chunked").sum())
    (vjp_ba,) = [ba for ba in tokamax.autotuning.get_bound_args(f, x)
                 if "shared_inputs" in ba.arguments]
    arguments = timing_inputs.timing_arguments(vjp_ba, seed=3)
    assert arguments["key"] is arguments["query"] and arguments["value"] is arguments["query"]
    result = tokamax.autotune(f, x, ignore_cache=True, progress=False, max_configs=2,
                              iterations=1)
    (entry,) = [e for e in result.entries
                if type(e.bound.op).__name__ == "XlaChunkedDotProductAttentionVjp"]
    assert entry.bound.arguments["shared_inputs"] == (("key", "query", "value"),)
    assert entry.data and all(m.ok for m in entry.data.values())  # numerics agree


def test_export_workers_start_without_warnings():
    """A worker as `ExportWorkers` starts it, every warning an error: it starts, serves
    until stdin closes and exits cleanly, printing nothing (not even runpy's "found in
    sys.modules" RuntimeWarning, once per worker)."""
    import os
    import subprocess
    import sys

    from tokamax_pass.autotuning import lowering

    command = [lowering.WORKER_COMMAND[0], "-W", "error", *lowering.WORKER_COMMAND[1:]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(command, input=b"", capture_output=True, env=env, timeout=120,
                          check=False)
    assert done.returncode == 0 and done.stderr == b"" and done.stdout == b"", done.stderr


def test_an_export_worker_answers_apart_from_what_is_written_to_its_stdout():
    """A line native code wrote to the worker's stdout (a compiler's) went into the pickle
    stream the tuning process reads its answers from."""
    import os
    import pickle
    import subprocess
    import sys

    worker = ("import os, sys\n"
              "from tokamax_pass.autotuning import export_worker\n"
              "def noisy(*request):\n"
              "    os.write(1, b'cuda_helpers.cc:12] a line written to fd 1\\n')\n"
              "    return bytearray(b'program')\n"
              "export_worker.export_candidate = noisy\n"
              "export_worker.serve()\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", worker], input=pickle.dumps(("request",)),
                          capture_output=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert pickle.loads(done.stdout) == (True, bytearray(b"program"))
    assert b"a line written to fd 1" in done.stderr


def test_a_function_without_op_calls_is_a_warning_naming_optimize():
    """A model in plain JAX gave an empty result and no hint; the warning names
    `optimize(f, autotune='always')`, which rewrites plain-JAX patterns and tunes them,
    and points at the user's own line."""
    from tokamax_pass.autotuning.api import NothingToTuneWarning

    x = jnp.ones((2, 8))
    with pytest.warns(NothingToTuneWarning, match=r"optimize\(f, autotune='always'\)") as w:
        result = tokamax.autotune(lambda x: jnp.sin(x).sum(), x, progress=False)
    assert len(result) == 0
    assert w[0].filename == __file__
