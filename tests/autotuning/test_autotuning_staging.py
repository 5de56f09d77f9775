"""Two-stage tuning with `all_implementations`: every implementation timed at its
heuristics config, then only those that could be chosen searched (`staging.py`)."""

from __future__ import annotations

import math

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tokamax_pass as tokamax
from _tunable_ops import ChunkConfig, ChunkedMatmul, XlaChunkedMatmul, chunked_matmul
from conftest import random_normal
from tokamax_pass.autotuning import cache, keys, staging
from tokamax_pass.autotuning.entry import Entry, Measurement
from tokamax_pass.core import NullConfig, current_target, selection

M, K, N = 16, 64, 32


@pytest.fixture(autouse=True)
def _empty_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKAMAX_PASS_CACHE_DIR", str(tmp_path / "cache"))


def _calls():
    x = jax.ShapeDtypeStruct((M, K), "float32")
    w = jax.ShapeDtypeStruct((K, N), "float32")
    return [keys.canonical(op.bind(x, w)) for op in (XlaChunkedMatmul(), ChunkedMatmul())]


class _Tuner:
    """Answers `tune_many` from a table of times per (implementation, config); records
    what each stage was asked to time."""

    def __init__(self, times):
        self.times, self.stages = times, []

    def tune_many(self, plans):
        self.stages.append([(type(ba.op).__name__, list(configs)) for ba, configs in plans])
        return [Entry(ba, {c: self._measure(type(ba.op).__name__, c) for c in configs}, {})
                for ba, configs in plans]

    def _measure(self, name, config):
        ms = self.times[name, config]
        if ms is None:
            return Measurement(error="compile error: on purpose")
        return Measurement(evaluation_times_ms=(ms,))


def _plans(chunked_configs):
    chunked, xla = _calls()
    return [[(chunked, chunked_configs), (xla, [NullConfig()])]]


CONFIGS = [ChunkConfig(32), ChunkConfig(16), ChunkConfig(64)]


@pytest.mark.parametrize("first_ms, searched", [
    pytest.param(1.3, False, id="loses-by-more-than-tuning-gains"),
    pytest.param(0.9, True, id="could-win-after-tuning"),
    pytest.param(0.7, True, id="already-wins"),
    pytest.param(None, True, id="first-config-failed"),
])
def test_only_implementations_that_could_be_chosen_are_searched(first_ms, searched):
    times = {("XlaChunkedMatmul", ChunkConfig(32)): first_ms,
             ("XlaChunkedMatmul", ChunkConfig(16)): 0.5,
             ("XlaChunkedMatmul", ChunkConfig(64)): 2.0,
             ("ChunkedMatmul", NullConfig()): 1.0}
    tuner = _Tuner(times)
    told = []
    entries = staging.tune_in_stages(tuner, _plans(CONFIGS), on_stage_two=told.append)
    assert tuner.stages[0] == [("XlaChunkedMatmul", CONFIGS[:1]),
                               ("ChunkedMatmul", [NullConfig()])]
    assert tuner.stages[1] == ([("XlaChunkedMatmul", CONFIGS[1:])] if searched else [])
    assert told == [2 if searched else 0]
    chunked, xla = entries
    assert list(chunked.data) == (CONFIGS if searched else CONFIGS[:1])
    assert list(xla.data) == [NullConfig()]
    assert chunked.best_time_ms == (0.5 if searched else first_ms)


def test_the_gain_and_margins_decide():
    """A kernel 10% slower than XLA at its heuristics config is searched (tuning may gain
    20%); at 30% slower it is not; XLA itself is never a loser to skip."""
    calls = _calls()
    assert staging.worth_searching(calls, [1.1, 1.0]) == [True, True]
    assert staging.worth_searching(calls, [1.3, 1.0]) == [False, True]
    assert staging.worth_searching(calls, [math.inf, 1.0]) == [True, True]


