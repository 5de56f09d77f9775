"""Pallas Mosaic GPU interpret mode (CPU) for kernels that use `pl.run_state`.

jax 0.11.2's GPU interpreter (`plgpu.force_gpu_interpret_mode`) runs `run_scoped`
accumulators (`plgpu.ACC`) but not `pl.run_state(...)(plgpu.ACC.init(x))`: it binds
`run_state` as a plain primitive, whose lowering then rejects the `wgmma` effect. The
attention kernels use `run_state` to chain `wgmma`s into an accumulator they carry across
tiles. `interpret_mode()` rewrites each such `run_state` into what it means, a scoped
accumulator: allocate, store the initial value, run the body, load the final value;
the interpreter runs that form. Tests only: the kernels' own code is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
from jax._src.pallas.mosaic_gpu.core import WGMMAAbstractAccumulatorRef
from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret, shared_memory
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


def _rewrite(eqn: jax_core.JaxprEqn) -> list[jax_core.JaxprEqn]:
    if eqn.primitive is discharge.run_state_p:
        return [_as_run_scoped(eqn)]
    if (eqn.primitive is gpu_primitives.wgmma_ref_p
            and not isinstance(eqn.invars[1].aval, AbstractRef)):
        return _with_register_lhs(eqn)
    return [eqn]


_REWRITTEN = (discharge.run_state_p, gpu_primitives.wgmma_ref_p)


@functools.cache
def _rewritten(jaxpr: jax_core.Jaxpr) -> jax_core.Jaxpr:
    return jaxpr.replace(eqns=[new for e in jaxpr.eqns for new in _rewrite(e)])


@contextlib.contextmanager
def interpret_mode() -> Iterator[None]:
    """GPU interpret mode for the Mosaic GPU kernels traced inside, `run_state` included."""
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

    jaxpr_interpret.JaxprInterpreter.interpret = interpret
    shared_memory.Barrier.deallocate = deallocate
    try:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            yield
    finally:
        jaxpr_interpret.JaxprInterpreter.interpret = original
        shared_memory.Barrier.deallocate = original_deallocate
