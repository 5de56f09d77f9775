"""Which measured shapes stand in for an unmeasured call (`autotuning.neighbours`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from tokamax_kernels.attention.base import DotProductAttention, DotProductAttentionVjp
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_triton_vjp import PallasTritonLayerNormVjp
from tokamax_pass.autotuning import keys, neighbours
from tokamax_pass.core import selection


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_distance_is_finite_only_within_the_ratio_for_every_size():
    assert neighbours.distance((1024, 64), (1024, 64)) == 0
    assert neighbours.distance((1024, 64), (2048, 64)) == 1
    assert neighbours.distance((1024, 64), (2048, 32)) == 2
    assert neighbours.distance((1024, 64), (4096, 64)) == math.inf
    assert neighbours.distance((1024, 64), (1024, 64, 1)) == math.inf
    assert neighbours.distance((0, 64), (1, 64)) == math.inf


def test_norms_compare_rows_by_features_whatever_the_scale_offset_and_split():
    a = keys.similarity(LayerNorm().bind(_sds((4, 4096, 2048)), _sds((2048,), jnp.float32)))
    b = keys.similarity(LayerNorm().bind(_sds((16384, 2048)), _sds((2048,)), _sds((2048,))))
    assert a == b
    rms = keys.similarity(LayerNorm().bind(_sds((16384, 2048)), None, subtract_mean=False))
    assert rms[0] != a[0]  # RMSNorm is another kind of call
    f32 = keys.similarity(LayerNorm().bind(_sds((16384, 2048), jnp.float32), None))
    assert f32[0] != a[0]


def test_a_vjp_compares_as_its_forward_call():
    x, scale = _sds((8, 1024, 512)), _sds((512,), jnp.float32)
    forward = LayerNorm().bind(x, scale)
    mean = _sds((8, 1024), jnp.float32)
    vjp = PallasTritonLayerNormVjp().bind((mean, mean), x, x, x=x, scale=scale, offset=None,
                                          axis=2, epsilon=1e-6, subtract_mean=True)
    assert keys.similarity(vjp)[1] == keys.similarity(forward)[1]


def test_attention_keeps_head_dim_exact_and_merges_batch_with_heads():
    def sim(b, s, h, kv, d):
        q, k = _sds((b, s, h, d)), _sds((b, s, kv, d))
        return keys.similarity(DotProductAttention().bind(q, k, k, is_causal=True))

    assert sim(4, 4096, 16, 4, 128)[1] == sim(8, 4096, 8, 2, 128)[1]
    assert sim(4, 4096, 16, 4, 128)[0] == sim(8, 4096, 8, 2, 128)[0]
    assert sim(4, 4096, 16, 4, 128)[0] != sim(4, 4096, 16, 4, 64)[0]  # head dim
    q = _sds((2, 256, 4, 64))
    forward = DotProductAttention().bind(q, q, q)
    vjp = DotProductAttentionVjp().bind(None, q, q, **forward.arguments)
    assert keys.similarity(vjp)[1] == keys.similarity(forward)[1]


def _gemma(seq, heads, kv_heads, window, causal=True, head_dim=256):
    q, k = _sds((2, seq, heads, head_dim)), _sds((2, seq, kv_heads, head_dim))
    return keys.similarity(DotProductAttention().bind(
        q, k, k, is_causal=causal, logits_soft_cap=50.0, local_window_size=window))


def test_attention_group_and_window_reach_are_sizes():
    """Gemma-2's local and global layers, its head splits and window lengths are one
    kind of call: what differs is sized like a sequence length, and compared by ratio."""
    measured = _gemma(8192, 8, 4, (4096, 0))
    for call, steps in [(_gemma(8192, 8, 4, (2048, 0)), 1.0),   # half the window
                        (_gemma(8192, 8, 4, None), 1.0),        # global: the whole sequence
                        (_gemma(8192, 8, 2, (4096, 0)), 1.0),   # GQA group 4, not 2
                        (_gemma(8192, 8, 4, (4096, 4096)), 0.0)]:  # causal: right is moot
        assert call[0] == measured[0]
        assert neighbours.distance(call[1], measured[1]) == pytest.approx(steps, abs=1e-3)
    assert neighbours.distance(_gemma(8192, 8, 4, (1024, 0))[1], measured[1]) == math.inf
    assert _gemma(8192, 8, 4, (4096, 0), head_dim=128)[0] != measured[0]
    assert _gemma(8192, 8, 4, (4096, 4096), causal=False)[0] != measured[0]
    both_ways = _gemma(8192, 8, 4, (4096, 4096), causal=False)[1]
    assert neighbours.distance(_gemma(8192, 8, 4, None, causal=False)[1], both_ways) == (
        pytest.approx(2.0, abs=1e-3))


def test_size_like_values_must_be_positive():
    from tokamax_pass.core import SizeLike

    with pytest.raises(ValueError, match="SizeLike: value must be >= 1"):
        SizeLike(0)


def test_glu_merges_leading_axes():
    w = _sds((2048, 2, 5632))
    a = keys.similarity(GatedLinearUnit().bind(_sds((4, 4096, 2048)), w))
    b = keys.similarity(GatedLinearUnit().bind(_sds((16384, 2048)), w))
    assert a == b


def test_a_gemma2_layer_at_another_window_borrows_the_measured_layers_choice(
        monkeypatch, tmp_path):
    """`None` on a local layer with a 2048 window, and on a global layer, of a model whose
    4096-window layer was measured (only these measurements: no shipped or user cache)."""
    import tokamax_pass as tokamax
    from tokamax_kernels.attention import PallasMosaicGpuFlashAttention, cudnn
    from tokamax_pass import core
    from tokamax_pass.autotuning import cache
    from tokamax_pass.autotuning.entry import Entry, Measurement
    from tokamax_pass.autotuning.result import AutotuningResult

    monkeypatch.setenv("TOKAMAX_PASS_CACHE_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(cache, "library_cache_dir", lambda kind: tmp_path / "none")
    monkeypatch.setattr(cudnn, "_require_cudnn_library", lambda: None)
    cache.library_result.cache_clear()
    cache._USER.invalidate()
    q, k = _sds((2, 8192, 8, 256)), _sds((2, 8192, 4, 256))

    def measured(op, ms):
        ba = keys.canonical(op.bind(q, k, k, is_causal=True, logits_soft_cap=50.0,
                                    local_window_size=(4096, 0)))
        with core.targeting("NVIDIA H200"):
            config = ba.heuristics_config
        return Entry(ba, {config: Measurement((ms,))}, keys.provenance(op))

    def chosen(window):
        f = lambda q, k: tokamax.dot_product_attention(
            q, k, k, is_causal=True, logits_soft_cap=50.0, local_window_size=window)
        with core.targeting("NVIDIA H200"):
            (row,) = tokamax.optimize(f).plan(q, k)
        return row.op

    def measurements(mosaic_ms):
        return AutotuningResult("NVIDIA H200", [
            measured(DotProductAttention(), 7.0),
            measured(PallasMosaicGpuFlashAttention(), mosaic_ms)])

    try:
        with measurements(0.7):  # Mosaic 10x XLA, as on the H200
            assert chosen((2048, 0)) == chosen(None) == "PallasMosaicGpuFlashAttention"
            assert chosen((1024, 0)) == "PallasMosaicGpuFlashAttention"  # far, dominant
        with measurements(5.0):  # a win, not a dominant one: the far window is not lent
            assert chosen((2048, 0)) == "PallasMosaicGpuFlashAttention"
            assert chosen((1024, 0)) == "DotProductAttention"
        assert chosen((2048, 0)) == "DotProductAttention"  # nothing measured
    finally:
        cache.library_result.cache_clear()
        cache._USER.invalidate()


def _attention_vjps(shape):
    """cuDNN's, the Mosaic kernel's and XLA's gradient of one self-attention call."""
    from tokamax_kernels.attention import (
        CudnnDotProductAttentionVjp,
        PallasMosaicGpuFlashAttentionVjp,
        XlaDotProductAttentionVjp,
    )

    x = _sds(shape)
    lse = _sds((shape[0], shape[2], shape[1]), jnp.float32)
    forward = DotProductAttention().bind(x, x, x).arguments
    return [keys.canonical(op.bind((lse,), x, x, **forward))
            for op in (CudnnDotProductAttentionVjp(), PallasMosaicGpuFlashAttentionVjp(),
                       XlaDotProductAttentionVjp())]


