"""Op calls on more than one device: each family's partition rule, applied by JAX.

A kernel custom call compiled for global shapes cannot be split by XLA, so an op
call over sharded operands is rebound per device with local shapes, through one
of JAX's own mechanisms, chosen by what the trace can see:

  inside `jax.shard_map`            nothing to do: operands are already per device
  shardings in the avals (Explicit) `jax.shard_map` with the avals' specs
  a concrete mesh (`jax.set_mesh`)  `custom_partitioning`: Shardy propagates the
                                    family's factor rule and the partition callback
                                    sees the real shardings at compile time
  only an abstract mesh (export)    `jax.shard_map` over that mesh; mesh axis i goes
                                    to the family's i-th factor (data -> batch,
                                    model -> heads), else to the first that divides
  no mesh, but jit spans devices    `custom_partitioning` chosen when the call is
                                    lowered (`partitioned_at_lowering`)

Each family declares, per call, which dims of which arrays are "batch-like"
factors (split with no communication) in a `PartitionRule`; dims without a factor
are gathered (with a one-time warning naming them). Outputs may be partial sums
over a factor (a ragged dot's weight gradient over sharded rows): those are
`psum`med. A single device (or the one-device mesh of `core.targeting`) binds the
call as before, and so does any call traced under `partitioning(False)` (under Explicit
axes its outputs are typed with the partitioned call's shardings): the pass traces a
program that way to see every op call as a plain `tokamax_call`, then re-binds each
resolved call here.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core as jax_core
from jax._src import mesh as mesh_lib
from jax._src import sharding_impls
from jax._src.custom_partitioning import custom_partitioning_p
from jax._src.interpreters import batching as jax_batching
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding

from tokamax_pass.core.partition_rules import (
    Dims,
    PartitionRule,
    Shard,
    assignment_by_order,
    assignment_from_specs,
    every_factor,
    gradient_dims,
    leaf_dims,
    spec_for,
)

_ENABLED = contextvars.ContextVar("tokamax_pass_partitioning", default=True)


@contextlib.contextmanager
def partitioning(enabled: bool) -> Iterator[None]:
    """Whether `bind` partitions op calls traced inside (it does by default)."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def _call_rule(call: Any,
               avals: Sequence[Any]) -> tuple[PartitionRule, list[Dims], list[Dims]] | None:
    """The rule of `call` and the `Dims` of each operand and each flat output, or `None`."""
    from tokamax_pass.core.vjp import VjpOp

    shapes = call.unbatched(avals)
    arguments = call.arguments(shapes)
    forward = call.partition_as
    if forward is None and isinstance(call.candidates[0], VjpOp):
        return None
    if forward is None:
        forward = call.candidates[0]
        fwd_arguments = arguments
    else:
        fwd_arguments = {k: v for k, v in arguments.items()
                         if k not in ("residuals", "out", "dout")}
    if forward.keeps_own_residuals() and (call.return_residuals or "residuals" in arguments):
        # The family's rule splits its residuals, not residuals of another form: a call
        # that makes or reads those runs unpartitioned, and XLA partitions what it lowers to.
        return None
    rule_fn = getattr(forward.reference_op(), "partition_rule", None)
    if rule_fn is None:
        return None
    from tokamax_pass.core.bound_arguments import BoundArguments

    rule = rule_fn(BoundArguments(forward, fwd_arguments))
    if rule is None:
        return None
    summed: tuple[str, ...] = ()
    if call.partition_as is None:
        arg_rule = rule.arguments
        out_rule = (rule.out, rule.residuals) if call.return_residuals else rule.out
    else:  # a VJP call: gradients shaped like the forward's arguments
        arg_rule = {**rule.arguments, "residuals": rule.residuals, "out": rule.out,
                    "dout": rule.out}
        out_rule = gradient_dims(rule.arguments)
        summed = every_factor(rule.arguments)
    dims_of_leaves = leaf_dims(arguments, arg_rule, [
        0 if not hasattr(v, "shape") else len(v.shape)
        for v in jax.tree.leaves(arguments, is_leaf=lambda v: v is None)])
    operand_dims = [dims_of_leaves[i] for i in call.operand_indices]
    treedef, out_avals = call.output_structure(avals)
    placeholder = jax.tree.unflatten(treedef, list(range(len(out_avals))))
    out_dims = leaf_dims(placeholder, out_rule, [a.ndim for a in out_avals], none_leaves=False,
                          summed=summed)
    return rule, operand_dims, out_dims


