"""Making an op call: the candidates checked and bound to the arguments, the
`tokamax_call` primitive bound (`core.primitive`), and its gradient routed through the
candidates' VJP ops by a `custom_vjp`.

`Op.__call__` and a family's function reach `call_ops` through `HOOKS.call_ops`, set
when this module is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.custom_derivatives import SymbolicZero

from tokamax_pass.core import device, errors, sharding, spec
from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.core.hooks import HOOKS
from tokamax_pass.core.op import Op, family_class
from tokamax_pass.core.primitive import OpCall, bind_partitioned, varying_axes
from tokamax_pass.core.vjp import VjpOp, shared_input_groups


def _is_none(value: Any) -> bool:
    return value is None


def _make_call(bas: Sequence[BoundArguments], explicit: bool, partition_as: Op | None = None,
               rejected: Sequence[str] = ()) -> tuple[OpCall, list[Any]]:
    leaves, treedef = jax.tree.flatten(dict(bas[0].arguments), is_leaf=_is_none)
    statics, operands = [], []
    names = jax.tree_util.tree_flatten_with_path(dict(bas[0].arguments), is_leaf=_is_none)[0]
    for i, ((path, _), leaf) in enumerate(zip(names, leaves, strict=True)):
        if spec.is_array(leaf):
            operands.append(leaf)
            continue
        try:
            hash(leaf)
        except TypeError:
            raise TypeError(
                f"argument {jax.tree_util.keystr(path)} of {type(bas[0].op).__name__} must be an "
                f"array or a hashable static value, got {type(leaf).__name__}"
            ) from None
        statics.append((i, leaf))
    call = OpCall(
        candidates=tuple(ba.op for ba in bas),
        treedef=treedef,
        statics=tuple(statics),
        num_leaves=len(leaves),
        explicit=explicit,
        partition_as=partition_as,
        rejected=tuple(rejected),
    )
    return call, [jax.numpy.asarray(x) if isinstance(x, np.ndarray) else x for x in operands]

def _uniformly_varying(operands: Sequence[Any]) -> list[Any]:
    """Inside `jax.shard_map`, operands `pvary`'d to every manual axis any of them varies
    over, as JAX's own ops do: a replicated input's gradient is then summed over devices."""
    varying = varying_axes([jax.typeof(x) for x in operands])
    return [x if jax.typeof(x).mat.varying == varying else jax.lax.pcast(
        x, tuple(sorted(varying - jax.typeof(x).mat.varying)), to="varying") for x in operands]

def _bind(call: OpCall, operands: Sequence[Any]) -> Any:
    treedef, _ = call.output_structure(operands)
    return jax.tree.unflatten(treedef, bind_partitioned(call, operands))


def _cotangents(call: OpCall, operands: Sequence[Any], grads: dict[str, Any]) -> tuple[Any, ...]:
    grad_leaves = jax.tree.flatten(grads, is_leaf=_is_none)[0]
    cotangents: list[Any] = []
    for i, operand in zip(call.operand_indices, operands, strict=True):
        grad = grad_leaves[i]
        if grad is None and spec.has_symbolic_dims([operand]):
            cotangents.append(None)  # `custom_vjp` reads `None` as a zero cotangent
            continue
        if grad is None:
            grad = np.zeros(operand.shape, jax.dtypes.float0)
        cotangents.append(sharding.like_operand(grad, operand))
    return tuple(cotangents)


def _instantiated(cotangent: Any) -> Any:
    """A cotangent with its symbolic zeros made arrays."""
    return jax.tree.map(
        lambda c: jax.numpy.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c,
        cotangent, is_leaf=lambda c: isinstance(c, SymbolicZero))


def _all_symbolic_zeros(cotangent: Any) -> bool:
    return all(isinstance(c, SymbolicZero) for c in jax.tree.leaves(
        cotangent, is_leaf=lambda c: isinstance(c, SymbolicZero)))


def bind_with_vjp(call: OpCall, operands: Sequence[Any]) -> Any:
    """Binds the call; its gradient goes through the candidates' VJP ops, told which
    arguments were one array (`shared_inputs`, see `core.vjp`).

    A call with `return_residuals` set returns `(out, residuals)`: the residuals are
    outputs the caller may differentiate. Their cotangent reaches the VJP ops as
    `dresiduals`, left out when it is a symbolic zero (the caller used only `out`), so
    such a backward pass is the ordinary one and any VJP op can run it.
    """
    shared = shared_input_groups(call.arguments(operands))
    residual_outputs = call.return_residuals
    differentiated = _with_own_residuals(call, operands) or call

    @jax.custom_vjp
    def op_call(*operands: Any) -> Any:
        return _bind(call, operands)

    def op_call_fwd(*operands: Any) -> tuple[Any, Any]:
        if residual_outputs:  # `symbolic_zeros=True` wraps each primal
            operands = tuple(p.value for p in operands)
        out, residuals = _bind(dataclasses.replace(differentiated, return_residuals=True),
                               operands)
        primal_out = (out, residuals) if residual_outputs else out
        return primal_out, (operands, out, residuals)

    def op_call_bwd(saved: Any, cotangent: Any) -> tuple[Any, ...]:
        operands, out, residuals = saved
        arguments = call.arguments(operands)
        vjp_ops = tuple(dict.fromkeys(op.vjp_op() for op in differentiated.candidates))
        extra: dict[str, Any] = {"shared_inputs": shared} if shared else {}
        dout = cotangent
        if residual_outputs:
            dout, dresiduals = cotangent
            dout = _instantiated(dout)
            if not _all_symbolic_zeros(dresiduals):
                extra["dresiduals"] = _instantiated(dresiduals)
        grads = call_ops(
            vjp_ops, (), dict(residuals=residuals, out=out, dout=dout, **arguments, **extra),
            explicit=differentiated.explicit, partition_as=differentiated.candidates[0],
            through_vjp_ops=False,
        )
        return _cotangents(call, operands, grads)

    op_call.defvjp(op_call_fwd, op_call_bwd, symbolic_zeros=residual_outputs)
    return op_call(*operands)


def _with_own_residuals(call: OpCall, operands: Sequence[Any]) -> OpCall | None:
    """`call` narrowed to the implementation it picks here, config pinned, where that one
    keeps residuals of its own form (`Op.keeps_own_residuals`); otherwise `None`, and the
    implementation is picked at lowering. A call's residuals get their shapes when it is
    traced, so their form cannot wait for the lowering's choice."""
    if not any(op.keeps_own_residuals() for op in call.candidates):
        return None
    avals = [jax.typeof(x) for x in operands]
    if spec.has_symbolic_dims(avals):
        return None
    candidates = [call.bound(op, avals) for op in call.candidates]
    try:
        choice = call.choose(candidates, device.current_target())
    except NotImplementedError:
        return None
    if not choice.op.keeps_own_residuals():
        return None
    # Explicit: the choice is made; the lowering and the VJP call keep it.
    return dataclasses.replace(call, candidates=(choice.op,), explicit=True)


