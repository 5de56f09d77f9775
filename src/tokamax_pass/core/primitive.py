"""The `tokamax_call` primitive: one op call in a jaxpr, lowered per platform.

An op call binds `tokamax_call` with its candidate implementations and static
arguments. Each platform's lowering picks the first candidate that runs there,
resolves its config, lowers it, and stamps the op's JSON spec on every emitted
instruction as the frontend attribute `tokamax_pass_spec`, so autotuning,
`inspect` and profiles can recover the call. Under `jax.grad` a `custom_vjp`
routes the backward pass through the VJP ops, themselves `tokamax_call`s
(`core.calls`, which makes the calls).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax._src import dispatch
from jax.experimental.xla_metadata import set_xla_metadata
from jax.extend.core import Primitive, subjaxprs
from jax.interpreters import ad, batching, mlir

from tokamax_pass.core import device, errors, selection, sharding, spec
from tokamax_pass.core.bound_arguments import BoundArguments, VmapLevel
from tokamax_pass.core.op import Op
from tokamax_pass.core.vjp import RESERVED_NAMES, VjpOp, complete_gradients

METADATA_KEY = "tokamax_pass_spec"
LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

tokamax_call_p = Primitive("tokamax_call")
# The same call in programs built on real devices. JAX lowers a program holding it with
# its device assignment and mesh, which kernels built on `custom_partitioning` (cuDNN
# attention) and partitioning at lowering (`sharding.partitioned_at_lowering`) need.
# Programs traced for an abstract device (export for a GPU that is not here) use
# `tokamax_call_p`: JAX refuses such primitives without devices.
tokamax_call_on_devices_p = Primitive("tokamax_call")
dispatch.prim_requires_devices_during_lowering.add(tokamax_call_on_devices_p)
PRIMITIVES = (tokamax_call_p, tokamax_call_on_devices_p)
for _primitive in PRIMITIVES:
    _primitive.multiple_results = True


def is_tokamax_call(primitive: Any) -> bool:
    return primitive in PRIMITIVES


def bind_call(call: OpCall, *operands: Any) -> Sequence[Any]:
    """Binds the primitive that suits where the program is being built (see above)."""
    primitive = tokamax_call_p if device.abstract_only() else tokamax_call_on_devices_p
    return primitive.bind(*operands, call=call)


# Lists collecting the spec of every call lowered while `recording_lowerings` is active
# (module-level, not per thread: XLA may run partition callbacks on its own threads).
_RECORDERS: list[list[str]] = []
# Set in a thread lowering a program for its op calls' specs only (`specs_only`); per
# thread, so a program another thread lowers meanwhile gets its kernels.
_SPECS_ONLY = threading.local()


@dataclasses.dataclass(frozen=True)
class OpCall:
    """The static part of one op call: candidates, static arguments, vmaps."""

    candidates: tuple[Op, ...]
    treedef: Any
    statics: tuple[tuple[int, Any], ...]
    num_leaves: int
    explicit: bool
    vmap: tuple[VmapLevel, ...] = ()
    return_residuals: bool = False
    # For a VJP call: the forward op whose partition rule (see `sharding`) it follows.
    partition_as: Op | None = None
    # Why implementations named for this call were left out when it was traced (shown
    # when no candidate can run on a platform it is lowered for).
    rejected: tuple[str, ...] = ()

    def choose(self, candidates: Sequence[BoundArguments], target: Any,
               symbolic: bool = False) -> selection.Choice:
        """`selection.choose` for this call (`choose_for_symbolic_shapes` where a dimension
        is `symbolic`); failing, it also says why the implementations left out at trace
        time could not run."""
        try:
            if symbolic:
                return selection.choose_for_symbolic_shapes(candidates, target)
            return selection.choose(candidates, target, explicit=self.explicit)
        except NotImplementedError as e:
            if not self.rejected:
                raise
            chosen_from = list(e.exceptions) if isinstance(
                e, errors.AllImplementationsFailedError) else [e]
            raise errors.AllImplementationsFailedError(
                "\n  ".join((str(e), *self.rejected)),
                [*chosen_from, *map(NotImplementedError, self.rejected)]) from None

    @property
    def operand_indices(self) -> tuple[int, ...]:
        static = {i for i, _ in self.statics}
        return tuple(i for i in range(self.num_leaves) if i not in static)

    def arguments(self, operands: Sequence[Any]) -> dict[str, Any]:
        leaves: list[Any] = [None] * self.num_leaves
        for i, value in self.statics:
            leaves[i] = value
        for i, value in zip(self.operand_indices, operands, strict=True):
            leaves[i] = value
        return jax.tree.unflatten(self.treedef, leaves)

    def unbatched(self, avals: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
        """Per-call operand shapes: the vmapped axes stripped."""
        shapes = []
        for i, aval in enumerate(avals):
            shape = tuple(aval.shape)
            for level in self.vmap:
                if level.axes[i] is not None:
                    shape = shape[1:]
            shapes.append(jax.ShapeDtypeStruct(shape, aval.dtype))
        return shapes

    def bound(self, op: Op, avals: Sequence[Any]) -> BoundArguments:
        return BoundArguments(op, self.arguments(self.unbatched(avals)), self.vmap)

    def structured_function(self, op: Op, config: Any) -> Callable[..., Any]:
        """The candidate's computation over the operands, vmaps applied."""

        def fn(*operands: Any) -> Any:
            arguments = self.arguments(operands)
            shared = arguments.get("shared_inputs", ()) if isinstance(op, VjpOp) else ()
            if shared and not (isinstance(op, VjpOp) and op.accepts_shared_inputs):
                del arguments["shared_inputs"]
            out, residuals = op._fwd(
                **arguments, config=config, return_residuals=self.return_residuals
            )
            if isinstance(op, VjpOp):
                forward = {k: v for k, v in arguments.items() if k not in RESERVED_NAMES}
                out = complete_gradients(out, forward, shared)
            return (out, residuals) if self.return_residuals else out

        for level in reversed(self.vmap):
            fn = jax.vmap(fn, in_axes=level.axes, axis_size=level.size)
        return fn

    def flat_function(self, op: Op, config: Any) -> Callable[..., list[Any]]:
        structured = self.structured_function(op, config)
        return lambda *operands: jax.tree.leaves(structured(*operands))

    def output_structure(self, avals: Sequence[Any]) -> tuple[Any, tuple[Any, ...]]:
        return _output_structure(self, tuple(jax.core.ShapedArray(a.shape, a.dtype) for a in avals))