def test_unmeasured_xla_attention_yields_to_measured_cudnn_except_on_tiny_calls():
    """XLA's attention, not measured, counts as slower than a measured cuDNN (a device
    sweep), so a kernel measured faster than cuDNN runs; on the tiny calls where cuDNN
    lost that sweep it does not yield, and nothing measured can rank the candidates."""
    large = _attention_vjps((4, 2048, 8, 64))
    assert selection.rank_with_evidence(large, [10.0, 8.0, None]) == [1, 0, 2]
    assert selection.rank_with_evidence(large, [10.0, 9.9, None]) == [0, 2]  # within the margin
    assert selection.rank_with_evidence(large, [None, 8.0, None]) is None
    tiny = _attention_vjps((1, 128, 8, 128))
    assert selection.rank_with_evidence(tiny, [10.0, 8.0, None]) is None
    assert selection.rank_with_evidence(tiny, [10.0, 8.0, 12.0]) == [1, 0, 2]


def test_a_measured_cudnn_this_machine_cannot_lower_still_bounds_unmeasured_xla():
    """A CPU machine exporting for cuda cannot lower cuDNN (`CannotLowerHere`), but the
    target's measurement of it still says XLA is slower: a kernel measured faster than
    cuDNN runs, cuDNN is never listed, and a kernel slower than cuDNN settles nothing."""
    large = _attention_vjps((4, 2048, 8, 64))
    no_cudnn = [False, True, True]
    assert selection.rank_with_evidence(large, [10.0, 8.0, None], no_cudnn) == [1, 2]
    assert selection.rank_with_evidence(large, [10.0, 9.9, None], no_cudnn) is None
    assert selection.rank_with_evidence(large, [10.0, 9.9, 30.0], no_cudnn) == [1, 2]
    assert selection.rank_with_evidence(large, [10.0, 9.9, 9.0], no_cudnn) == [2]
    assert selection.rank_with_evidence(large, [10.0, 8.0, None], [True] * 3) == [1, 0, 2]
    tiny = _attention_vjps((1, 128, 8, 128))
    assert selection.rank_with_evidence(tiny, [10.0, 8.0, None], no_cudnn) is None


