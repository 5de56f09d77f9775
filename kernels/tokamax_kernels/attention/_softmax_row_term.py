"""The flash backward's row term, shared by the Triton and Mosaic (GPU, TPU) VJPs."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def softmax_row_term(out: jax.Array, dout: jax.Array,
                     dlse: jax.Array | None = None) -> jax.Array:
    """`delta[b, h, q] = sum_d out * dout` in float32 (minus the lse output's cotangent,
    whose d lse / d logits is p): the softmax Jacobian's row term the flash backward
    kernels take, `(batch, heads, seq)`.

    Summed as a chain of elementwise adds, column by column, not as a reduction: XLA
    picks a reduction's (or an einsum's GEMM's) tiling per compile, and a different
    tiling adds in a different order; the H200 took one of two values per compile with
    an einsum and with a plain sum (`longest_first_bitwise_s14.jsonl`), none with a fixed
    order (`compile_reproducibility_s15.jsonl`). Elementwise adds are never reassociated.
    The chain, not a pairwise tree of halves: both are fixed orders, but the tree took
    52.7 s to compile at head dim 256 against 4.1 s for the chain (and 2.4 s for the
    plain sum), which made the gemma2 step compile in 89 s rather than 28 s
    (`delta_compile_probe_s16.jsonl`)."""
    terms = out.astype(jnp.float32) * dout.astype(jnp.float32)
    total = terms[..., 0]
    for column in range(1, terms.shape[-1]):
        total = total + terms[..., column]
    delta = jnp.swapaxes(total, 1, 2)
    return delta if dlse is None else delta - dlse.astype(jnp.float32)
