"""The inputs every candidate config of an op call is timed and checked on.

Concrete arrays in the `BoundArguments` are used as given (valid integer data such as
group sizes); abstract ones are random (normal floats, ints in [0, 128), fair bools). An
op that needs structured inputs defines `random_arguments(self, ba, seed) -> dict[str,
Any]` returning the arguments to time with (written in jax, traceable with a traced
`seed`, so it compiles ahead as one program). A VJP op gets real `out` and `residuals`
from its forward family's XLA reference (found through a `forward` op field, like
`AutodiffVjp`'s, or the registered family whose VJP op it is), and the same array for
the argument names grouped in its `shared_inputs`. Those programs run once and are never
timed (`Untimed`), so they compile without XLA's GEMM autotuning.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from tokamax_pass import benchmarking
from tokamax_pass.autotuning.lowering import call_op
from tokamax_pass.core import registry, spec
from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.core.op import Op, family_class
from tokamax_pass.core.vjp import RESERVED_NAMES, VjpOp

# Compiler options of the programs that run once and are never timed (a VJP call's
# residuals, the reference outputs): XLA's GEMM autotuning, which runs on the device
# and serializes with the candidates' compiles, would only make them compile slower.
UNTIMED_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


def operand_shapes(ba: BoundArguments) -> dict[str, Any]:
    """Abstract arguments with the vmapped axes of `ba.vmap` put back in front."""
    arguments = dict(ba.arguments)
    if not ba.vmap:
        return arguments
    leaves, treedef = jax.tree.flatten(arguments, is_leaf=lambda v: v is None)
    operand = [i for i, leaf in enumerate(leaves) if spec.is_array(leaf)]
    for level in reversed(ba.vmap):
        for axis, i in zip(level.axes, operand, strict=True):
            if axis is not None:
                leaf = leaves[i]
                leaves[i] = jax.ShapeDtypeStruct((level.size, *leaf.shape), leaf.dtype)
    return jax.tree.unflatten(treedef, leaves)


def _array_leaves(arguments: dict[str, Any]) -> tuple[list[Any], Any, list[int]]:
    leaves, treedef = jax.tree.flatten(arguments, is_leaf=lambda v: v is None)
    return leaves, treedef, [i for i, leaf in enumerate(leaves) if spec.is_array(leaf)]


def _randomize(arguments: dict[str, Any], seed: int,
               program: Callable[[int], list[Any]] | None = None) -> dict[str, Any]:
    """`arguments` with their abstract arrays made random (by `program`, compiled ahead,
    where given)."""
    leaves, treedef, index = _array_leaves(arguments)
    made = benchmarking.random_initialize([leaves[i] for i in index], seed, program)
    for i, value in zip(index, made, strict=True):
        leaves[i] = value
    return jax.tree.unflatten(treedef, leaves)


def forward_reference(op: Op) -> Op | None:
    """The XLA reference of the forward op whose gradient the VJP op `op` computes."""
    forward = getattr(op, "forward", None)
    if isinstance(forward, Op):
        return forward.reference_op()
    vjp_family = family_class(type(op))
    for family in registry.families().values():
        for cls in family.implementations.values():
            try:
                if isinstance(cls().vjp_op(), vjp_family):
                    return cls().reference_op()
            except Exception:  # noqa: BLE001 - an op that cannot say is not the one
                continue
    return None


def _forward_program(ba: BoundArguments, arguments: dict[str, Any]
                     ) -> tuple[Callable[[Any], Any], list[Any]] | None:
    """`(f_std, arrays)` of the forward reference that gives the VJP call `ba` its `out`
    and `residuals` (arrays abstract where `arguments` are), or `None` (no such forward)."""
    reference = forward_reference(ba.op)
    if reference is None or ba.vmap:
        return None
    forward_args = {k: v for k, v in arguments.items() if k not in RESERVED_NAMES}
    config = reference._get_heuristics_config(BoundArguments(reference, forward_args))

    def forward(**kwargs: Any) -> Any:
        return reference._fwd(**kwargs, config=config, return_residuals=True)

    return benchmarking.standardize_function(forward, kwargs=forward_args, seed=None)


def _with_real_residuals(ba: BoundArguments, arguments: dict[str, Any],
                         compiled: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """A VJP op's arguments with `out` and `residuals` from its forward reference (run by
    `compiled`, the program compiled ahead from abstract shapes, where given)."""
    program = _forward_program(ba, arguments)
    if program is None:
        return arguments
    out, residuals = run_untimed(*program, compiled)
    return {**arguments, "out": out, "residuals": residuals}


def _untimed_jit(f_std: Callable[[Any], Any]) -> Any:
    return jax.jit(f_std, compiler_options=UNTIMED_COMPILER_OPTIONS)


def run_untimed(f_std: Callable[[Any], Any], arrays: Any,
                 compiled: Callable[[Any], Any] | None = None) -> Any:
    """`f_std(arrays)` run once, by the program compiled ahead where it takes these arrays
    (a call whose concrete arguments differ from its abstract ones compiles here)."""
    if compiled is not None:
        try:
            return compiled(arrays)
        except (TypeError, ValueError):
            pass
    return _untimed_jit(f_std)(arrays)


def _vjp_arguments(ba: BoundArguments, arguments: dict[str, Any]) -> dict[str, Any]:
    """Names the forward call got one array under stay one array (`shared_inputs`)."""
    for first, *rest in arguments.get("shared_inputs", ()):
        arguments.update(dict.fromkeys(rest, arguments[first]))
    return arguments


def timing_arguments(ba: BoundArguments, seed: int,
                     forward: Callable[[Any], Any] | None = None,
                     random: Callable[[int], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The arguments every config of `ba` is timed and checked on (`random` and
    `forward`: the call's random arguments and the VJP call's forward reference, compiled
    ahead: `Untimed`). An op's `random_arguments` hook gives a VJP call's residuals
    itself."""
    hook = getattr(ba.op, "random_arguments", None)
    if random is not None:
        arguments = dict(random(seed))
    elif hook is not None:
        arguments = dict(hook(ba, seed))
    else:
        arguments = _randomize(operand_shapes(ba), seed)
    if hook is None and isinstance(ba.op, VjpOp):
        arguments = _with_real_residuals(ba, _vjp_arguments(ba, arguments), forward)
    return arguments


