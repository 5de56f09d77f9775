"""`gated_linear_unit`: the public function and its implementations."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_kernels import _dispatch
from tokamax_kernels import _validation as v
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_mosaic_gpu import PallasMosaicGpuGatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_mosaic_tpu import PallasMosaicTpuGatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_triton import PallasTritonGatedLinearUnit
from tokamax_pass.core import Family, register_family
from tokamax_pass.core.registry import Implementation

FAMILY = register_family(Family(
    name="gated_linear_unit",
    implementations={"mosaic_gpu": PallasMosaicGpuGatedLinearUnit,
                     "mosaic_tpu": PallasMosaicTpuGatedLinearUnit,
                     "triton": PallasTritonGatedLinearUnit, "xla": GatedLinearUnit},
    automatic=("mosaic_gpu", "mosaic_tpu", "triton", "xla"),
    aliases={"mosaic": ("mosaic_gpu", "mosaic_tpu")},
))


def gated_linear_unit(x: Any, weights: Any, *, group_sizes: Any = None,
                      activation: Callable[[Any], Any] | None = None,
                      precision: Any = None, implementation: Implementation = None) -> Any:
    """`activation(x @ w_gate) * (x @ w_up)`: x (..., K) -> (..., N).

    `weights`: one fused (K, 2, N) array (`[:, 0]` gate, `[:, 1]` up) or a pair
    `(w_gate, w_up)` of (K, N) arrays. `activation=None` applies no activation (the
    bilinear GLU, `(x @ w_gate) * (x @ w_up)`, as in upstream Tokamax); pass
    `activation=jax.nn.swish` for SwiGLU. Use a module-level function so the op's spec
    can be read back.

    `group_sizes` (G,) int32 (MoE expert GEMMs): the rows of x (M, K) come in consecutive
    groups, group g multiplying its rows by its own weights, fused (G, K, 2, N) or a pair
    of (G, K, N); rows past `sum(group_sizes)` give zeros, as in `jax.lax.ragged_dot`.
    `"mosaic_gpu"` fuses the activation into the ragged dot's epilogue (Hopper, bf16/f16).
    `"mosaic_tpu"` is the TPU kernel, dense and grouped (bf16/f32; `"mosaic"` names the
    platform's Mosaic one).

    `implementation`: `None` (the plain-JAX path, unless a measurement shows a kernel faster
    here: see `tokamax_pass.core.selection`), a name
    from `FAMILY.implementations`, an `Op` instance, a function, or a sequence of those,
    tried in order until one does not raise `NotImplementedError` (as upstream Tokamax
    does). A function is called as `f(x, weights, **keywords)` with the keywords this call
    was given.
    """
    keywords = dict(group_sizes=group_sizes, activation=activation, precision=precision)

    def run_family(impl: Implementation) -> Any:
        if activation is not None:
            _check_jit_can_take(activation)
            _check_no_traced_closure(activation)
        return FAMILY(impl, *v.numpy_floats_as_jax((x, weights)), **keywords)

    return _dispatch.call(
        implementation, run_family,
        lambda f: f(x, weights, **_dispatch.given_keywords(keywords, dict.fromkeys(keywords))),
        op="gated_linear_unit")


def _check_jit_can_take(activation: Any) -> None:
    """`ValueError` for a callable that `jax.jit` cannot take, as it holds a weak reference
    to the function: a NumPy ufunc such as `np.tanh` or `scipy.special.expit`. Checking
    the activation raised an unrelated TypeError ("cannot create weak reference to
    'numpy.ufunc' object") and, on the next call, crashed the interpreter (a segmentation
    fault inside `jax.jit`). Non-callables are `bind`'s to name."""
    if not callable(activation):
        return
    try:
        weakref.ref(activation)
    except TypeError:
        raise ValueError(
            f"gated_linear_unit: activation must be a function JAX can trace, e.g. "
            f"jax.nn.gelu or jnp.tanh; got {activation!r}, which jax.jit cannot take (a NumPy "
            f"ufunc cannot act on traced values either): use its jax.numpy or jax.nn "
            f"counterpart") from None


def _check_no_traced_closure(activation: Callable[[Any], Any]) -> None:
    """`ValueError` for an activation that closes over a traced value (a learnable
    parameter of the enclosing `jit` or `grad`): the activation is a static part of the op
    call, so such a value failed at lowering, deep in JAX ("No constant handler for
    type ... Tracer"). Other faults of the activation are `bind`'s to name."""
    try:
        closed = jax.make_jaxpr(activation)(jax.ShapeDtypeStruct((1,), jnp.float32))
    except Exception:  # noqa: BLE001 - `bind` checks what the activation does
        return
    if any(isinstance(c, jax.core.Tracer) for c in closed.consts):
        raise ValueError(
            "gated_linear_unit: activation closes over a traced value (an argument of the "
            "enclosing jit or grad, such as a learnable beta); the activation is a fixed "
            "function of the gate: close over constants only, or write a learnable one "
            "out, as activation(x @ w_gate, beta) * (x @ w_up)")