@functools.lru_cache(maxsize=4096)
def _output_structure(call: OpCall, avals: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    first = call.candidates[0]
    shaper = first if first.keeps_own_residuals() else first.reference_op()
    ba = call.bound(shaper, avals)
    config = shaper.config or shaper._get_heuristics_config(ba)
    with sharding.meshless():
        shapes = jax.eval_shape(
            call.structured_function(shaper, config),
            *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals),
        )
    leaves, treedef = jax.tree.flatten(shapes)
    return treedef, tuple(jax.core.ShapedArray(s.shape, s.dtype) for s in leaves)


def _abstract_eval(*avals: Any, call: OpCall) -> tuple[Any, ...]:
    # Inside `jax.shard_map`, outputs vary over the manual axes their operands vary over.
    varying = varying_axes(avals)
    outs = call.output_structure(avals)[1]
    if not varying:
        return outs
    mesh = next(a.sharding.mesh for a in avals if hasattr(a, "mat") and a.mat.varying)
    return tuple(a.update(
        sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*[None] * a.ndim)),
        manual_axis_type=a.mat.update(varying=varying)) for a in outs)


def varying_axes(avals: Sequence[Any]) -> frozenset[Any]:
    return frozenset().union(*(a.mat.varying for a in avals if hasattr(a, "mat")))


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *, call: OpCall) -> tuple[Any, Any]:
    """Forward-mode derivative, which second-order gradients need (they differentiate the
    forward pass of `bind_with_vjp`): the call's own outputs, with tangents from autodiff
    of the family's XLA reference (kernels have no autodiff of their own)."""
    if any(op.keeps_own_residuals() for op in call.candidates) and call.return_residuals:
        raise NotImplementedError(
            f"second-order gradients of {call.candidates[0]}: its residuals are of its own "
            "form, which autodiff of the family's reference does not give; pin a config "
            "that keeps the family's residuals")
    outs = bind_call(call, *primals)
    reference = call.candidates[0].reference_op()
    config = reference.config or reference._get_heuristics_config(call.bound(reference, primals))
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    _, out_tangents = jax.jvp(call.flat_function(reference, config), list(primals), tangents)
    return outs, out_tangents


def _batch(operands: Sequence[Any], dims: Sequence[Any], *, call: OpCall) -> tuple[Any, Any]:
    size = next(x.shape[d] for x, d in zip(operands, dims, strict=True) if d is not None)
    moved = [
        x if d is None else jax.numpy.moveaxis(x, d, 0)
        for x, d in zip(operands, dims, strict=True)
    ]
    axes = tuple(None if d is None else 0 for d in dims)
    batched = dataclasses.replace(call, vmap=(VmapLevel(axes, size), *call.vmap))
    outs = bind_call(batched, *moved)
    return outs, [0] * len(outs)