def compiled_hook(ba: BoundArguments, seed: int) -> Callable[[int], dict[str, Any]] | None:
    """The op's `random_arguments` hook compiled now as one program (`None` where it
    cannot be traced: it then runs as written when the wave is prepared). Run op by op,
    each of its random draws and casts compiled a program of its own when prepared."""
    hook = getattr(ba.op, "random_arguments", None)
    if hook is None:
        return None
    traced: dict[str, Any] = {}

    def arrays(seed: jax.Array) -> list[jax.Array]:
        leaves, treedef = jax.tree.flatten(dict(hook(ba, seed)), is_leaf=lambda v: v is None)
        index = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
        traced.update(leaves=leaves, treedef=treedef, index=index)
        return [leaves[i] for i in index]

    try:
        compiled = _untimed_jit(arrays).lower(seed).compile()
    except Exception:  # noqa: BLE001 - a hook that needs concrete values runs eagerly
        return None

    def make(seed: int) -> dict[str, Any]:
        leaves = list(traced["leaves"])
        for i, value in zip(traced["index"], compiled(seed), strict=True):
            leaves[i] = value
        return jax.tree.unflatten(traced["treedef"], leaves)

    return make


@dataclasses.dataclass(frozen=True)
class Untimed:
    """A call's programs that run once and are never timed (the random inputs, the VJP
    call's forward reference, the reference output), compiled ahead from abstract shapes
    while earlier calls are timed, so preparing a wave runs them without compiling them."""

    forward: Callable[[Any], Any] | None
    reference: Callable[[Any], Any] | None
    random: Callable[[int], dict[str, Any]] | None = None


def compile_untimed(ba: BoundArguments, check_numerics: bool, seed: int) -> Untimed:
    """`Untimed` of `ba` (a part that cannot be compiled ahead is left to `Autotuner._prepare`)."""
    arguments = operand_shapes(ba)
    forward: Callable[[Any], Any] | None = None
    random: Callable[[int], dict[str, Any]] | None
    program: Any  # the random inputs' program, then the VJP call's forward
    own_inputs = getattr(ba.op, "random_arguments", None) is None
    if own_inputs:
        leaves, _, index = _array_leaves(arguments)
        program = benchmarking.compile_random_initialize([leaves[i] for i in index], seed)
        random = functools.partial(_randomize, arguments, program=program)
    else:
        random = compiled_hook(ba, seed)
    if isinstance(ba.op, VjpOp) and own_inputs:
        program = _forward_program(ba, _vjp_arguments(ba, arguments))
        if program is not None:
            f_std, specs = program
            forward = _untimed_jit(f_std).lower(specs).compile()
            out, residuals = jax.eval_shape(f_std, specs)
            arguments = {**arguments, "out": out, "residuals": residuals}
    reference = None
    if check_numerics:
        try:
            f_std, specs = benchmarking.standardize_function(
                call_op(ba.op.reference_op(), ba.vmap, arguments), arguments, seed=None)
            reference = _untimed_jit(f_std).lower(specs).compile()
        except Exception:  # noqa: BLE001 - compiled when prepared, or left unchecked there
            reference = None
    return Untimed(forward, reference, random)