def test_autotune_times_each_implementation_then_searches_the_promising(monkeypatch):
    """End to end on this machine, with the gain forced either way: no hope leaves the
    kernel at its heuristics config; any hope searches its whole space (failing and
    wrong configs recorded as always); `search_losers=True` searches regardless."""
    x, w = random_normal(0, (M, K)), random_normal(1, (K, N))

    def f(x, w):
        return chunked_matmul(x, w)

    def configs_timed(**kwargs):
        result = tokamax.autotune(f, x, w, all_implementations=True, ignore_cache=True,
                                  progress=False, iterations=2, **kwargs)
        return {type(ba.op).__name__: len(data) for ba, data in result}

    monkeypatch.setattr(staging, "TUNING_GAIN", 1e-9)
    assert configs_timed() == {"XlaChunkedMatmul": 5, "ChunkedMatmul": 1}
    monkeypatch.setattr(staging, "TUNING_GAIN", 1e9)
    assert configs_timed() == {"XlaChunkedMatmul": 1, "ChunkedMatmul": 1}
    assert configs_timed(search_losers=True) == {"XlaChunkedMatmul": 5, "ChunkedMatmul": 1}


def test_xla_calls_then_gradient_calls_compile_first_then_each_call_in_turn():
    """Candidates are handed to the compile pool XLA implementations first (their
    compiles take the device for XLA's GEMM autotuning, one at a time), then the
    kernels; within each, VJP calls first (their programs hold the most GEMMs); in every
    round of the round-robin, heuristics configs first."""
    from tokamax_kernels.attention.base import DotProductAttention, DotProductAttentionVjp
    from tokamax_kernels.attention.pallas_triton import (
        PallasTritonFlashAttention,
        PallasTritonFlashAttentionVjp,
    )
    from tokamax_pass.autotuning.autotuner import _Job, _round_robin

    q = jax.ShapeDtypeStruct((2, 64, 2, 16), "bfloat16")
    forward = DotProductAttention().bind(q, q, q)
    gradient = DotProductAttentionVjp().bind(None, q, q, **forward.arguments)
    kernel = PallasTritonFlashAttention().bind(q, q, q)
    kernel_gradient = PallasTritonFlashAttentionVjp().bind(None, q, q, **forward.arguments)
    chunked, _ = _calls()
    jobs = [_Job(kernel, ["k1", "k2"]), _Job(chunked, ["c1", "c2", "c3"]),
            _Job(kernel_gradient, ["kg1"]), _Job(forward, ["f1"]), _Job(gradient, ["g1", "g2"])]
    order = [config for _, config in _round_robin(jobs)]
    assert order == ["g1", "c1", "f1", "kg1", "k1", "g2", "c2", "k2", "c3"]


def test_every_wave_runs_untimed_programs_compiled_ahead(monkeypatch):
    """With one call per wave, every wave prepares its inputs with the random inputs'
    program, the forward reference (a VJP call's residuals) and the reference output
    compiled ahead from abstract shapes; the results are those of compiling them when
    prepared: the chunk that drops K's remainder is still caught as wrong numerics."""
    from tokamax_pass.autotuning import autotuner, timing_inputs

    used, inputs_ahead = [], []
    original = timing_inputs.run_untimed
    original_random = timing_inputs.benchmarking.random_initialize

    def run_untimed(f_std, arrays, compiled=None):
        used.append(compiled is not None)
        return original(f_std, arrays, compiled)

    def random_initialize(arrays, seed, program=None):
        inputs_ahead.append(program is not None)
        return original_random(arrays, seed, program)

    monkeypatch.setattr(timing_inputs, "run_untimed", run_untimed)
    monkeypatch.setattr(timing_inputs.benchmarking, "random_initialize", random_initialize)
    monkeypatch.setattr(autotuner, "OPS_PER_WAVE", 1)
    q = random_normal(0, (2, 32, 2, 16))
    f = jax.grad(lambda q: tokamax.dot_product_attention(
        q, q, q, implementation="xla_chunked").sum())
    calls = discovery_calls(f, q)
    x, w = random_normal(1, (M, K)), random_normal(2, (K, N))
    calls.append(keys.canonical(XlaChunkedMatmul().bind(x, w)))
    entries = autotuner.Autotuner(iterations=2).tune_many([(ba, None) for ba in calls])
    names = [type(e.bound.op).__name__ for e in entries]
    assert names == ["XlaChunkedDotProductAttention", "XlaChunkedDotProductAttentionVjp",
                     "XlaChunkedMatmul"]
    # The attention's reference; the VJP call's forward and reference; the matmul's.
    assert used == [True, True, True, True]
    assert inputs_ahead == [True, True, True]  # the random inputs' programs likewise
    assert all(m.ok for e in entries[:2] for m in e.data.values())
    assert entries[2].data[ChunkConfig(56)].error.startswith("wrong numerics")
    assert entries[2].data[ChunkConfig(16)].ok