def _local_function(call: Any, rule: PartitionRule, out_dims: Sequence[Dims],
                    assignment: Mapping[str, tuple[str, ...]], mesh_sizes: Mapping[str, int],
                    bind: Callable[..., Sequence[Any]]) -> Callable[..., list[Any]]:
    shard = Shard(dict(assignment), dict(mesh_sizes))

    def local(*operands: Any) -> list[Any]:
        arguments = call.arguments(operands)
        local_operands = list(operands)
        if rule.localize is not None:
            leaves = jax.tree.leaves(rule.localize(arguments, shard), is_leaf=lambda v: v is None)
            local_operands = [leaves[i] for i in call.operand_indices]
        outs = list(bind(*local_operands))
        if rule.restore is not None:
            treedef = call.output_structure(local_operands)[0]
            restored = rule.restore(jax.tree.unflatten(treedef, outs), arguments, shard)
            outs = jax.tree.leaves(restored)
        for i, d in enumerate(out_dims):
            axes = tuple(a for f in d.summed for a in assignment.get(f, ()))
            if axes:
                outs[i] = jax.lax.psum(outs[i], axes)
        return outs

    return local


def _explicit_axes() -> bool:
    """Whether the mesh in context has Explicit axes (`jax.make_mesh`'s default): then
    operand types carry their shardings, and unsharded operands are replicated."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types


def meshless() -> contextlib.AbstractContextManager[Any]:
    """A context without the mesh's axes, where a mesh with Explicit axes is in context.

    What a call computes on its operands as given (its output shapes, its body on one
    device or per device) does not depend on the mesh; under Explicit axes, though, some
    JAX ops (`jax.lax.ragged_dot_general`) refuse to trace without an `out_sharding`.
    The sharding of a call is this module's job (`bind`), not its body's.

    The mesh's abstract device stays: a program lowered for a device that is not here (a
    GPU, from a CPU machine) needs it to lower Pallas kernels, which read the device kind
    from the abstract mesh.
    """
    if not _explicit_axes():
        return contextlib.nullcontext()
    device = jax.sharding.get_abstract_mesh().abstract_device
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((), (), abstract_device=device))


def without_explicit_shardings(ctx: Any) -> Any:
    """A lowering context whose avals carry no mesh with Explicit axes, for lowering a
    call that is not partitioned: its body then traces as on one device (some JAX ops,
    such as `jax.lax.ragged_dot_general`, cannot infer their output sharding there)."""
    avals = list(ctx.avals_in) + list(ctx.avals_out)
    if not any(has_explicit_mesh(a) for a in avals):
        return ctx
    with meshless():
        return ctx.replace(avals_in=[_plain(a) for a in ctx.avals_in],
                           avals_out=[_plain(a) for a in ctx.avals_out])


def like_operand(grad: Any, operand: Any) -> Any:
    """`grad` with `operand`'s sharding where the operand's type carries one (Explicit
    axes): JAX requires a custom VJP's cotangent to have its primal's type, and a VJP
    op's result need not come out sharded as the operand was (a ragged dot's `dlhs` is
    computed whole along K where `lhs` was sharded over it)."""
    if isinstance(grad, np.ndarray) or not hasattr(grad, "shape"):
        return grad
    return placed_like(grad, jax.typeof(operand))


def placed_like(value: Any, aval: Any) -> Any:
    """`value` resharded to the sharding of the type `aval` where that type carries one
    (Explicit axes) and `value`'s differs. The type's own sharding names its mesh, so no
    mesh context is needed."""
    if not has_explicit_mesh(aval) or jax.typeof(value).sharding == aval.sharding:
        return value
    return jax.sharding.reshard(value, aval.sharding)


def has_explicit_mesh(aval: Any) -> bool:
    """Whether the type `aval` is placed over a mesh with an Explicit axis."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return mesh is not None and not mesh.empty and (
        jax.sharding.AxisType.Explicit in mesh.axis_types)


def _plain(aval: Any) -> Any:
    if not has_explicit_mesh(aval):
        return aval
    return jax.core.ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _mode() -> str:
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty or abstract.size == 1:
        return "single"
    if abstract.manual_axes:
        return "manual"
    # A concrete mesh in context (`jax.set_mesh`) means devices exist: custom_partitioning
    # can run; JAX offers no public way to read it while tracing.
    concrete = mesh_lib.get_concrete_mesh()
    if concrete is not None and not concrete.empty:
        return "concrete"
    return "abstract"


