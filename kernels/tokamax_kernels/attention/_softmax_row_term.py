"""The flash backward's row term, shared by the Triton and Mosaic (GPU, TPU) VJPs."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def softmax_row_term(out: jax.Array, dout: jax.Array,
                     dlse: jax.Array | None = None) -> jax.Array:
    """`delta[b, h, q] = sum_d out * dout` in float32 (minus the lse output's cotangent,
    whose d lse / d logits is p): the softmax Jacobian's row term the flash backward
    kernels take, `(batch, heads, seq)`.

    Summed in a fixed pairwise order written out as elementwise adds of halves, not as a
    reduction: XLA picks a reduction's (or an einsum's GEMM's) tiling per compile, and a
    different tiling adds in a different order. The reproducible backward must round
    `delta` the same in every compile; elementwise adds are never reassociated. (On the
    H200 the default backward's dq and dk took one of two values per compile at two
    configurations, `longest_first_bitwise_s14.jsonl`, with an einsum and then with a
    plain sum here. This order rules `delta` out as a cause; it has not run there yet.)"""
    terms = out.astype(jnp.float32) * dout.astype(jnp.float32)
    width = 1 << max(terms.shape[-1] - 1, 0).bit_length()
    if width != terms.shape[-1]:  # zeros added in are exact
        terms = jnp.pad(terms, [(0, 0)] * (terms.ndim - 1) + [(0, width - terms.shape[-1])])
    while terms.shape[-1] > 1:
        half = terms.shape[-1] // 2
        terms = terms[..., :half] + terms[..., half:]
    delta = jnp.swapaxes(terms[..., 0], 1, 2)
    return delta if dlse is None else delta - dlse.astype(jnp.float32)