def test_a_neighbour_with_cudnn_measured_and_xla_not_lends_its_measurements(monkeypatch):
    """A site where cuDNN and the kernel were measured, XLA not, is a neighbour."""
    large = _attention_vjps((4, 2048, 8, 64))
    site = _attention_vjps((4, 4096, 8, 64))

    class Layer:
        label = "test"

    index = {keys.similarity(ba)[0]: {keys.similarity(ba)[1]: ms}
             for ba, ms in zip(site[:2], (10.0, 8.0), strict=True)}
    monkeypatch.setattr(neighbours, "_index", lambda layer: index)
    assert neighbours.nearest_times(large, [Layer()]) == [10.0, 8.0, None]


def test_a_neighbour_says_which_kernels_win_the_calls_own_times_which_is_fastest():
    """A tuned result timed both kernels at the call's shape but not XLA (hopeless at the
    neighbour, so `autotune` skipped it): the neighbour, where all three were measured,
    says both kernels beat XLA; the call's own times rank them, Mosaic first, though
    Triton was faster at the neighbour. A kernel the neighbour shows losing stays out of
    the lead whatever its own time."""
    from tokamax_kernels.layer_norm import (
        LayerNorm,
        PallasMosaicTpuLayerNorm,
        PallasTritonLayerNorm,
    )
    from tokamax_pass.autotuning import cache
    from tokamax_pass.autotuning.entry import Entry, Measurement
    from tokamax_pass.autotuning.result import AutotuningResult
    from tokamax_pass.core import NullConfig, current_target

    ops = (PallasTritonLayerNorm(), PallasMosaicTpuLayerNorm(), LayerNorm())

    def calls(rows):
        x, scale = _sds((rows, 2048)), _sds((2048,), jnp.float32)
        return [keys.canonical(op.bind(x, scale)) for op in ops]

    def measured(ba, ms):
        from tokamax_pass.autotuning.autotuner import candidate_configs

        config = candidate_configs(ba)[0] if ba.op.config_cls is not NullConfig else NullConfig()
        return Entry(ba, {config: Measurement(evaluation_times_ms=(ms,))},
                     keys.provenance(ba.op))

    kind = current_target().device_kind
    here, near = calls(4096), calls(8192)

    def rank(neighbour_ms, own_ms):
        library = AutotuningResult(
            kind, [measured(b, t) for b, t in zip(near, neighbour_ms, strict=True)])
        tuned = AutotuningResult(kind, [measured(b, t) for b, t in zip(here, own_ms, strict=False)])
        with library, tuned:
            return cache.SOURCE.rank(here, kind)

    assert rank([0.5, 0.55, 1.0], [0.40, 0.20]) == [1, 0, 2]
    assert rank([0.5, 0.9, 1.0], [0.40, 0.20]) == [0, 2]  # Mosaic lost at the neighbour


def test_a_neighbour_lends_within_twice_a_size_and_not_at_two_and_a_half(monkeypatch):
    """Rows 2x the call's lend their times; rows 2.5x do not, as the kernel's win there
    (1.25x) is short of the far neighbours' dominant win."""
    from tokamax_kernels.layer_norm import PallasTritonLayerNorm

    class Layer:
        label = "test"

    def calls(rows):
        x, scale = _sds((rows, 2048)), _sds((2048,), jnp.float32)
        return [keys.canonical(op.bind(x, scale)) for op in (PallasTritonLayerNorm(), LayerNorm())]

    def measured_at(rows):
        index: dict = {}
        for ba, ms in zip(calls(rows), (8.0, 10.0), strict=True):
            category, sizes = keys.similarity(ba)
            index.setdefault(category, {})[sizes] = ms
        return index

    monkeypatch.setattr(neighbours, "_index", lambda layer: measured_at(2048))
    assert neighbours.nearest_times(calls(1024), [Layer()]) == [8.0, 10.0]
    assert neighbours.nearest_times(calls(4096), [Layer()]) == [8.0, 10.0]
    monkeypatch.setattr(neighbours, "_index", lambda layer: measured_at(2560))
    assert neighbours.nearest_times(calls(1024), [Layer()]) == [None, None]
    assert neighbours.nearest_times(calls(6400), [Layer()]) == [None, None]
