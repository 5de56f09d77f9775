"""VJP ops: backward passes as ops of their own, so they are found, tuned and cached.

A VJP op is called with the forward's residuals, its output, the output's
cotangent and the forward's arguments, and returns the gradients as a dict
keyed by argument name (a missing name means a zero gradient).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_pass.core import spec
from tokamax_pass.core.op import BoundArguments, Op

RESERVED_NAMES = ("residuals", "out", "dout")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VjpOp(Op):
    """Base of every VJP op: binds `(residuals, out, dout, **forward_arguments)`."""

    def bind(self, residuals: Any, out: Any, dout: Any, **forward_arguments: Any) -> BoundArguments:
        clash = set(RESERVED_NAMES) & set(forward_arguments)
        if clash:
            raise ValueError(f"forward arguments may not be named {sorted(clash)}")
        return BoundArguments(
            self, {"residuals": residuals, "out": out, "dout": dout, **forward_arguments}
        )

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Any, return_residuals: bool,
             **forward_arguments: Any) -> tuple[dict[str, Any], None]:
        raise NotImplementedError(f"{type(self).__name__} does not define _fwd")

    def _default_vjp(self) -> Op:
        return AutodiffVjp(forward=self.replace(vjp=None))


def differentiable(value: Any) -> bool:
    return spec.is_array(value) and jnp.issubdtype(value.dtype, jnp.inexact)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutodiffVjp(VjpOp):
    """The gradient of `forward` by JAX autodiff of its `_fwd` (for XLA implementations)."""

    forward: Op

    def reference_op(self) -> Op:
        return AutodiffVjp(forward=self.forward.reference_op())

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Any, return_residuals: bool,
             **forward_arguments: Any) -> tuple[dict[str, Any], None]:
        from tokamax_pass.core.resolution import resolve_config

        forward = self.forward
        abstract = BoundArguments(forward, forward_arguments)
        forward_config, _ = resolve_config(forward, abstract)
        leaves, treedef = jax.tree.flatten(forward_arguments, is_leaf=lambda v: v is None)
        diff_index = [i for i, leaf in enumerate(leaves) if differentiable(leaf)]

        def fwd(*diff_leaves: Any) -> Any:
            new_leaves = list(leaves)
            for i, leaf in zip(diff_index, diff_leaves, strict=True):
                new_leaves[i] = leaf
            arguments = jax.tree.unflatten(treedef, new_leaves)
            return forward._fwd(**arguments, config=forward_config, return_residuals=False)[0]

        _, pullback = jax.vjp(fwd, *(leaves[i] for i in diff_index))
        grads = pullback(dout)
        grad_leaves: list[Any] = [None] * len(leaves)
        for i, grad in zip(diff_index, grads, strict=True):
            grad_leaves[i] = grad
        return jax.tree.unflatten(treedef, grad_leaves), None


def complete_gradients(grads: dict[str, Any], forward_arguments: dict[str, Any]) -> dict[str, Any]:
    """`grads` with the forward arguments' structure: zeros where a float input got no
    gradient, `None` for inputs that have none (ints, bools, statics)."""

    def complete(arg: Any, grad: Any) -> Any:
        if not differentiable(arg):
            return None
        if grad is None:
            return jnp.zeros(arg.shape, arg.dtype)
        if grad.shape != arg.shape:
            raise ValueError(f"gradient of shape {grad.shape} for an argument of shape {arg.shape}")
        return grad.astype(arg.dtype)

    result = {}
    for name, arg in forward_arguments.items():
        grad = grads.get(name) if grads else None
        if grad is None:
            grad = jax.tree.map(lambda _: None, arg, is_leaf=lambda v: v is None)
        result[name] = jax.tree.map(complete, arg, grad, is_leaf=lambda v: v is None)
    return result
