"""The Mosaic GPU attention forward and dq kernels with `longest_first`: causal calls
launch their query blocks last to first (`_mosaic_gpu_common.query_block`).

On CPU: numerics in Pallas's GPU interpret mode against the float32 HIGHEST reference
(GQA, cross attention both ways, a causal window, key lengths, d64/d128/d256), the
kernels bitwise equal to the ascending order (a block's work does not depend on when it
runs), the traced program unchanged without a causal mask, lowering for an H200, and
the config checks. Interpret mode runs the grid in order, so the launch order itself is
the device's to measure: `tests/gpu/test_mosaic_attention_gpu.py -k longest_first` and
`tests/gpu/longest_first_probe.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _mosaic_attention_export import export_vjp
from _mosaic_attention_interpreted import interpreted, statics
from _mosaic_gpu_interpret import interpret_mode
from conftest import H200, random_normal
from tokamax_kernels.attention import (
    PallasMosaicGpuFlashAttention,
    PallasMosaicGpuFlashAttentionVjp,
)
from tokamax_kernels.attention._mosaic_gpu_bwd_kernels import (
    mosaic_attention_dkv,
    mosaic_attention_dq,
    mosaic_attention_fused_bwd,
)
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)
from tokamax_kernels.attention._mosaic_gpu_fwd_kernel import mosaic_attention_forward
from tokamax_pass import core


def _fwd(**fields) -> MosaicAttentionConfig:
    return MosaicAttentionConfig(longest_first=True, **({"block_kv": 64} | fields))


def _vjp(**fields) -> MosaicAttentionVjpConfig:
    return MosaicAttentionVjpConfig(longest_first=True, **fields)


@pytest.mark.parametrize("shape, window, lengths, config, vjp_config", [
    # GQA, two forward blocks of 2 x 64 rows and four dq blocks of 64 (one warpgroup).
    pytest.param((2, 256, 256, 4, 2, 64), None, None, _fwd(), _vjp(compute_wgs=1),
                 id="gqa-d64"),
    # More keys than queries (top-left aligned: most keys hidden), MQA; two blocks each.
    pytest.param((2, 128, 256, 2, 1, 64), None, None, _fwd(compute_wgs=1),
                 _vjp(compute_wgs=1), id="more-keys-mqa-d64", marks=pytest.mark.slow),
    # d256: two dq warpgroups split the head dim of shared rows (`q_base` from qi alone).
    pytest.param((2, 192, 192, 2, 1, 256), None, None, _fwd(compute_wgs=1), _vjp(),
                 id="gqa-d256-split", marks=pytest.mark.slow),
    # A causal window (its block range starts from qi too) and key lengths.
    pytest.param((2, 256, 256, 2, 2, 64), (100, 0), None, _fwd(compute_wgs=1),
                 _vjp(compute_wgs=1), id="window-d64", marks=pytest.mark.slow),
    pytest.param((2, 256, 256, 2, 1, 128), None, (200, 37), _fwd(), _vjp(),
                 id="lengths-d128"),
])
def test_interpreted_causal_matches_reference(shape, window, lengths, config, vjp_config):
    interpreted(shape, statics(True, window, None, lengths), config, vjp_config, seed=7)


def _inputs(b, sq, sk, h, hk, d):
    q, do = (random_normal(i, (b, sq, h, d), jnp.bfloat16) for i in (1, 2))
    k, v = (random_normal(i, (b, sk, hk, d), jnp.bfloat16) for i in (3, 4))
    return q, k, v, do


def test_kernels_match_the_ascending_order_bitwise():
    """Each block does the same work whenever it runs: out, lse and dq equal the
    default order's bit for bit (a block that read its tiles by one index and masked
    them by another would not). More queries than keys: the last query blocks see
    every key."""
    q, k, v, do = _inputs(2, 256, 128, 2, 1, 64)
    kwargs = dict(scale=0.3, causal=True)

    def run(longest_first):
        out, lse = mosaic_attention_forward(
            q, k, v, config=MosaicAttentionConfig(block_kv=64, longest_first=longest_first),
            **kwargs)
        delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
        dq = mosaic_attention_dq(
            q, k, v, do, lse, jnp.swapaxes(delta, 1, 2),
            config=MosaicAttentionVjpConfig(compute_wgs=1, longest_first=longest_first),
            **kwargs)
        return out, lse, dq

    with interpret_mode():
        got, want = run(True), run(False)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def _program(kernel, config, *, causal, window=None, head_dim=128, kv_heads=2):
    q = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 512, kv_heads, head_dim), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((2, 4, 512), jnp.float32)
    args = (q, kv, kv) if kernel is mosaic_attention_forward else (q, kv, kv, q, vec, vec)
    kwargs = dict(scale=0.3, causal=causal, config=config, window=window)
    with core.targeting(H200):
        return str(jax.make_jaxpr(lambda *a: kernel(*a, **kwargs))(*args))


@pytest.mark.parametrize("kernel, fields", [
    (mosaic_attention_forward, dict()),
    (mosaic_attention_forward, dict(block_q=128, compute_wgs=1)),
    (mosaic_attention_dq, dict()),
    (mosaic_attention_dq, dict(compute_wgs=1)),
])
@pytest.mark.parametrize("window", [None, (100, 50)])
def test_without_a_causal_mask_the_program_is_unchanged(kernel, fields, window):
    config = (MosaicAttentionConfig if kernel is mosaic_attention_forward
              else MosaicAttentionVjpConfig)
    on, off = config(longest_first=True, **fields), config(**fields)
    assert (_program(kernel, on, causal=False, window=window)
            == _program(kernel, off, causal=False, window=window))
    assert (_program(kernel, on, causal=True, window=window)
            != _program(kernel, off, causal=True, window=window))


@pytest.mark.parametrize("kernel, fields", [
    (mosaic_attention_dkv, dict()),
    (mosaic_attention_dkv, dict(group_in_block=True)),
    (mosaic_attention_fused_bwd, dict(dq_accumulation="ordered", compute_wgs=1)),
])
def test_the_dkv_kernel_ignores_it(kernel, fields):
    """The dk/dv kernel is already longest first; fused, there is no dq kernel."""
    on, off = _vjp(**fields), MosaicAttentionVjpConfig(**fields)
    assert _program(kernel, on, causal=True) == _program(kernel, off, causal=True)


@pytest.mark.parametrize("head_dim, kv_heads, kwargs", [
    (128, 2, dict()),
    (64, 1, dict(local_window_size=(200, 0))),
    (256, 2, dict(key_value_seq_lengths=jnp.array([300, 77], jnp.int32))),
])
def test_lowers_for_h200(head_dim, kv_heads, kwargs):
    """Forward, dq and dk/dv kernels, causal, with the option on both configs."""
    exported = export_vjp(_vjp(), fwd_config=_fwd(compute_wgs=1 if head_dim == 256 else 2),
                          head_dim=head_dim, kv_heads=kv_heads, **kwargs)
    assert exported.mlir_module().count("mosaic_gpu_v2") == 3


def test_configs_are_validated():
    for config in (MosaicAttentionConfig, MosaicAttentionVjpConfig):
        with pytest.raises(ValueError, match="longest_first must be a bool"):
            config(longest_first=1)
        assert config().longest_first is False


def _vjp_call(q, kv, *, is_causal, local_window_size):
    return PallasMosaicGpuFlashAttentionVjp().bind(
        (jax.ShapeDtypeStruct(q.shape[:1] + q.shape[2:3] + q.shape[1:2], jnp.float32),),
        q, q, query=q, key=kv, value=kv, bias=None, mask=None, scale=0.1,
        is_causal=is_causal, query_seq_lengths=None, key_value_seq_lengths=None,
        local_window_size=local_window_size, logits_soft_cap=None, precision=None)


@pytest.mark.parametrize("shape, kwargs, picked", [
    # The four measured workloads' kinds (`longest_first.jsonl`): causal d128 and d64,
    # MHA and GQA, and one unmeasured size of the same kind.
    ((4, 8192, 16, 16, 128), dict(), True),
    ((4, 4096, 32, 8, 128), dict(), True),
    ((8, 2048, 16, 16, 64), dict(), True),
    ((2, 1024, 8, 1, 128), dict(), True),
    # Not measured: a causal window, head dim 256; without a causal mask it is a no-op.
    ((2, 4096, 8, 4, 128), dict(local_window_size=(1024, 0)), False),
    ((2, 4096, 8, 4, 256), dict(), False),
    ((4, 4096, 16, 4, 128), dict(is_causal=False), False),
])
def test_heuristics_pick_it_where_measured(shape, kwargs, picked):
    """Heuristics and the search spaces launch causal blocks longest first at head dim
    <= 128 without a window, where the device measured it faster; elsewhere grid order."""
    b, s, h, hk, d = shape
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, hk, d), jnp.bfloat16)
    call = dict(is_causal=True, local_window_size=None) | kwargs
    with core.targeting(H200):
        fwd = PallasMosaicGpuFlashAttention().bind(q, kv, kv, **call)
        vjp_op = PallasMosaicGpuFlashAttentionVjp()
        vjp = _vjp_call(q, kv, **call)
        configs = [fwd.heuristics_config, *fwd.autotuning_configs,
                   vjp_op._get_heuristics_config(vjp), *vjp_op._get_autotuning_configs(vjp)]
    assert len(configs) > 2
    assert {c.longest_first for c in configs} == {picked}
