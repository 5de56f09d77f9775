"""Pallas Mosaic GPU interpret mode (CPU) for kernels that use `pl.run_state`.

jax 0.11.2's GPU interpreter (`plgpu.force_gpu_interpret_mode`) runs `run_scoped`
accumulators (`plgpu.ACC`) but not `pl.run_state(...)(plgpu.ACC.init(x))`: it binds
`run_state` as a plain primitive, whose lowering then rejects the `wgmma` effect. The
attention kernels use `run_state` to chain `wgmma`s into an accumulator they carry across
tiles. `interpret_mode()` rewrites each such `run_state` into what it means, a scoped
accumulator: allocate, store the initial value, run the body, load the final value;
the interpreter runs that form. It also gives TMA stores a `reduction_op="add"` (the
interpreter raises `NotImplementedError` on any `reduction_op`): inside `interpret_mode()`
such a store adds the SMEM tile into GMEM, `dst += src`, atomically with respect to other
reduce-adds. Tests only: the kernels' own code is unchanged.

The interpreter simulates every memory access, barrier and `wgmma` through an
`io_callback`, whose CPU implementation first `device_put`s the callback's NumPy arguments
back onto the CPU device; the interpreter's callbacks read them as NumPy values anyway.
Inside `interpret_mode()` the arguments go to the callbacks as they come (NumPy arrays),
which spares a conversion of every argument of every simulated access (the shared-memory
model's integer conversion, `_to_int`, is taught NumPy scalars for that).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax._src import callback as jax_callback
from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
from jax._src.pallas.mosaic_gpu.core import WGMMAAbstractAccumulatorRef
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret, shared_memory
from jax._src.state import discharge
from jax._src.state import primitives as state_primitives
from jax._src.state.types import AbstractRef


def _eval_body(inner: jax_core.Jaxpr, args: list, hoisted: set) -> None:
    """`inner` on `args`, where the vars in `hoisted` carry values, not refs: `run_state`
    hoists a closed-over value into a ref its body reads at once (`ref_get(c, ())`)."""
    env = dict(zip(inner.invars, args, strict=True))

    def read(v):
        return v.val if isinstance(v, jax_core.Literal) else env[v]

    for eqn in inner.eqns:
        if eqn.primitive is state_primitives.get_p and eqn.invars[0] in hoisted:
            if len(eqn.invars) != 1:
                raise NotImplementedError("interpret shim: indexed read of a hoisted value")
            outs = [read(eqn.invars[0])]
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))


def _as_run_scoped(eqn: jax_core.JaxprEqn) -> jax_core.JaxprEqn:
    """The `run_state` equation `eqn` as one `run_scoped` equation of the same values:
    its accumulators scoped, its SMEM refs and hoisted values passed through."""
    inner = eqn.params["jaxpr"]
    if not all(eqn.params["is_initialized"]):
        raise NotImplementedError("interpret shim: uninitialized run_state refs")
    is_acc = [isinstance(v.aval, WGMMAAbstractAccumulatorRef) for v in inner.invars]
    hoisted = {v for v, outer in zip(inner.invars, eqn.invars, strict=True)
               if not isinstance(outer.aval, AbstractRef)}
    # The refs it was handed (SMEM) come back unchanged and unused: not returned here.
    returned = [not isinstance(v.aval, AbstractRef) or acc
                for v, acc in zip(eqn.invars, is_acc, strict=True)]
    kinds = [plgpu.ACC(v.aval.shape, v.aval.dtype)
             for v, acc in zip(inner.invars, is_acc, strict=True) if acc]

    def as_scoped(*values):
        def scoped(*refs):
            refs_left = iter(refs)
            args = [next(refs_left) if acc else value
                    for value, acc in zip(values, is_acc, strict=True)]
            for arg, value, acc in zip(args, values, is_acc, strict=True):
                if acc:
                    state_primitives.ref_swap(arg, (), value)
            _eval_body(inner, args, hoisted)
            return [state_primitives.ref_get(arg, ()) if acc else value
                    for arg, value, acc, keep in zip(args, values, is_acc, returned, strict=True)
                    if keep]

        return pl.run_scoped(scoped, *kinds)

    traced = jax.make_jaxpr(as_scoped)(*(v.aval for v in eqn.invars)).jaxpr
    (scoped_eqn,) = traced.eqns
    rename = dict(zip(traced.invars, eqn.invars, strict=True))
    kept = [v for v, keep in zip(eqn.outvars, returned, strict=True) if keep]
    outvars = dict(zip(traced.outvars, kept, strict=True))
    return scoped_eqn.replace(invars=[rename.get(v, v) for v in scoped_eqn.invars],
                              outvars=[outvars[v] for v in scoped_eqn.outvars])


def _with_register_lhs(eqn: jax_core.JaxprEqn) -> list[jax_core.JaxprEqn]:
    """A `wgmma` whose left operand is a register value, as what it computes, `acc += a @ b`
    in float32 (the interpreter's `wgmma` reads both operands from SMEM)."""
    params = eqn.params
    if params["acc_transforms_tree"] is not None:
        raise NotImplementedError("interpret shim: a transformed accumulator")
    b_tree = params["b_transforms_tree"] or jax.tree.structure(())

    def multiply_add(acc, a, b, *b_leaves):
        b_value = state_primitives.get_p.bind(b, *b_leaves, tree=b_tree)
        total = state_primitives.ref_get(acc, ()) + jnp.dot(
            a, b_value, preferred_element_type=jnp.float32)
        state_primitives.ref_swap(acc, (), total)

    traced = jax.make_jaxpr(multiply_add)(*(v.aval for v in eqn.invars)).jaxpr
    rename = dict(zip(traced.invars, eqn.invars, strict=True))
    return [e.replace(invars=[rename.get(v, v) for v in e.invars]) for e in traced.eqns]


def _as_ref_store(eqn: jax_core.JaxprEqn) -> list[jax_core.JaxprEqn]:
    """A store into an accumulator (`acc_ref[...] = x`), which the interpreter has no rule
    for, as the plain ref store it means."""
    def store(acc, value):
        state_primitives.ref_swap(acc, (), value)

    traced = jax.make_jaxpr(store)(*(v.aval for v in eqn.invars)).jaxpr
    rename = dict(zip(traced.invars, eqn.invars, strict=True))
    return [e.replace(invars=[rename.get(v, v) for v in e.invars]) for e in traced.eqns]


def _rewrite(eqn: jax_core.JaxprEqn) -> list[jax_core.JaxprEqn]:
    if eqn.primitive is discharge.run_state_p:
        return [_as_run_scoped(eqn)]
    if (eqn.primitive is gpu_primitives.wgmma_ref_p
            and not isinstance(eqn.invars[1].aval, AbstractRef)):
        return _with_register_lhs(eqn)
    if eqn.primitive is gpu_primitives.wgmma_accumulator_store_p:
        return _as_ref_store(eqn)
    return [eqn]


_REWRITTEN = (discharge.run_state_p, gpu_primitives.wgmma_ref_p,
              gpu_primitives.wgmma_accumulator_store_p)


@functools.cache
def _rewritten(jaxpr: jax_core.Jaxpr) -> jax_core.Jaxpr:
    return jaxpr.replace(eqns=[new for e in jaxpr.eqns for new in _rewrite(e)])


# Serializes every reduce-add's read-modify-write of GMEM: the interpreter runs the grid's
# clusters one after another, but the warpgroups of a block (and the blocks of a cluster)
# in concurrent Python threads.
_REDUCE_LOCK = threading.Lock()


def _added(current: np.ndarray, tile: np.ndarray) -> np.ndarray:
    """`current + tile` in `current`'s dtype; 16-bit floats (`kind` "V" is ml_dtypes'
    bfloat16) add in float32, then round to their dtype."""
    if current.dtype.itemsize < 4 and current.dtype.kind in "fV":
        return (current.astype(np.float32) + tile.astype(np.float32)).astype(current.dtype)
    return (current + tile).astype(current.dtype)


class _ReduceAddSmemToGmemTask(gpu_callbacks.AsyncCopySmemToGmemTask):
    """The interpreter's SMEM -> GMEM TMA store, storing `dst + src` rather than `src`.
    Out-of-bounds rows and columns of the destination are dropped, as a TMA store does."""

    def __call__(self, tma_thread_id: int) -> None:
        memory = gpu_callbacks._get_shared_memory()
        self.pre_read(tma_thread_id, memory)
        tile, _, _ = memory.get_buffer_content(
            self.src_allocation_key, self.src_access, self.thread,
            logging_info=self.logging_info)
        if tile is None or tile.shape != self.src_access.shape:
            raise IndexError(f"interpret shim: out-of-bounds reduce-add source {self.src_access}")
        self.post_read(tma_thread_id, memory)
        dst_shape = tuple(memory.buffer_shape_and_dtype(self.dst_allocation_key).shape)
        store = gpu_callbacks._clip_store_to_shape(self.dst_access, tile, dst_shape)
        if store is not None:
            access, tile = store
            with _REDUCE_LOCK:
                current, _, _ = memory.get_buffer_content(
                    self.dst_allocation_key, access, self.thread, increment_clock=False,
                    logging_info=self.logging_info)
                memory.store_buffer_content(
                    self.dst_allocation_key, access, _added(current, tile), self.thread,
                    logging_info=self.logging_info)
        self.post_write(tma_thread_id, memory)


def _copy_smem_to_gmem_reducing(original):
    """`gpu_callbacks.copy_smem_to_gmem` (`original`), that also runs `reduction_op="add"`."""

    @gpu_callbacks.fail_on_exception
    def reduce_add(*, token, mesh_location, thread, src_allocation_key_as_array,
                   src_transforms, dst_allocation_key_as_array, dst_transforms, predicate,
                   source_info, commit_group):
        del commit_group  # as the interpreter does: it runs every copy eagerly
        if predicate is not None:
            raise NotImplementedError("interpret shim: predicated reduce-add")
        memory = gpu_callbacks._get_shared_memory()
        src_key = gpu_callbacks.HostAllocationKey.from_array(src_allocation_key_as_array)
        dst_key = gpu_callbacks.HostAllocationKey.from_array(dst_allocation_key_as_array)
        src_transforms = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(src_transforms))
        dst_transforms = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(dst_transforms))
        memory.execute_async_task(_ReduceAddSmemToGmemTask(
            mesh_location=mesh_location, thread=thread,
            src_allocation_key=src_key, src_access=memory.access(src_key, src_transforms),
            dst_allocation_key=dst_key, dst_access=memory.access(dst_key, dst_transforms),
            source_info=source_info,
            clock=memory.incr_clock(thread) if memory.detect_races else None))
        return token

    @functools.wraps(original)
    def copy_smem_to_gmem(*, reduction_op: Any = None, **kwargs):
        if reduction_op is None:
            return original(reduction_op=None, **kwargs)
        if reduction_op != "add":
            raise NotImplementedError(f"interpret shim: reduction_op={reduction_op!r}")
        return reduce_add(**kwargs)

    return copy_smem_to_gmem