def test_one_calls_implementations_share_untimed_programs_and_inputs_in_both_stages(
        monkeypatch):
    """The implementations of one op call are timed on one set of inputs against one
    reference output: compiled once for the tuner (stage two reuses stage one's) and
    prepared once per wave."""
    from tokamax_pass.autotuning import autotuner, timing_inputs

    compiled, prepared = [], []
    original_compile, original_prepare = timing_inputs.compile_untimed, autotuner.Autotuner._prepare

    def compile_untimed(ba, *args):
        compiled.append(type(ba.op).__name__)
        return original_compile(ba, *args)

    def prepare(self, ba, untimed=None):
        prepared.append(type(ba.op).__name__)
        return original_prepare(self, ba, untimed)

    monkeypatch.setattr(timing_inputs, "compile_untimed", compile_untimed)
    monkeypatch.setattr(autotuner.Autotuner, "_prepare", prepare)
    x, w = random_normal(1, (M, K)), random_normal(2, (K, N))
    chunked, plain = (keys.canonical(op.bind(x, w)) for op in (XlaChunkedMatmul(), ChunkedMatmul()))
    tuner = autotuner.Autotuner(iterations=2)
    first = tuner.tune_many([(chunked, [ChunkConfig(16)]), (plain, None)])
    assert compiled == ["XlaChunkedMatmul"] and prepared == ["XlaChunkedMatmul"]
    second = tuner.tune_many([(chunked, [ChunkConfig(32), ChunkConfig(56)])])
    assert compiled == ["XlaChunkedMatmul"]  # stage two: stage one's programs
    assert prepared == ["XlaChunkedMatmul"] * 2
    assert first[0].data[ChunkConfig(16)].ok and first[1].best_time_ms > 0
    assert second[0].data[ChunkConfig(32)].ok
    assert second[0].data[ChunkConfig(56)].error.startswith("wrong numerics")
    other = keys.canonical(XlaChunkedMatmul().bind(random_normal(3, (M, 2 * K)),
                                                   random_normal(4, (2 * K, N))))
    tuner.tune_many([(other, [ChunkConfig(16)])])
    assert compiled == ["XlaChunkedMatmul"] * 2  # another argument spec: its own


def discovery_calls(f, *args):
    from tokamax_pass.autotuning import discovery

    return [keys.canonical(ba) for ba in discovery.get_bound_args(f, *args)]


def test_a_call_partly_answered_by_a_cache_searches_its_other_implementations(monkeypatch):
    """The XLA path's time comes from an active result, so stage one cannot compare the
    kernel with it: the kernel's whole search space is timed, hope or not."""
    from tokamax_pass.autotuning.result import AutotuningResult

    monkeypatch.setattr(staging, "TUNING_GAIN", 1e9)
    x, w = random_normal(0, (M, K)), random_normal(1, (K, N))
    _, xla = _calls()
    cached = Entry(xla, {NullConfig(): Measurement(evaluation_times_ms=(1.0,))},
                   keys.provenance(xla.op))
    with AutotuningResult(current_target().device_kind, [cached]):
        result = tokamax.autotune(lambda x, w: chunked_matmul(x, w), x, w,
                                  all_implementations=True, progress=False, iterations=2)
    assert {type(ba.op).__name__: len(data) for ba, data in result} == {"XlaChunkedMatmul": 5}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(0.01, 100.0), st.just(math.inf)), min_size=3, max_size=3))
def test_the_implementation_none_would_choose_is_always_searched(times):
    """Whatever the first-config times of the layer norm's XLA path and two kernels (with
    the family's 40% kernel margin), the one `None` ranks first on them is searched, as
    is any that failed; and searching is monotone: a faster first time never unsearches."""
    from tokamax_kernels.layer_norm import (
        LayerNorm,
        PallasMosaicTpuLayerNorm,
        PallasTritonLayerNorm,
    )

    x = jax.ShapeDtypeStruct((4096, 2048), "bfloat16")
    scale = jax.ShapeDtypeStruct((2048,), "float32")
    calls = [keys.canonical(op.bind(x, scale))
             for op in (PallasTritonLayerNorm(), PallasMosaicTpuLayerNorm(), LayerNorm())]
    worth = staging.worth_searching(calls, times)
    for i, t in enumerate(times):
        if not math.isfinite(t):
            assert worth[i]
    order = selection.rank_with_evidence(calls, times)
    if order is not None and math.isfinite(times[order[0]]):
        assert worth[order[0]]
    for i, t in enumerate(times):
        if worth[i] and math.isfinite(t):
            faster = [u / 2 if j == i else u for j, u in enumerate(times)]
            assert staging.worth_searching(calls, faster)[i]


