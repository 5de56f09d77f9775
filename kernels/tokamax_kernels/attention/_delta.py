"""The flash backward's `delta` (the softmax Jacobian's row term), shared by the Triton
and Mosaic (GPU, TPU) VJPs.

`delta[b, h, q] = sum_d out * dout` must round the same in every compile (the
reproducible backward), so it is never an XLA reduction: XLA picks a reduction's (or an
einsum's GEMM's) tiling per compile, and a different tiling adds in a different order;
on the H200 an einsum and a plain sum each take one of two values per compile, a fixed
order one (`benchmarks/probes/compile_reproducibility_probe.py`).

On CUDA it is a small Pallas Triton kernel (the preprocessing pass FlashAttention's
backward runs too): one program per block of query rows of one head sums each row in
registers, in the order the compiled kernel fixes. Elsewhere (TPU, CPU) it is a chain of
elementwise adds, column by column, which XLA never reassociates. On the H200 the chain
is many times slower than an XLA sum (a strided read per column), and a pairwise tree of
halves compiles for minutes at head dim 256 (`benchmarks/probes/delta_compile_probe.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Elements of `out` (and of `dout`) one Triton program sums: 64 float32 registers a
# thread at 4 warps.
_BLOCK_ELEMENTS = 8192
_NUM_WARPS = 4


def attention_delta(out: jax.Array, dout: jax.Array,
                     dlse: jax.Array | None = None) -> jax.Array:
    """`delta[b, h, q] = sum_d out * dout` in float32 (minus the lse output's cotangent,
    whose d lse / d logits is p): the softmax Jacobian's row term the flash backward
    kernels take, `(batch, heads, seq)`, summed in a fixed order on every platform."""
    delta = jax.lax.platform_dependent(out, dout, cuda=delta_by_triton,
                                       default=delta_by_chain)
    return delta if dlse is None else delta - dlse.astype(jnp.float32)


def delta_by_chain(out: jax.Array, dout: jax.Array) -> jax.Array:
    """`delta` as a chain of elementwise adds, column by column, in XLA."""
    terms = out.astype(jnp.float32) * dout.astype(jnp.float32)
    total = terms[..., 0]
    for column in range(1, terms.shape[-1]):
        total = total + terms[..., column]
    return jnp.swapaxes(total, 1, 2)


def _delta_kernel(out_ref, dout_ref, delta_ref, *, seq: int, head_dim: int,
                     block_q: int, width: int) -> None:
    rows = pl.program_id(0) * block_q + jnp.arange(block_q)
    inside = (rows[:, None] < seq) & (jnp.arange(width)[None, :] < head_dim)
    out = plgpu.load(out_ref, mask=inside, other=0).astype(jnp.float32)
    dout = plgpu.load(dout_ref, mask=inside, other=0).astype(jnp.float32)
    plgpu.store(delta_ref, jnp.sum(out * dout, axis=1), mask=rows < seq)


def delta_by_triton(out: jax.Array, dout: jax.Array, *, interpret: bool = False
                    ) -> jax.Array:
    """`delta` by a Pallas Triton kernel over `(seq / block_q, batch, heads)` programs,
    read straight from the `(batch, seq, heads, head_dim)` operands (no padding pass: a
    head dim that is not a power of two, or a last partial block, is masked)."""
    batch, seq, heads, head_dim = out.shape
    width = pl.next_power_of_2(head_dim)
    block_q = max(16, min(128, _BLOCK_ELEMENTS // width))
    tile = pl.BlockSpec((None, block_q, None, width), lambda i, b, h: (b, i, h, 0))
    return pl.pallas_call(
        functools.partial(_delta_kernel, seq=seq, head_dim=head_dim, block_q=block_q,
                          width=width),
        grid=(pl.cdiv(seq, block_q), batch, heads), in_specs=[tile, tile],
        out_specs=pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i)),
        out_shape=jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=_NUM_WARPS, num_stages=1),
        interpret=interpret, name="attention_delta")(out, dout)
