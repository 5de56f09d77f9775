"""VJP ops: backward passes as ops of their own, so they are found, tuned and cached.

A VJP op is called with the forward's residuals, its output, the output's
cotangent and the forward's arguments, and returns the gradients as a dict
keyed by argument name (a missing name means a zero gradient).

When the forward call got one array under several names (`attention(x, x, x)`),
the VJP call also gets `shared_inputs`, those names grouped (`(("key", "query",
"value"),)`), and its gradients come out summed into each group's first name (the
others zero): what autodiff adds up anyway. An op that can compute the sum directly
sets `accepts_shared_inputs` and receives the groups in `_fwd`.

When the forward call returned its residuals as outputs (`call_ops(...,
return_residuals=True)`) and they were differentiated, the VJP call also gets their
cotangent, `dresiduals` (the residuals' structure). Only an op that sets
`accepts_residual_cotangents` takes it; others raise `NotImplementedError`, so
`implementation=None` moves on to one that does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_pass.core import spec
from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.core.hooks import HOOKS
from tokamax_pass.core.op import Op

RESERVED_NAMES = ("residuals", "out", "dout", "shared_inputs", "dresiduals")
SharedInputs = tuple[tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class VjpOp(Op):
    """Base of every VJP op: binds `(residuals, out, dout, **forward_arguments)`."""

    # True if `_fwd` takes `shared_inputs` and returns each group's summed gradient.
    accepts_shared_inputs: ClassVar[bool] = False
    # True if `_fwd` takes `dresiduals`, the cotangent of residuals returned as outputs.
    accepts_residual_cotangents: ClassVar[bool] = False
    # The forward op family whose `similarity_arguments` this VJP op's speed follows.
    forward_family: ClassVar[type[Op] | None] = None

    def similarity_arguments(self, arguments: Any) -> dict[str, Any]:
        """The forward arguments, as the forward family compares them (residuals, output
        and cotangent follow from those)."""
        forward = {k: val for k, val in arguments.items() if k not in RESERVED_NAMES}
        shared = arguments.get("shared_inputs")
        family = self.forward_family
        forward_op = getattr(self, "forward", None)
        if family is None and isinstance(forward_op, Op):
            family = type(forward_op)
        found = family().similarity_arguments(forward) if family is not None else forward
        return {**found, "shared_inputs": shared} if shared else found

    def bind(self, residuals: Any, out: Any, dout: Any, shared_inputs: SharedInputs = (),
             dresiduals: Any = None, **forward_arguments: Any) -> BoundArguments:
        clash = set(RESERVED_NAMES) & set(forward_arguments)
        if clash:
            raise ValueError(f"forward arguments may not be named {sorted(clash)}")
        shared_inputs = _check_shared_inputs(shared_inputs, forward_arguments)
        extra: dict[str, Any] = {"shared_inputs": shared_inputs} if shared_inputs else {}
        if dresiduals is not None:
            if not self.accepts_residual_cotangents:
                raise NotImplementedError(
                    f"{type(self).__name__} cannot differentiate through the forward's "
                    f"residuals (returned as outputs); stop their gradient with "
                    f"jax.lax.stop_gradient or use an implementation whose VJP op can")
            extra["dresiduals"] = dresiduals
        return BoundArguments(
            self, {"residuals": residuals, "out": out, "dout": dout, **forward_arguments, **extra}
        )

    def _fwd(self, residuals: Any, out: Any, dout: Any, *args: Any,
             **forward_arguments: Any) -> tuple[dict[str, Any], None]:
        """The input gradients, from the forward's arguments and the keywords `config` and
        `return_residuals`; each implementation declares the forward arguments it takes."""
        raise NotImplementedError(f"{type(self).__name__} does not define _fwd")

    def _default_vjp(self) -> Op:
        return AutodiffVjp(forward=self.replace(vjp=None))


def _check_shared_inputs(groups: Any, forward_arguments: dict[str, Any]) -> SharedInputs:
    """`groups` as a tuple of name tuples, each name a forward argument of one shape."""
    try:
        groups = tuple(tuple(str(name) for name in group) for group in groups)
    except TypeError:
        raise ValueError(
            f"shared_inputs must be groups of argument names, got {groups!r}") from None
    for group in groups:
        unknown = [name for name in group if name not in forward_arguments]
        if len(group) < 2 or unknown:
            raise ValueError(f"shared_inputs group {group!r} must name two or more forward "
                             f"arguments (unknown: {unknown})")
        shapes = {getattr(forward_arguments[name], "shape", None) for name in group}
        if len(shapes) != 1:
            raise ValueError(f"shared_inputs group {group!r} names arguments of different "
                             f"shapes {sorted(map(str, shapes))}: they cannot be one array")
    return groups


def shared_input_groups(arguments: dict[str, Any]) -> SharedInputs:
    """Groups of top-level argument names bound to one array object (the same traced
    value), in the arguments' pytree (alphabetical) order: a VJP call's `shared_inputs`."""
    by_identity: dict[int, list[str]] = {}
    for name, value in arguments.items():
        if spec.is_array(value):
            by_identity.setdefault(id(value), []).append(name)
    return tuple(tuple(names) for names in by_identity.values() if len(names) > 1)


def differentiable(value: Any) -> bool:
    return spec.is_array(value) and jnp.issubdtype(value.dtype, jnp.inexact)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutodiffVjp(VjpOp):
    """The gradient of `forward` by JAX autodiff of its `_fwd` (for XLA implementations)."""

    forward: Op

    def reference_op(self) -> Op:
        return AutodiffVjp(forward=self.forward.reference_op())

    def reruns_forward(self, ba: BoundArguments) -> bool:
        return self.forward.autodiff_reruns_products

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Any, return_residuals: bool,
             **forward_arguments: Any) -> tuple[dict[str, Any], None]:
        from tokamax_pass.core.selection import resolve_config

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


def complete_gradients(grads: dict[str, Any], forward_arguments: dict[str, Any],
                       shared_inputs: SharedInputs = ()) -> dict[str, Any]:
    """`grads` with the forward arguments' structure: zeros where a float input got no
    gradient, `None` for inputs that have none (ints, bools, statics); each group of
    `shared_inputs` summed into its first name (see the module docstring)."""
    grads = _sum_shared(dict(grads or {}), forward_arguments, shared_inputs)

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


def _sum_shared(grads: dict[str, Any], forward_arguments: dict[str, Any],
                shared_inputs: SharedInputs) -> dict[str, Any]:
    for first, *rest in shared_inputs:
        if not differentiable(forward_arguments[first]):
            continue
        dtype = forward_arguments[first].dtype
        wide = jnp.promote_types(dtype, jnp.float32)
        found = [grads.get(name) for name in (first, *rest)]
        parts: list[jax.Array] = [p.astype(wide) for p in found if p is not None]
        grads[first] = sum(parts[1:], parts[0]).astype(dtype) if parts else None
        for name in rest:
            grads[name] = None
    return grads


HOOKS.vjp_base = VjpOp
HOOKS.autodiff_vjp = AutodiffVjp