def _lowering(ctx: Any, *operands: Any, call: OpCall, platform: str) -> Sequence[Any]:
    partitioned = sharding.partitioned_at_lowering(
        ctx, call, lambda *xs: bind_call(call, *xs))
    if partitioned is not None:
        return mlir.lower_fun(partitioned, multiple_results=True)(ctx, *operands)
    target = device.lowering_target(platform)
    for op in call.candidates:  # before resolving: a cache may hold this program's own ops
        spec.remember_lowered(type(op))
    candidates = [call.bound(op, ctx.avals_in) for op in call.candidates]
    symbolic = spec.has_symbolic_dims(ctx.avals_in)
    choice = call.choose(candidates, target, symbolic)
    # A spec records concrete shapes; a symbolic call is stamped with none, so inspection
    # and autotuning, which key everything by shape, do not see it.
    encoded = None if symbolic else choice.bound.to_json()
    for recorder in _RECORDERS:
        if encoded is not None:
            recorder.append(encoded)
    body = call.flat_function(choice.op, choice.op.config)

    def fn(*xs: Any) -> list[Any]:
        with sharding.meshless():  # not partitioned: the body traces as on one device
            return body(*xs)

    if getattr(_SPECS_ONLY, "active", False):
        with device.lowering_for(target):
            jaxpr = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(a.shape, a.dtype)
                                         for a in ctx.avals_in)).jaxpr
        if not _makes_op_calls(jaxpr):
            return mlir.lower_fun(_stand_in(ctx.avals_out), multiple_results=True)(
                ctx, *operands)
    metadata = {} if encoded is None else {METADATA_KEY: encoded}
    with device.lowering_for(target), set_xla_metadata(**metadata):
        return mlir.lower_fun(fn, multiple_results=True)(
            sharding.without_explicit_shardings(ctx), *operands)


for _primitive in PRIMITIVES:
    _primitive.def_impl(functools.partial(dispatch.apply_primitive, _primitive))
    _primitive.def_abstract_eval(_abstract_eval)
    batching.primitive_batchers[_primitive] = _batch
    ad.primitive_jvps[_primitive] = _jvp
    for _platform in LOWERING_PLATFORMS:
        mlir.register_lowering(
            _primitive, functools.partial(_lowering, platform=_platform), platform=_platform)


def _makes_op_calls(jaxpr: Any) -> bool:
    """Whether `jaxpr` (an op's body) binds op calls of its own (a VJP made of ragged-dot
    calls), in it or in the jaxprs its equations hold."""
    return any(is_tokamax_call(eqn.primitive) for eqn in jaxpr.eqns) or any(
        _makes_op_calls(sub) for sub in subjaxprs(jaxpr))


def _stand_in(avals: Sequence[Any]) -> Callable[..., list[Any]]:
    """A body giving zeros of the call's output shapes, for `specs_only`."""

    def fn(*operands: Any) -> list[Any]:
        del operands
        return [jax.numpy.zeros(aval.shape, aval.dtype) for aval in avals]

    return fn


@contextlib.contextmanager
def specs_only() -> Iterator[None]:
    """Inside (in this thread), an op call lowers to zeros of its outputs' shapes once
    `recording_lowerings` has its spec, unless its body makes op calls of its own (those
    are then lowered, and recorded, the same way): finding a program's op calls needs
    their specs, not their kernels, and lowering a Mosaic GPU kernel costs several times
    more Python work than tracing its body to see what it calls. Such a program
    computes nothing useful: only `discovery` lowers one, and never runs it."""
    previous = getattr(_SPECS_ONLY, "active", False)
    _SPECS_ONLY.active = True
    try:
        yield
    finally:
        _SPECS_ONLY.active = previous


@contextlib.contextmanager
def recording_lowerings() -> Iterator[list[str]]:
    """Collects the spec JSON of every op call lowered inside, including the per-device
    calls that `custom_partitioning` lowers when the program is compiled (their specs
    do not survive into the compiled HLO)."""
    recorder: list[str] = []
    _RECORDERS.append(recorder)
    try:
        yield recorder
    finally:
        _RECORDERS.remove(recorder)


def bind_partitioned(call: OpCall, operands: Sequence[Any],
                     bind_local: Callable[..., Sequence[Any]] | None = None,
                     bind_global: Callable[..., Sequence[Any]] | None = None) -> list[Any]:
    """Binds `call` (flat results), per device when its operands are sharded (`sharding.bind`).

    `bind_local` binds a per-device call and `bind_global` the unpartitioned one that
    `custom_partitioning` traces; both default to binding `call` as is. The pass passes
    its own, so each device's call is resolved for the shapes that device sees.
    """
    def plain(*xs: Any) -> Sequence[Any]:
        return bind_call(call, *xs)

    return list(sharding.bind(call, operands, bind_local or plain, bind_global))