def bind(call: Any, operands: Sequence[Any], bind_local: Callable[..., Sequence[Any]],
         bind_global: Callable[..., Sequence[Any]] | None = None) -> Sequence[Any]:
    """Binds `call` on `operands`, per device when they are (or may be) sharded.

    `bind_local` binds the call on operands as one device sees them; `bind_global`
    (default `bind_local`) binds the unpartitioned call that `custom_partitioning`
    traces for its global shapes but only runs on one device.
    """
    explicit_specs = [getattr(jax.typeof(x).sharding, "spec", None) for x in operands]
    explicit = any(s is not None and any(e is not None for e in s) for s in explicit_specs)
    if explicit and jax.sharding.get_abstract_mesh().empty:
        # Operands placed over a mesh with Explicit axes, no mesh in context
        # (`jax.device_put` onto it, then `jax.jit` without `jax.set_mesh`): their types
        # name the mesh, which the call is split over as under `jax.set_mesh`.
        with jax.sharding.use_abstract_mesh(_operands_mesh(operands)):
            return bind(call, operands, bind_local, bind_global)
    if not _ENABLED.get():
        return _typed_as_partitioned(call, operands, explicit_specs, bind_local(*operands))
    mode = _mode()
    if call.vmap or (mode in ("single", "manual") and not explicit):
        return bind_local(*operands)
    if mode == "concrete" and any(isinstance(x, jax_batching.BatchTracer) for x in operands):
        # Under `jax.vmap`, which `custom_partitioning` has no rule for, and where a
        # family's per-device `localize`/`restore` would see the batch's values: bound
        # whole, the call is batched by its own rule and lowered unpartitioned.
        return bind_local(*operands)
    if not explicit and _explicit_axes():  # replicated operands: a replicated call
        return bind_local(*operands)
    found = _call_rule(call, [jax.typeof(x) for x in operands])
    if found is None:
        return bind_local(*operands)
    rule, operand_dims, out_dims = found
    what = call.candidates[0].family_name()
    shapes = [x.shape for x in operands]
    if mode == "concrete" and not explicit:
        out_shapes = [a.shape for a in call.output_structure(operands)[1]]
        return _custom_partitioned(call, rule, operand_dims, out_dims, bind_local,
                                   bind_global or bind_local, what, shapes, out_shapes)(*operands)
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    if explicit:
        assignment = assignment_from_specs(explicit_specs, shapes, operand_dims, sizes, what)
    else:
        assignment = assignment_by_order(rule.order, shapes, operand_dims, sizes)
    in_specs = tuple(spec_for(d, assignment) for d in operand_dims)
    out_specs = [_out_spec(d, assignment) for d in out_dims]
    if explicit:
        operands = [jax.sharding.reshard(x, s) for x, s in zip(operands, in_specs, strict=True)]
    local = _local_function(call, rule, out_dims, assignment, sizes, bind_local)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*operands)


def _operands_mesh(operands: Sequence[Any]) -> Any:
    """The abstract mesh the first operand placed over Explicit axes names in its type."""
    for x in operands:
        aval = jax.typeof(x)
        if has_explicit_mesh(aval):
            return aval.sharding.mesh.abstract_mesh
    raise ValueError("no operand is placed over a mesh with Explicit axes")


def _out_spec(d: Dims, assignment: Mapping[str, tuple[str, ...]]) -> Any:
    """An output's spec: split over its factors, whole over those it is a partial sum of
    (summed before it leaves the per-device call)."""
    return spec_for(Dims(tuple(None if f in d.summed else f for f in d.factors)), assignment)


def _typed_as_partitioned(call: Any, operands: Sequence[Any],
                          specs: Sequence[Any], outs: Sequence[Any]) -> Sequence[Any]:
    """`outs` of a call bound whole under `partitioning(False)`, typed with the shardings
    the partitioned call gives them where the mesh has Explicit axes: the call's own avals
    carry no mesh, and code traced after it (`jax.typeof(out).sharding`, a cotangent
    resharded like the output) must see what `jax.jit` shows it."""
    if not _explicit_axes() or call.vmap:
        return outs
    found = _call_rule(call, [jax.typeof(x) for x in operands])
    if found is None:
        return outs
    _, operand_dims, out_dims = found
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    assignment = assignment_from_specs(specs, [x.shape for x in operands], operand_dims, sizes,
                                       call.candidates[0].family_name())
    return [o if has_explicit_mesh(jax.typeof(o)) else jax.sharding.reshard(
                o, _out_spec(d, assignment))
            for o, d in zip(outs, out_dims, strict=True)]


