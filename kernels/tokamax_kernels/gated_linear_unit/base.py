"""The gated-linear-unit family: argument checks and the XLA reference.

`activation(x @ w_gate) * (x @ w_up)` over the last axis of `x`. The weights come
either fused, one (K, 2, N) array (`[:, 0]` gate, `[:, 1]` up), or as a pair
`(w_gate, w_up)` of (K, N) arrays; `bind` keeps the form given so a kernel can read
the fused layout directly. No residuals: kernels recompute the two products in
the backward pass.

With `group_sizes` (MoE expert GEMMs) the rows of x are grouped and each group has its
own weights, (G, K, 2, N) or a pair of (G, K, N): see `_grouped.py`. Such calls keep
the pre-activations as residuals (as autodiff of the plain expression does) and run the
gradient's GEMMs as ragged dots. Calls without `group_sizes` are unchanged by them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_kernels import _validation as v
from tokamax_kernels.gated_linear_unit._grouped import (
    abstract_gradient_calls,
    check_grouped,
    grouped_backward,
    grouped_forward,
)
from tokamax_kernels.ragged_dot.base import RaggedDot, canonical_precision
from tokamax_pass.core import BoundArguments, Op, Target, VjpOp, spec

_OP = "gated_linear_unit"


def split_weights(weights: Any) -> tuple[Any, Any]:
    """`(w_gate, w_up)`, each (K, N), from either weights form."""
    if isinstance(weights, tuple):
        return weights
    return weights[:, 0], weights[:, 1]


def _products(x: jax.Array, weights: Any, *, precision: Any) -> tuple[jax.Array, jax.Array]:
    """`(x @ w_gate, x @ w_up)`, as a user writes them for either weights form."""
    w_gate, w_up = split_weights(weights)
    return (jnp.matmul(x, w_gate, precision=precision),
            jnp.matmul(x, w_up, precision=precision))


def _check_weights(weights: Any, k: int) -> None:
    if isinstance(weights, (tuple, list)):
        if len(weights) != 2:
            raise ValueError(
                f"{_OP}: weights must be one (K, 2, N) array or a pair (w_gate, w_up), got a "
                f"sequence of {len(weights)}"
            )
        for name, w in zip(("weights[0] (w_gate)", "weights[1] (w_up)"), weights, strict=True):
            v.require_rank(name, w, (2,), op=_OP)
            v.require_float(name, w, op=_OP)
            if w.shape[0] != k:
                raise ValueError(
                    f"{_OP}: {name} must have shape ({k}, N) (K = the last axis of x), got "
                    f"{tuple(w.shape)}"
                )
        if weights[0].shape != weights[1].shape or weights[0].dtype != weights[1].dtype:
            raise ValueError(
                f"{_OP}: w_gate and w_up must have the same shape and dtype, got "
                f"{weights[0].dtype}{tuple(weights[0].shape)} and "
                f"{weights[1].dtype}{tuple(weights[1].shape)}"
            )
        return
    v.require_rank("weights", weights, (3,), op=_OP)
    v.require_float("weights", weights, op=_OP)
    if weights.shape[0] != k or weights.shape[1] != 2:
        raise ValueError(
            f"{_OP}: fused weights must have shape ({k}, 2, N) (K = the last axis of x; "
            f"[:, 0] gate, [:, 1] up), got {tuple(weights.shape)}"
        )


def _check_activation(activation: Callable[[Any], Any], x: Any, weights: Any) -> None:
    """The activation must map the gate pre-activations elementwise: one array in, one of
    the same shape out. Anything else fails inside the op's trace with a message that does
    not name it, or (a reduction, broadcast against `up`) silently gives wrong values."""
    n = (weights[0] if isinstance(weights, tuple) else weights).shape[-1]
    gate = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.promote_types(x.dtype, jnp.float32))
    try:
        out = jax.eval_shape(activation, gate)
    except TypeError as e:
        raise TypeError(f"{_OP}: activation must take one array (the gate), e.g. "
                        f"jax.nn.swish; calling it failed: {e}") from e
    if not spec.is_array(out) or tuple(out.shape) != gate.shape:
        got = f"shape {tuple(out.shape)}" if spec.is_array(out) else type(out).__name__
        raise ValueError(f"{_OP}: activation must be elementwise (the gate's shape "
                         f"{gate.shape} in and out), got {got}")
    if jnp.issubdtype(out.dtype, jnp.complexfloating):  # the cast to x's dtype dropped .imag
        raise ValueError(f"{_OP}: activation must return real values, got {out.dtype}; take "
                         f"the real part or the magnitude inside the activation")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedLinearUnit(Op[Any]):
    """The gated linear unit in XLA, as fast as the expression a user writes.

    The products run in the inputs' dtype (bf16 GEMMs with float32 accumulation for
    bf16 inputs, as `activation(x @ w_gate) * (x @ w_up)` does), so the backward pass
    runs GEMMs of that dtype too; fused (K, 2, N) weights take one (K, 2N) GEMM. The
    activation and the product are computed in float32 inside XLA's elementwise fusion,
    which costs no extra pass over memory.

    With `group_sizes`: `jax.lax.ragged_dot` (one over the (G, K, 2N) view of fused
    weights) and the same float32 activation; the gradient is `GatedLinearUnitVjp`'s.
    """

    # Whether an implementation computes grouped calls (`group_sizes`), and whether it
    # does so under `jax.vmap`. The XLA reference (this class) always does; a kernel
    # says so here.
    grouped: ClassVar[bool] = False
    grouped_under_vmap: ClassVar[bool] = False

    def kernel_margin_for(self, ba: BoundArguments) -> float:
        """Half, for a dense call: the XLA gradient reruns the products, which XLA merges
        with the XLA forward's inside a program, so a kernel forward adds those GEMMs back
        (as the LM head's did: 0.97x on the Llama step). Grouped calls keep residuals."""
        return self.kernel_margin if "group_sizes" in ba.arguments else 0.5

    def similarity_arguments(self, arguments: Any) -> dict[str, Any]:
        """Rows x K: how x's leading axes split does not change the GEMMs' speed."""
        x = arguments["x"]
        rows = jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)
        return {**arguments, "x": rows}

    def partition_rule(self, ba: BoundArguments) -> Any:
        """How a call splits over devices (`tokamax_pass.core.sharding`)."""
        from tokamax_kernels.gated_linear_unit.sharding import partition_rule

        return partition_rule(ba)

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        if "group_sizes" not in ba.arguments:
            return
        if not (self.grouped or type(self) is GatedLinearUnit):
            raise NotImplementedError(
                f"{type(self).__name__} has no grouped form (group_sizes); use "
                "implementation='xla', 'mosaic_gpu' or, on a TPU, 'mosaic_tpu'")
        if ba.vmap and not (self.grouped_under_vmap or type(self) is GatedLinearUnit):
            raise NotImplementedError(
                f"{type(self).__name__} does not run grouped calls (group_sizes) under "
                "jax.vmap; use implementation='xla' or, on a TPU, 'mosaic_tpu'")

    def bind(self, x: Any, weights: Any, *, group_sizes: Any = None,
             activation: Callable[[Any], Any] | None = None,
             precision: Any = None) -> BoundArguments:
        v.require_rank("x", x, range(1, 64), op=_OP)
        v.require_float("x", x, op=_OP)
        weights = tuple(weights) if isinstance(weights, list) else weights
        if group_sizes is None:
            _check_weights(weights, x.shape[-1])
        else:
            check_grouped(x, weights, group_sizes)
        if activation is None:  # the bilinear GLU, as upstream Tokamax reads None
            activation = jax.nn.identity
        if not callable(activation):
            raise ValueError(
                f"{_OP}: activation must be callable (e.g. jax.nn.swish) or None (no "
                f"activation: the bilinear GLU), got "
                f"{activation!r}"
            )
        _check_activation(activation, x, weights)
        # Calls without group_sizes keep the arguments (and so the cache keys) they had.
        grouped = {} if group_sizes is None else {"group_sizes": group_sizes}
        return BoundArguments(self, dict(
            x=x, weights=weights, **grouped,
            activation=activation, precision=canonical_precision(precision, op=_OP),
        ))

    def _fwd(self, x: jax.Array, weights: Any, *, activation: Callable[[Any], Any],
             precision: Any, config: Any, return_residuals: bool,
             group_sizes: jax.Array | None = None) -> tuple[jax.Array, Any]:
        if group_sizes is not None:
            out, residuals = grouped_forward(x, weights, group_sizes, activation=activation,
                                             precision=precision)
            return out, residuals if return_residuals else None
        if isinstance(weights, tuple):
            gate = jnp.matmul(x, weights[0], precision=precision)
            up = jnp.matmul(x, weights[1], precision=precision)
        else:
            k, _, n = weights.shape
            both = jnp.matmul(x, weights.reshape(k, 2 * n), precision=precision)
            gate, up = both[..., :n], both[..., n:]
        wide = jnp.promote_types(gate.dtype, jnp.float32)
        out = activation(gate.astype(wide)) * up.astype(wide)
        return out.astype(x.dtype), None

    def _default_vjp(self) -> Op:
        return GatedLinearUnitVjp()


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedLinearUnitVjp(VjpOp):
    """The GLU gradient in XLA: what autodiff of the plain expression computes.

    The products are recomputed (one (K, 2N) GEMM for fused weights, which XLA merges
    with the forward's when both are in one program); `dgate` and `dup` come out of one
    elementwise fusion in the products' dtype and feed the four GEMMs autodiff of
    `(x @ w[:, 0], x @ w[:, 1])` makes. On the H200, inside `jax.grad`
    (`benchmarks/probes/glu_vjp_variants_probe.py`), that runs at least as fast as the jnp
    expression; the same GEMMs written by hand (einsums, the two `dweights` stacked) are
    no faster, and `[dgate | dup]` concatenated for one GEMM each is slower.

    With `group_sizes`: `dgate` and `dup` from the forward's residuals (no GEMM is
    recomputed), then the ragged dots autodiff of the plain expression runs, each a call
    of `ragged_dot_op()` (the `ragged_dot` family's XLA op here) so each is found, tuned
    and cached as its own shape.
    """

    forward_family = GatedLinearUnit

    def ragged_dot_op(self) -> Op:
        """The `ragged_dot` op that runs a grouped call's gradient GEMMs."""
        return RaggedDot()

    def reruns_forward(self, ba: BoundArguments) -> bool:
        # The products, for a dense call (a grouped one reads the residuals); not kernels.
        return self.implementation == "xla" and "group_sizes" not in ba.arguments

    def evidence_calls(self, ba: BoundArguments) -> list[BoundArguments] | None:
        """A grouped call's gradient ragged dots: it is as fast as they are measured."""
        if "group_sizes" not in ba.arguments:
            return None
        op, arguments = self.ragged_dot_op(), ba.arguments
        return [op.bind(*args, **kwargs).replace(vmap=ba.vmap)
                for _, args, kwargs in abstract_gradient_calls(
                    arguments["x"], arguments["weights"], arguments["group_sizes"],
                    arguments["precision"])]

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        evidence = self.evidence_calls(ba)
        if evidence is None:
            return
        if ba.arguments["residuals"] is None:
            raise NotImplementedError(
                "the grouped gated-linear-unit gradient needs the forward's residuals")
        for call in evidence:
            call.op.check_supported(call, target)

    def _fwd(self, residuals: Any, out: Any, dout: jax.Array, *, config: Any,
             return_residuals: bool, x: jax.Array, weights: Any,
             activation: Callable[[Any], Any], precision: Any,
             group_sizes: jax.Array | None = None) -> tuple[dict[str, Any], None]:
        if group_sizes is not None:
            return grouped_backward(self.ragged_dot_op(), residuals, dout, x=x, weights=weights,
                                    group_sizes=group_sizes, activation=activation,
                                    precision=precision), None
        del residuals, out, config, return_residuals
        if isinstance(weights, tuple):
            gate = jnp.matmul(x, weights[0], precision=precision)
            up = jnp.matmul(x, weights[1], precision=precision)
        else:
            k, _, n = weights.shape
            both = jnp.matmul(x, weights.reshape(k, 2 * n), precision=precision)
            gate, up = both[..., :n], both[..., n:]
        wide = jnp.promote_types(gate.dtype, jnp.float32)
        activated, activation_vjp = jax.vjp(activation, gate.astype(wide))
        dy = dout.astype(wide)
        (dgate,) = activation_vjp(dy * up.astype(wide))
        dgate, dup = dgate.astype(gate.dtype), (dy * activated).astype(gate.dtype)
        # The four gradient GEMMs exactly as autodiff of the user's two products makes
        # them (its primal products are dead code, removed by XLA).
        _, products_vjp = jax.vjp(functools.partial(_products, precision=precision),
                                  x, weights)
        dx, dweights = products_vjp((dgate, dup))
        return {"x": dx, "weights": dweights}, None