def test_kernel_candidates_compile_beside_xla_ones_not_behind_them(monkeypatch):
    """With one thread per pool, a kernel's candidate compiles while an XLA candidate's
    compile is still waiting (as on the device for XLA's GEMM autotuning): one shared
    thread would have run the XLA compile first and the kernel's only after it."""
    import dataclasses
    import threading

    from tokamax_pass.autotuning import autotuner

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class KernelMatmul(XlaChunkedMatmul):
        implementation = "kernel"

    kernel_started = threading.Event()
    waited = []
    original = autotuner.Autotuner._compile_one

    def compile_one(ba, config, workers):
        if isinstance(ba.op, KernelMatmul):
            kernel_started.set()
        else:
            waited.append(kernel_started.wait(timeout=5))
        return original(ba, config, workers)

    monkeypatch.setattr(autotuner.Autotuner, "_compile_one", staticmethod(compile_one))
    x, w = random_normal(1, (M, K)), random_normal(2, (K, N))
    calls = [keys.canonical(op.bind(x, w)) for op in (XlaChunkedMatmul(), KernelMatmul())]
    entries = autotuner.Autotuner(iterations=1, max_workers=1).tune_many(
        [(calls[0], [ChunkConfig(16)]), (calls[1], [ChunkConfig(16)])])
    assert waited == [True]
    assert all(e.data[ChunkConfig(16)].ok for e in entries)


def _measured(ba, config, ms):
    return Entry(ba, {config: Measurement(evaluation_times_ms=(ms,))}, keys.provenance(ba.op))


@pytest.mark.parametrize("kernel_ms, kernel_timed", [
    pytest.param(3.5, False, id="3.5x-slower-is-hopeless"),
    pytest.param(1.5, True, id="1.5x-slower-is-timed"),
])
def test_an_implementation_the_caches_show_hopeless_is_not_timed(kernel_ms, kernel_timed):
    """The caches (here an active result) measured the chunked kernel 3.5x slower than XLA
    at this shape: `autotune` does not compile or time it at all, as no config makes up
    such a gap; at 1.5x it is timed (and searched or not by stage one's rule), and
    `search_losers=True` times it regardless."""
    from tokamax_pass.autotuning.result import AutotuningResult

    x, w = random_normal(0, (M, K)), random_normal(1, (K, N))
    chunked, xla = _calls()
    evidence = AutotuningResult(current_target().device_kind, [
        _measured(chunked, ChunkConfig(16), kernel_ms), _measured(xla, NullConfig(), 1.0)])

    def timed(**kwargs):
        with evidence:
            result = tokamax.autotune(lambda x, w: chunked_matmul(x, w), x, w,
                                      all_implementations=True, ignore_cache=True,
                                      progress=False, iterations=2, **kwargs)
        return {type(ba.op).__name__ for ba, _ in result}

    both = {"XlaChunkedMatmul", "ChunkedMatmul"}
    assert timed() == (both if kernel_timed else {"ChunkedMatmul"})
    assert timed(search_losers=True) == both


def test_a_hopeless_implementation_is_timed_when_what_beat_it_fails():
    """The implementation that made XLA hopeless fails at every stage-one config: XLA is
    timed in stage two (its first config) after all, so the result is never left with
    nothing that runs; where the kernel runs, XLA stays untimed."""
    chunked, xla = _calls()
    plans = [[(chunked, CONFIGS), (xla, [NullConfig()])]]
    beaten = [[None, (0,)]]
    for kernel_ms, xla_timed in ((None, True), (0.3, False)):
        times = {("XlaChunkedMatmul", c): kernel_ms for c in CONFIGS}
        times["ChunkedMatmul", NullConfig()] = 1.0
        tuner = _Tuner(times)
        entries = staging.tune_in_stages(tuner, plans, beaten=beaten)
        assert tuner.stages[0] == [("XlaChunkedMatmul", CONFIGS[:1])]
        assert ((("ChunkedMatmul", [NullConfig()]) in tuner.stages[1]) == xla_timed)
        assert [type(e.bound.op).__name__ for e in entries] == (
            ["XlaChunkedMatmul", "ChunkedMatmul"] if xla_timed else ["XlaChunkedMatmul"])


