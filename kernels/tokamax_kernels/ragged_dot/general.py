"""`ragged_dot_general`: `jax.lax.ragged_dot_general`'s signature, as upstream Tokamax has it.

The two forms an MoE layer uses, `(m, k) x (g, k, n)` and its transposed weights
`(m, k) x (g, n, k)`, run through the `ragged_dot` family (every implementation, tuned
as any ragged dot). Other dimension numbers (ragged contracting dimensions, batch
dimensions) run in the `xla` implementation only, `jax.lax.ragged_dot_general` itself,
with the gradient of the ragged contracting form of two matrices, in either layout
(which `jax.lax` lacks), as two ragged dots;
naming only kernels for them raises `NotImplementedError`.

Quantized operands (`quantized.py`) run as in `ragged_dot` in the two MoE forms; in the
others they are dequantized first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_kernels import _dispatch
from tokamax_kernels.ragged_dot.api import (
    FAMILY,
    check_forward_options,
    check_upstream_hints,
    ragged_dot,
    with_activation,
)
from tokamax_kernels.ragged_dot.base import RaggedDot
from tokamax_kernels.ragged_dot.group_sizes import RaggedDotGroupSizes
from tokamax_kernels.ragged_dot.quantization import as_quantized_array, dequantize, is_quantized
from tokamax_pass.core.registry import Implementation

DEFAULT_DIMENSION_NUMBERS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
TRANSPOSED_RHS_DIMENSION_NUMBERS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


RAGGED_CONTRACTING_DIMENSION_NUMBERS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ragged_contracting(lhs: Any, rhs: Any, group_sizes: Any, precision: Any,
                        out_type: Any) -> Any:
    """`(m, k) x (m, n) -> (g, k, n)`, each group's rows contracted: the weight gradient
    of an MoE layer. `jax.lax` has no gradient for it; its gradients are ragged dots."""
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes,
                                      RAGGED_CONTRACTING_DIMENSION_NUMBERS,
                                      precision=precision, preferred_element_type=out_type)


def _ragged_contracting_fwd(lhs: Any, rhs: Any, group_sizes: Any, precision: Any,
                            out_type: Any) -> tuple[Any, Any]:
    return _ragged_contracting(lhs, rhs, group_sizes, precision, out_type), (
        lhs, rhs, group_sizes)


def _ragged_contracting_bwd(precision: Any, out_type: Any, residuals: Any,
                            dout: Any) -> tuple[Any, Any, None]:
    del out_type
    lhs, rhs, group_sizes = residuals
    # Row i of group g: dlhs[i] = dout[g] @ rhs[i], drhs[i] = lhs[i] @ dout[g].
    dlhs = ragged_dot(rhs, jnp.swapaxes(dout, 1, 2).astype(rhs.dtype), group_sizes, precision,
                      preferred_element_type=lhs.dtype, implementation="xla")
    drhs = ragged_dot(lhs, dout.astype(lhs.dtype), group_sizes, precision,
                      preferred_element_type=rhs.dtype, implementation="xla")
    return dlhs, drhs, None


_ragged_contracting.defvjp(_ragged_contracting_fwd, _ragged_contracting_bwd)


def _ragged_contracting_operands(lhs: Any, rhs: Any,
                                 numbers: jax.lax.RaggedDotDimensionNumbers
                                 ) -> tuple[Any, Any] | None:
    """`(lhs, rhs)` transposed to `(m, k) x (m, n)` where the two are matrices contracting
    one dimension, the ragged one, in either layout (`jax.lax.ragged_dot_general` orders
    the output `(g, lhs's other dimension, rhs's other dimension)` in every layout);
    else `None`."""
    (lhs_contracting, rhs_contracting), batch = numbers.dot_dimension_numbers
    if (lhs.ndim != 2 or rhs.ndim != 2 or any(batch) or numbers.rhs_group_dimensions
            or len(lhs_contracting) != 1
            or list(numbers.lhs_ragged_dimensions) != list(lhs_contracting)):
        return None
    return (lhs if lhs_contracting[0] == 0 else lhs.T,
            rhs if rhs_contracting[0] == 0 else rhs.T)


def _same(a: jax.lax.RaggedDotDimensionNumbers, b: jax.lax.RaggedDotDimensionNumbers) -> bool:
    def canonical(d: jax.lax.RaggedDotDimensionNumbers) -> Any:
        (lc, rc), (lb, rb) = d.dot_dimension_numbers
        return (tuple(lc), tuple(rc), tuple(lb), tuple(rb), tuple(d.lhs_ragged_dimensions),
                tuple(d.rhs_group_dimensions))
    return canonical(a) == canonical(b)


def _names_xla(implementation: Implementation) -> bool:
    if implementation is None:
        return True
    items = ([implementation] if isinstance(implementation, (str, RaggedDot))
             else list(implementation) if isinstance(implementation, Sequence) else [])
    return any(item == "xla" or type(item) is RaggedDot for item in items)


def ragged_dot_general(
    lhs: Any, rhs: Any, group_sizes: Any,
    ragged_dot_dimension_numbers: jax.lax.RaggedDotDimensionNumbers,
    precision: Any = None, preferred_element_type: Any = None, group_offset: Any = None,
    activation: Callable[[Any], Any] | None = None, manual_axis_type: Any = None, *,
    implementation: Implementation = None, bypass_device_check: bool | None = None,
    zero_initialize: bool = False, fuse_gateup_activation: str | None = None,
) -> Any:
    """`jax.lax.ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers)`,
    with `ragged_dot`'s `activation` and `implementation` (see the module docstring for
    which dimension numbers run where). A function in `implementation` is called as
    `f(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, **keywords)` with the
    `precision` and `preferred_element_type` given (`jax.lax.ragged_dot_general` is one).
    `fuse_gateup_activation` splits the output's last dimension, as in `ragged_dot`;
    `bypass_device_check`, `manual_axis_type` and `zero_initialize` are accepted and
    change nothing, as in `ragged_dot`."""
    check_upstream_hints("ragged_dot_general", bypass_device_check, manual_axis_type)
    check_forward_options("ragged_dot_general", zero_initialize, fuse_gateup_activation)
    numbers = ragged_dot_dimension_numbers
    if not isinstance(numbers, jax.lax.RaggedDotDimensionNumbers):
        raise TypeError(f"ragged_dot_general: ragged_dot_dimension_numbers must be a "
                        f"jax.lax.RaggedDotDimensionNumbers, got {numbers!r}")
    if group_offset is not None:
        raise NotImplementedError("ragged_dot_general: group_offset is not supported")
    if isinstance(group_sizes, RaggedDotGroupSizes):
        group_sizes = group_sizes.value

    def call(out_type: Any) -> Any:
        keywords = {k: x for k, x in (("precision", precision),
                                      ("preferred_element_type", out_type)) if x is not None}
        return _dispatch.call(
            implementation,
            lambda impl: _general(lhs, rhs, group_sizes, numbers, precision, out_type, impl),
            lambda f: f(lhs, rhs, group_sizes, numbers, **keywords), op="ragged_dot_general")

    return with_activation(call, lhs, rhs, preferred_element_type, activation,
                           fuse_gateup_activation)


def _general(lhs: Any, rhs: Any, group_sizes: Any,
             numbers: jax.lax.RaggedDotDimensionNumbers, precision: Any, out_type: Any,
             implementation: Implementation) -> Any:
    """`ragged_dot_general` for an `implementation` free of functions, no activation."""
    if _same(numbers, DEFAULT_DIMENSION_NUMBERS):
        return ragged_dot(lhs, rhs, group_sizes, precision, out_type,
                          implementation=implementation)
    if _same(numbers, TRANSPOSED_RHS_DIMENSION_NUMBERS):
        rhs = (as_quantized_array(rhs).swapaxes(1, 2) if is_quantized(rhs)
               else jnp.swapaxes(rhs, 1, 2))
        return ragged_dot(lhs, rhs, group_sizes, precision, out_type,
                          implementation=implementation)
    if not _names_xla(implementation):
        raise NotImplementedError(
            f"ragged_dot_general: dimension numbers {numbers} run in the 'xla' "
            f"implementation only (jax.lax.ragged_dot_general), not in "
            f"{implementation!r}; the kernels take (m, k) x (g, k, n) and (g, n, k)")
    FAMILY.resolve(implementation)  # unknown names: the family's ValueError
    # Quantized operands in other forms: dequantized (their cotangents are zeros).
    lhs, rhs = (jax.lax.stop_gradient(dequantize(x)) if is_quantized(x) else x
                for x in (lhs, rhs))
    contracted_first = _ragged_contracting_operands(lhs, rhs, numbers)
    if contracted_first is not None:
        return _ragged_contracting(*contracted_first, group_sizes, precision, out_type)
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, numbers, precision=precision,
                                      preferred_element_type=out_type)