def _io_callback_on_host_values(*args, result_avals, callback, sharding, ordered):
    """`jax._src.callback.io_callback_impl` without its `device_put` of the arguments: the
    callback gets the host (NumPy) values the runtime handed over."""
    del result_avals, sharding, ordered
    return tree_util.tree_map(np.asarray, callback(*args))


def _to_int_accepting_numpy(original):
    """`shared_memory._to_int` (`original`) that also takes NumPy scalars and 0-d arrays,
    which the callbacks now receive where they received CPU `jax.Array`s."""

    @functools.wraps(original)
    def to_int(x):
        if isinstance(x, np.ndarray | np.generic):
            return x.item()
        return original(x)

    return to_int


@contextlib.contextmanager
def interpret_mode() -> Iterator[None]:
    """GPU interpret mode for the Mosaic GPU kernels traced inside, `run_state` and
    reduce-adding TMA stores included."""
    original = jaxpr_interpret.JaxprInterpreter.interpret

    def interpret(self, jaxpr, token, *args):
        if any(e.primitive in _REWRITTEN for e in jaxpr.eqns):
            jaxpr = _rewritten(jaxpr)
        return original(self, jaxpr, token, *args)

    original_deallocate = shared_memory.Barrier.deallocate

    def deallocate(self):
        with self.cv:
            if self.ref_count == 1:  # the last holder: forgive the unobserved last phases
                self.last_observed_phase_by_thread = dict.fromkeys(
                    self.last_observed_phase_by_thread, self.phase)
        original_deallocate(self)

    original_copy = gpu_callbacks.copy_smem_to_gmem
    original_io_callback = jax_callback.io_callback_impl
    original_to_int = shared_memory._to_int

    jaxpr_interpret.JaxprInterpreter.interpret = interpret
    shared_memory.Barrier.deallocate = deallocate
    gpu_callbacks.copy_smem_to_gmem = _copy_smem_to_gmem_reducing(original_copy)
    jax_callback.io_callback_impl = _io_callback_on_host_values
    shared_memory._to_int = _to_int_accepting_numpy(original_to_int)
    try:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            yield
    finally:
        jaxpr_interpret.JaxprInterpreter.interpret = original
        shared_memory.Barrier.deallocate = original_deallocate
        gpu_callbacks.copy_smem_to_gmem = original_copy
        jax_callback.io_callback_impl = original_io_callback
        shared_memory._to_int = original_to_int