def test_hopeless_counts_a_plain_gradient_that_reruns_its_forward_at_its_share():
    """`None` counts an XLA gradient that reruns its forward (the dense GLU's products) at
    `RERUN_SHARE` of its lone time; `hopeless` does too, so a kernel 1.5x slower than that
    gradient's lone time is hopeless (3x its share) while the gradient, 2x slower alone,
    is not."""
    from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
    from tokamax_kernels.gated_linear_unit.pallas_triton import PallasTritonGatedLinearUnit
    from tokamax_pass.autotuning.result import AutotuningResult

    x = jax.ShapeDtypeStruct((4096, 2048), "bfloat16")
    weights = jax.ShapeDtypeStruct((2048, 2, 5632), "bfloat16")
    forward = GatedLinearUnit().bind(x, weights)
    dy = jax.ShapeDtypeStruct((4096, 5632), "bfloat16")
    calls = [keys.canonical(op.vjp_op().bind(None, dy, dy, **forward.arguments))
             for op in (PallasTritonGatedLinearUnit(), GatedLinearUnit())]
    kernel, plain = calls
    assert plain.op.reruns_forward(plain) and not kernel.op.reruns_forward(kernel)
    kind = current_target().device_kind
    evidence = [_measured(kernel, next(iter(staging_configs(kernel))), 1.5),
                _measured(plain, NullConfig(), 1.0)]
    with AutotuningResult(kind, evidence):
        assert staging.hopeless(calls, kind) == [(1,), None]
    with AutotuningResult(kind, [_measured(plain, NullConfig(), 1.0)]):
        assert staging.hopeless(calls, kind) == [None, None]  # the kernel not measured


def staging_configs(ba):
    from tokamax_pass.autotuning.autotuner import candidate_configs

    return candidate_configs(ba)


def test_configs_the_caches_measured_losing_at_this_shape_are_not_timed_again(monkeypatch):
    """The caches (here an active result) searched this call's chunked kernel: chunk 16
    won, 64 ran slower, 56 failed. `autotune` starts from 16 and does not time 64 again
    (that search is done); 56 is timed (a failure may not recur), as are the configs
    never measured; `search_losers=True` times every config."""
    from tokamax_pass.autotuning.result import AutotuningResult

    monkeypatch.setattr(staging, "TUNING_GAIN", 1e-9)  # every implementation searched
    x, w = random_normal(0, (M, K)), random_normal(1, (K, N))
    chunked, _ = _calls()
    searched = Entry(chunked, {ChunkConfig(16): Measurement(evaluation_times_ms=(0.5,)),
                               ChunkConfig(64): Measurement(evaluation_times_ms=(0.9,)),
                               ChunkConfig(56): Measurement(error="timeout: on purpose")},
                     keys.provenance(chunked.op))

    def timed(**kwargs):
        with AutotuningResult(current_target().device_kind, [searched]):
            result = tokamax.autotune(lambda x, w: chunked_matmul(x, w), x, w,
                                      all_implementations=True, ignore_cache=True,
                                      progress=False, iterations=2, **kwargs)
        return {c.chunk for ba, data in result if isinstance(ba.op, XlaChunkedMatmul)
                for c in data}

    assert timed() == {16, 32, 56, 0}
    assert timed(search_losers=True) == {16, 32, 56, 64, 0}


def test_measured_losers_come_only_from_the_entry_that_chose_the_first_config():
    """Losers are the other configs that ran in the entry whose fastest is the plan's
    first config; with another first config (or no entry) none are known."""
    from tokamax_pass.autotuning.result import AutotuningResult

    chunked, _ = _calls()
    kind = current_target().device_kind
    entry = Entry(chunked, {ChunkConfig(16): Measurement(evaluation_times_ms=(0.5,)),
                            ChunkConfig(64): Measurement(evaluation_times_ms=(0.9,)),
                            ChunkConfig(0): Measurement(error="compile error: on purpose")},
                  keys.provenance(chunked.op))
    with AutotuningResult(kind, [entry]):
        assert cache.measured_losers(chunked, ChunkConfig(16), kind) == {ChunkConfig(64)}
        assert cache.measured_losers(chunked, ChunkConfig(32), kind) == frozenset()
        assert staging.without_known_losers(
            chunked, [ChunkConfig(16), ChunkConfig(64), ChunkConfig(0), ChunkConfig(32)],
            kind) == [ChunkConfig(16), ChunkConfig(0), ChunkConfig(32)]
    assert cache.measured_losers(chunked, ChunkConfig(16), kind) == frozenset()
