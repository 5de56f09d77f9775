"""`layer_norm`: the public function and its implementations."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from tokamax_kernels import _dispatch
from tokamax_kernels import _validation as v
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_mosaic_tpu import PallasMosaicTpuLayerNorm
from tokamax_kernels.layer_norm.pallas_triton import PallasTritonLayerNorm
from tokamax_pass.core import Family, register_family
from tokamax_pass.core.registry import Implementation

FAMILY = register_family(Family(
    name="layer_norm",
    implementations={"xla": LayerNorm, "triton": PallasTritonLayerNorm,
                     "mosaic_tpu": PallasMosaicTpuLayerNorm},
    automatic=("triton", "mosaic_tpu", "xla"),
    aliases={"mosaic": ("mosaic_tpu",)},
))


def layer_norm(x: Any, scale: Any, offset: Any, *, axis: int = -1, epsilon: float = 1e-6,
               scale_offset: float = 0.0, subtract_mean: bool = True, residual: Any = None,
               implementation: Implementation = None) -> Any:
    """Layer norm (or RMSNorm with `subtract_mean=False`) of `x` over `axis`.

    `scale` and `offset` have the length of that axis, or are `None`.
    `scale_offset`: a static number added to the scale (`x_norm * (scale + scale_offset) +
    offset`, as upstream Tokamax: Gemma's `1 + scale`); no effect when `scale` is `None`.
    `residual`: `None`, or an array of `x`'s shape and dtype for a transformer's pre-norm
    residual step, `s = residual + x; y = norm(s)` in one pass: the call then returns
    `(y, s)`, `s` rounded to `x`'s dtype as plain JAX rounds it, both differentiable.
    `implementation`: `None` (the plain-JAX path, unless a measurement shows a kernel faster
    here: see `tokamax_pass.core.selection`), a name
    from `FAMILY.implementations` (`"mosaic"`: the Mosaic TPU kernel, the family's only
    Mosaic one), an `Op` instance, a function, or a sequence of those, tried in order until
    one does not raise `NotImplementedError` (as upstream Tokamax does). A function is
    called as `f(x, scale, offset, **keywords)` with the keywords this call was given.
    """
    keywords = dict(axis=axis, epsilon=epsilon, scale_offset=scale_offset,
                    subtract_mean=subtract_mean, residual=residual)

    def run_family(impl: Implementation) -> Any:
        x_, scale_, offset_, residual_ = v.numpy_floats_as_jax((x, scale, offset, residual))
        offset_by = v.static_number("scale_offset", scale_offset, op="layer_norm",
                                    minimum=None)
        if scale_ is not None and offset_by != 0.0:
            # In at least float32, as the kernels compute; the gradient of `scale` is
            # unchanged and comes back in its dtype.
            scale_ = scale_.astype(jnp.promote_types(scale_.dtype, jnp.float32)) + offset_by
        return FAMILY(impl, x_, scale_, offset_, axis=axis, epsilon=epsilon,
                      subtract_mean=subtract_mean, residual=residual_)

    return _dispatch.call(
        implementation, run_family,
        lambda f: f(x, scale, offset, **_dispatch.given_keywords(keywords, _DEFAULTS)),
        op="layer_norm")


_DEFAULTS = dict(axis=-1, epsilon=1e-6, scale_offset=0.0, subtract_mean=True, residual=None)
