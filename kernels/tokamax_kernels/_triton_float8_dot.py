"""Pallas Triton dots of two float8 operands with Triton's own Hopper accumulation rule.

Triton's `tl.dot` gives a float8 x float8 dot on sm90 `max_num_imprecise_acc = 2**30`:
the tensor cores accumulate a tile's whole contraction themselves. Pallas's lowering
builds the `tt.dot` without the attribute, so it is 0, and Triton then waits for every
`wgmma` and adds its result into a second float32 accumulator: the asynchronous
`wgmma` pipeline stalls on each instruction. `set_float8_imprecise_accumulation(n)`
wraps Pallas Triton's `dot_general` lowering so the `tt.dot` of two float8 operands
carries `maxNumImpreciseAcc = n` (the products of up to `n` contraction values summed in
the tensor cores before each float32 addition); `None` restores Pallas's own rule.
Only dots of two contraction-major tiles (`a (M, K) . b (N, K)`) take it: with a
`(K, N)` `b` tile, the attribute makes Triton's float8 dot several times slower on the
H200 (`benchmarks/probes/quantized_ragged_dot_variants.py`). Other dots are unchanged.
"""

from __future__ import annotations

from typing import Any

from jax import lax
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering

_PALLAS_RULE = lowering.triton_lowering_rules[lax.dot_general_p]
_ATTRIBUTE = "maxNumImpreciseAcc"


def _dot_op(value: Any) -> Any:
    """The `tt.dot` that makes `value` (directly, or through the one cast after it)."""
    for _ in range(2):
        owner = value.owner
        op = getattr(owner, "operation", owner)
        if not isinstance(op, ir.Operation):
            return None
        if op.name == "tt.dot":
            return op
        if len(op.operands) != 1:
            return None
        value = op.operands[0]
    return None


def _is_float8(value: Any) -> bool:
    return str(ir.RankedTensorType(value.type).element_type).startswith("f8")


def _rule(limit: int) -> Any:
    def lower(ctx: Any, a: Any, b: Any, **params: Any) -> Any:
        out = _PALLAS_RULE(ctx, a, b, **params)
        (a_contracting, b_contracting), _ = params["dimension_numbers"]
        if tuple(a_contracting) != (1,) or tuple(b_contracting) != (1,):
            return out  # not both tiles contraction-major
        dot = _dot_op(out)
        if dot is not None and _is_float8(dot.operands[0]) and _is_float8(dot.operands[1]):
            dot.attributes[_ATTRIBUTE] = ir.IntegerAttr.get(
                ir.IntegerType.get_signless(32), limit)
        return out
    return lower


def set_float8_imprecise_accumulation(limit: int | None) -> None:
    """Lower later float8 x float8 Pallas Triton dots with `maxNumImpreciseAcc = limit`
    (`None`: Pallas's rule, the attribute left at 0)."""
    lowering.triton_lowering_rules[lax.dot_general_p] = (
        _PALLAS_RULE if limit is None else _rule(limit))