def _check_op_fields(op: Op) -> None:
    """`TypeError` for a pinned config or VJP op of the wrong kind: unchecked, a config of
    another class failed deep in the kernel (`'int' object has no attribute 'block_q'`) or
    was silently ignored, and a bad `vjp` failed only under `jax.grad`."""
    config = op.config
    if config is not None and not isinstance(config, op.config_cls):
        raise TypeError(
            f"{type(op).__name__}: config must be a {op.config_cls.__name__} or None (None "
            f"resolves one), got {config!r}")
    vjp = op.vjp
    if vjp is None:
        return
    try:
        example = f"{type(op.replace(vjp=None).vjp_op()).__name__}()"
    except Exception:  # noqa: BLE001 - only the message's example
        example = "a VjpOp subclass"
    if not isinstance(vjp, VjpOp):
        raise TypeError(f"{type(op).__name__}: vjp must be a VJP op (e.g. {example}) or "
                        f"None (the default), got {type(vjp).__name__}")
    differentiates = _differentiated_family(vjp)
    if differentiates is not None and differentiates is not family_class(type(op)):
        raise TypeError(
            f"{type(op).__name__}: vjp={type(vjp).__name__}() is the gradient of another "
            f"family ({differentiates.__name__}); pass a VJP op of "
            f"{family_class(type(op)).__name__} (e.g. {example}) or None (the default)")