def partitioned_at_lowering(ctx: Any, call: Any, bind_local: Callable[..., Sequence[Any]]
                            ) -> Callable[..., Any] | None:
    """The call through `custom_partitioning`, when `jax.jit` lowers it for several devices.

    Plain `jax.jit` over sharded inputs, with no mesh in context, shows no sharding while
    tracing; only its lowering knows the program spans several devices. Then the call is
    partitioned here instead of gathered. `None`: lower the call as it is (one device, a
    per-device call inside `shard_map` or a partition callback, an export, a vmapped call).
    """
    axis_context = ctx.module_context.axis_context
    if (not _ENABLED.get() or call.vmap or ctx.module_context.lowering_parameters.for_export
            or not isinstance(axis_context, sharding_impls.ShardingContext)
            or axis_context.num_devices < 2 or axis_context.abstract_mesh is None):
        return None
    found = _call_rule(call, ctx.avals_in)
    if found is None:
        return None
    rule, operand_dims, out_dims = found
    return _custom_partitioned(
        call, rule, operand_dims, out_dims, bind_local, bind_local,
        call.candidates[0].family_name(), [a.shape for a in ctx.avals_in],
        [a.shape for a in ctx.avals_out])


def _custom_partitioned(call: Any, rule: PartitionRule, operand_dims: Sequence[Dims],
                        out_dims: Sequence[Dims], bind_local: Callable[..., Sequence[Any]],
                        bind_global: Callable[..., Sequence[Any]], what: str,
                        shapes: Sequence[Sequence[int]],
                        out_shapes: Sequence[Sequence[int]]) -> Callable[..., Any]:
    """`custom_partitioning` of the call: Shardy propagates the factor rule; the partition
    callback reads the real shardings and lowers the per-device call."""

    @custom_partitioning
    def partitioned(*operands: Any) -> list[Any]:
        return list(bind_global(*operands))

    def partition(mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        specs = [getattr(a.sharding, "spec", None) for a in arg_shapes]
        assignment = assignment_from_specs(
            specs, [a.shape for a in arg_shapes], operand_dims, sizes, what)
        arg_shardings = tuple(NamedSharding(mesh, spec_for(d, assignment)) for d in operand_dims)
        out_shardings = [NamedSharding(mesh, _out_spec(d, assignment)) for d in out_dims]
        local = _local_function(call, rule, out_dims, assignment, sizes, bind_local)
        return mesh, local, out_shardings, arg_shardings

    setattr(partition, _OP_CALL, True)
    partitioned.def_partition(partition=partition,
                              sharding_rule=_sdy_rule(operand_dims, out_dims, shapes, out_shapes))
    return partitioned


def _sdy_rule(operand_dims: Sequence[Dims], out_dims: Sequence[Dims],
              shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]]) -> str:
    """The einsum-like Shardy rule: a factor shared by the dims of equal size that carry it
    (GQA kv heads are a factor of their own), every other dim a fresh factor."""
    names: dict[tuple[str, int], str] = {}
    fresh = iter(f"u{i}" for i in range(1_000_000))

    def name(factor: str | None, size: int) -> str:
        if factor is None or size == 1:
            return next(fresh)
        return names.setdefault((factor, size), f"f{len(names)}")

    def operand(d: Dims, shape: Sequence[int]) -> str:
        return " ".join(name(f, n) for f, n in zip(d.factors, shape, strict=True))

    ins = [operand(d, s) for d, s in zip(operand_dims, shapes, strict=True)]
    outs = [operand(d, s) for d, s in zip(out_dims, out_shapes, strict=True)]
    return ", ".join(ins) + " -> " + ", ".join(outs)


# Marks the partition callbacks of op calls (`_custom_partitioned`).
_OP_CALL = "_tokamax_pass_op_call"


def _batched_op_call(args: Sequence[Any], dims: Sequence[Any], *, call: Any, partition: Any,
                     **params: Any) -> tuple[list[Any], list[int]]:
    """`jax.vmap` of an op call that `custom_partitioning` partitions (traced inside
    `jax.jit` under a mesh, then mapped), which JAX has no batching rule for: the call is
    mapped whole, batched by its own rule, and a batched call is lowered unpartitioned
    (its operands gathered). Other `custom_partitioning` calls keep JAX's error."""
    del params
    if not getattr(partition, _OP_CALL, False):
        raise NotImplementedError("Batching rule for 'custom_partitioning' not implemented")
    outs = jax.vmap(jax_core.jaxpr_as_fun(call), in_axes=list(dims))(*args)
    return list(outs), [0] * len(outs)


if custom_partitioning_p not in jax_batching.fancy_primitive_batchers:
    jax_batching.primitive_batchers[custom_partitioning_p] = _batched_op_call
