"""`ragged_dot`: the public function and its implementations."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from tokamax_kernels.ragged_dot.base import RaggedDot
from tokamax_kernels.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot
from tokamax_kernels.ragged_dot.pallas_mosaic_tpu import PallasMosaicTpuRaggedDot
from tokamax_kernels.ragged_dot.pallas_triton import PallasTritonRaggedDot
from tokamax_pass.core import Family, register_family
from tokamax_pass.core.registry import Implementation

FAMILY = register_family(Family(
    name="ragged_dot",
    implementations={"mosaic_gpu": PallasMosaicGpuRaggedDot,
                     "mosaic_tpu": PallasMosaicTpuRaggedDot,
                     "triton": PallasTritonRaggedDot, "xla": RaggedDot},
    automatic=("mosaic_gpu", "mosaic_tpu", "triton", "xla"),
    aliases={"mosaic": ("mosaic_gpu", "mosaic_tpu")},
))


def ragged_dot(lhs: Any, rhs: Any, group_sizes: Any, *, precision: Any = None,
               preferred_element_type: Any = None, implementation: Implementation = None) -> Any:
    """Grouped matmul: rows of `lhs` (M, K) in consecutive groups times `rhs[g]` (G, K, N).

    Group g takes `group_sizes[g]` rows (int32, shape (G,), summing to at most M);
    rows past the sum give zeros, as in `jax.lax.ragged_dot`. Concrete sizes are checked
    (each >= 0, summing to at most M); traced ones cannot be, and behave as in
    `jax.lax.ragged_dot`: groups end at row M (under `jax.vmap`, per batch entry, the
    other entries unaffected). The gradients are ragged dots of their own, tuned
    separately.
    `implementation`: `None` (the plain-JAX path, unless a measurement shows a kernel faster
    here: see `tokamax_pass.core.resolution`), a name
    from `FAMILY.implementations` (`"mosaic"`: the Mosaic kernel of the platform, GPU or
    TPU), an `Op` instance, or a sequence of those.
    """
    _check_output_kind(lhs, preferred_element_type)
    return FAMILY(implementation, lhs, rhs, group_sizes, precision=precision,
                  preferred_element_type=preferred_element_type)


def _check_output_kind(lhs: Any, preferred_element_type: Any) -> None:
    """`ValueError` for an output dtype of another kind than float operands (int8, bool,
    complex): `jax.lax.ragged_dot` truncated the products to it silently. Unreadable
    dtypes and other operands are `bind`'s to name."""
    try:
        wanted, operands = jnp.dtype(preferred_element_type), jnp.dtype(lhs.dtype)
    except (TypeError, AttributeError):
        return
    if (preferred_element_type is not None and jnp.issubdtype(operands, jnp.floating)
            and not jnp.issubdtype(wanted, jnp.floating)):
        raise ValueError(
            f"ragged_dot: preferred_element_type must be a floating dtype for {operands} "
            f"operands (the products would be cast to it), got {wanted}")