def _differentiated_family(vjp: Any) -> type[Op] | None:
    """The op family whose gradient `vjp` computes, where it says (None: any)."""
    forward = type(vjp).forward_family
    if forward is None and isinstance(getattr(vjp, "forward", None), Op):
        forward = type(vjp.forward)
    return None if forward is None else family_class(forward)


def _require_values(ba: BoundArguments) -> None:
    """`ValueError` naming an argument given as a `jax.ShapeDtypeStruct`: `bind` takes
    them (autotuning binds shapes), but a call needs values; JAX's own error named no
    argument (`Argument 'args[1]' ... is not a valid JAX type`)."""
    for name, value in ba.arguments.items():
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(value)):
            raise ValueError(
                f"{ba.op.family_name()}: {name} must be an array, got a jax.ShapeDtypeStruct "
                f"(a shape without values); pass an array, or call the function under "
                f"jax.eval_shape, tokamax_pass.autotune or export to trace it with shapes")


def _check_supported(op: Op, ba: BoundArguments, target: Any) -> None:
    """`op.check_supported`, where a kernel's check that compares a symbolic dimension
    (`jax.export.symbolic_shape`: a multiple of 8 for some sizes, not for others) is a
    `NotImplementedError`, so the next implementation runs the call, as the lowering
    keeps the XLA reference for symbolic shapes."""
    try:
        op.check_supported(ba, target)
    except jax.errors.InconclusiveDimensionOperation as e:
        raise NotImplementedError(
            f"needs every dimension known (symbolic shapes run the XLA reference, "
            f"implementation='xla'): {' '.join(str(e).split()[:8])}") from None


def call_ops(ops: Sequence[Op], args: Sequence[Any], kwargs: dict[str, Any], *,
             explicit: bool, partition_as: Op | None = None, through_vjp_ops: bool = True,
             return_residuals: bool = False) -> Any:
    """Calls the first of `ops` that accepts the arguments (and, if `explicit`, this device;
    when tracing for devices that are not here, the device is checked at lowering).

    `return_residuals=True` returns `(out, residuals)`, the residuals differentiable (see
    `bind_with_vjp`); the candidates of one call share the family's residual form.

    `ValueError` from `bind` (bad input) propagates at once; `NotImplementedError`
    moves on to the next candidate and is re-raised when none is left. The call's
    gradient goes through its VJP ops unless `through_vjp_ops=False` (a VJP op's own
    call: its derivative, for second-order gradients, is the primitive's JVP rule).
    """
    target = device.current_target()
    # Traced for devices that are not here (an export, maybe for several platforms at
    # once), a list of implementations keeps those that run on another platform: each
    # platform's lowering picks its own ("mosaic" = the Mosaic GPU and TPU kernels).
    device_check = explicit and not (len(ops) > 1 and device.abstract_only())
    for op in ops:
        _check_op_fields(op)
    bound, failures = [], []
    for op in ops:
        try:
            ba = op.bind(*args, **kwargs)
            _require_values(ba)
            _check_supported(op, ba, target if device_check else None)
        except NotImplementedError as e:
            if explicit and len(ops) == 1:
                raise
            failures.append((type(op).__name__, e))
            continue
        bound.append(ba)
    if not bound:
        raise errors.all_failed("no implementation supports these inputs:", failures)
    reasons = [f"{name}: {e}" for name, e in failures]
    call, operands = _make_call(bound, explicit, partition_as, reasons if explicit else ())
    call = dataclasses.replace(call, return_residuals=return_residuals)
    operands = _uniformly_varying(operands)
    return bind_with_vjp(call, operands) if through_vjp_ops else _bind(call, operands)


HOOKS.call_ops = call_ops
