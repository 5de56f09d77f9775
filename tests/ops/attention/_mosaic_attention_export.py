"""The Mosaic GPU attention's gradient exported for an H200 from CPU (`jax.export` for
`cuda`), with a chosen VJP config: what the CPU tests of the backward's forms lower.
Shared by the one-pass backward, per-K/V-head dk/dv, longest-first and persistent
forward tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from conftest import H200
from tokamax_kernels.attention import (
    PallasMosaicGpuFlashAttention,
    PallasMosaicGpuFlashAttentionVjp,
    dot_product_attention,
)
from tokamax_pass import core


def export_vjp(config, *, fwd_config=None, head_dim=128, kv_heads=2, causal=True,
               **kwargs) -> jax.export.Exported:
    """`(q, k, v, do) -> (dq, dk, dv)` at batch 2, 512 rows, 4 query heads, with the Mosaic
    forward (`fwd_config`, or its heuristics') and `config` for its VJP; `kwargs` go to
    `dot_product_attention`."""
    q = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 512, kv_heads, head_dim), jnp.bfloat16)
    op = PallasMosaicGpuFlashAttention(config=fwd_config,
                                       vjp=PallasMosaicGpuFlashAttentionVjp(config=config))

    def f(q, k, v, do):
        _, pullback = jax.vjp(lambda q, k, v: dot_product_attention(
            q, k, v, is_causal=causal, implementation=op, **kwargs), q, k, v)
        return pullback(do)

    with core.targeting(H200):
        return jax.export.export(jax.jit(f), platforms=["cuda"],
                                 disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(q, kv, kv, q)
