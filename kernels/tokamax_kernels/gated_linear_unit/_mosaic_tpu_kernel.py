"""The Pallas Mosaic TPU kernel of the dense gated linear unit.

`glu_forward` computes `activation(x @ w_gate) * (x @ w_up)` for `x` (M, K) over the
grid (row blocks, column blocks, contraction steps). A step multiplies its
(`block_m`, `block_k`) tile of x by the matching (`block_k`, `block_n`) tiles of both
weights on the MXU, adding into two float32 VMEM accumulators; the last contraction step
applies the activation and the product in float32 and writes the (`block_m`, `block_n`)
output tile in x's dtype, so the (M, N) pre-activations never reach HBM. Fused (K, 2, N)
weights are read in place through their free (K, 2N) view: the gate tile of column block
`j` is block `j`, the up tile block `j + N / block_n` (the up half starts at column N).

The contraction axis is "arbitrary" (it carries the accumulators), the other two
"parallel" (TPUs with two TensorCores split them). `block_k` divides K and `block_n`
divides N (the caller checks). Rows: the last row block of a row count it does not
divide reads past x's end (unspecified values on a TPU, NaN in Pallas's interpreter);
rows are independent, so those rows' outputs are simply dropped on write.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax._src.pallas.mosaic import lowering as mosaic_lowering
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tokamax_kernels._mosaic_tpu import compiler_params


def _primitives(jaxpr: Any) -> set[Any]:
    found = set()
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found |= _primitives(sub)
    return found


def check_activation(activation: Callable[[Any], Any]) -> None:
    """`NotImplementedError` unless `activation` is elementwise float32 code that Mosaic
    TPU lowers (it has no rule for `erfc`, which exact gelu uses), so a call with one it
    cannot lower falls back instead of failing to compile."""
    tile = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    try:
        closed = jax.make_jaxpr(activation)(tile)
    except Exception as e:  # noqa: BLE001 - any failure to trace means: not here
        raise NotImplementedError(f"the Mosaic TPU GLU could not trace activation "
                                  f"{activation!r}: {e}") from None
    outs = closed.out_avals
    if len(outs) != 1 or outs[0].shape != tile.shape or outs[0].dtype != tile.dtype:
        raise NotImplementedError(f"the Mosaic TPU GLU needs an elementwise activation "
                                  f"(float32 in, same shape out), got {outs}")
    rules = mosaic_lowering.lowering_rules[pltpu.CoreType.TC]
    missing = sorted(p.name for p in _primitives(closed.jaxpr) if p not in rules)
    if missing:
        raise NotImplementedError(
            f"Mosaic TPU cannot lower {missing} in activation {activation!r} (exact gelu "
            "uses erfc): use gelu(approximate=True) or implementation='xla'")


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` in float32; float32 operands at full precision (bf16 products are exact)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _glu_kernel(x_ref, gate_ref, up_ref, out_ref, gate_acc, up_acc, *,
                activation: Callable[[Any], Any], steps: int) -> None:
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _zero():
        gate_acc[...] = jnp.zeros_like(gate_acc)
        up_acc[...] = jnp.zeros_like(up_acc)

    x = x_ref[...]
    gate_acc[...] += _dot(x, gate_ref[...])
    up_acc[...] += _dot(x, up_ref[...])

    @pl.when(kk == steps - 1)
    def _store():
        out_ref[...] = (activation(gate_acc[...]) * up_acc[...]).astype(out_ref.dtype)


def vmem_bytes(block_m: int, block_n: int, block_k: int, itemsize: int) -> int:
    """VMEM of one grid step: double-buffered x, gate and up tiles and output tile, the
    two float32 accumulators, and two float32 output-sized temporaries of the epilogue
    (the activation and the product)."""
    inputs = 2 * (block_m * block_k + 2 * block_k * block_n) * itemsize
    output = 2 * block_m * block_n * itemsize
    return inputs + output + 4 * block_m * block_n * 4


def glu_forward(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, *, up_offset: int,
                activation: Callable[[Any], Any], block_m: int, block_n: int,
                block_k: int, interpret: Any) -> jax.Array:
    """(M, N) `activation(x @ w_gate) * (x @ w_up)` in x's dtype for `x` (M, K).

    `w_gate` and `w_up` are (K, N) matrices, or both the (K, 2N) view of fused weights
    with `up_offset` = N (the column where the up half starts; 0 for a pair)."""
    m, k = x.shape
    n = w_gate.shape[1] - up_offset
    steps = k // block_k
    up_blocks = up_offset // block_n
    itemsize = jnp.dtype(x.dtype).itemsize
    return pl.pallas_call(
        functools.partial(_glu_kernel, activation=activation, steps=steps),
        grid=(pl.cdiv(m, block_m), n // block_n, steps),
        in_specs=[pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((block_k, block_n), lambda i, j, kk: (kk, j)),
                  pl.BlockSpec((block_k, block_n), lambda i, j, kk: (kk, j + up_blocks))],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)] * 2,
        compiler_params=compiler_params(("parallel", "parallel", "arbitrary"),
                                        vmem_bytes(block_m, block_n, block_k, itemsize)),
        interpret=interpret,
        name="tokamax_glu_forward",
    )(x, w_gate, w_up)
