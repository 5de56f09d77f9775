"""`gated_linear_unit`: the public function and its implementations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_triton import PallasTritonGatedLinearUnit
from tokamax_pass.core import Family, register_family
from tokamax_pass.core.registry import Implementation

FAMILY = register_family(Family(
    name="gated_linear_unit",
    implementations={"xla": GatedLinearUnit, "triton": PallasTritonGatedLinearUnit},
    automatic=("triton", "xla"),
))


def gated_linear_unit(x: Any, weights: Any, *, activation: Callable[[Any], Any] | None = None,
                      precision: Any = None, implementation: Implementation = None) -> Any:
    """`activation(x @ w_gate) * (x @ w_up)`: x (..., K) -> (..., N).

    `weights`: one fused (K, 2, N) array (`[:, 0]` gate, `[:, 1]` up) or a pair
    `(w_gate, w_up)` of (K, N) arrays. `activation` defaults to `jax.nn.swish`
    (SwiGLU); use a module-level function so the op's spec can be read back.
    `implementation`: `None` (the plain-JAX path, unless a measurement shows a kernel faster
    here: see `tokamax_pass.core.resolution`), a name
    from `FAMILY.implementations`, an `Op` instance, or a sequence of those.
    """
    return FAMILY(implementation, x, weights, activation=activation, precision=precision)
