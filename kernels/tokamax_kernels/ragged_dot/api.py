"""`ragged_dot`: the public function and its implementations."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_kernels import _dispatch
from tokamax_kernels.ragged_dot import quantized
from tokamax_kernels.ragged_dot.base import RaggedDot, canonical_precision
from tokamax_kernels.ragged_dot.group_sizes import RaggedDotGroupSizes
from tokamax_kernels.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot
from tokamax_kernels.ragged_dot.pallas_mosaic_tpu import PallasMosaicTpuRaggedDot
from tokamax_kernels.ragged_dot.pallas_triton import PallasTritonRaggedDot
from tokamax_kernels.ragged_dot.quantization import is_quantized
from tokamax_pass.core import Family, checks, register_family
from tokamax_pass.core.registry import Implementation

FAMILY = register_family(Family(
    name="ragged_dot",
    implementations={"mosaic_gpu": PallasMosaicGpuRaggedDot,
                     "mosaic_tpu": PallasMosaicTpuRaggedDot,
                     "triton": PallasTritonRaggedDot, "xla": RaggedDot},
    automatic=("mosaic_gpu", "mosaic_tpu", "triton", "xla"),
    # "mosaic_tpu_v2": upstream Tokamax's second TPU kernel; here the Mosaic TPU kernel, so a
    # sequence naming it runs that kernel on TPU and moves on elsewhere.
    aliases={"mosaic": ("mosaic_gpu", "mosaic_tpu"), "mosaic_tpu_v2": ("mosaic_tpu",)},
))

# Upstream Tokamax's `fuse_gateup_activation` names: `act(out[..., :n // 2]) *
# out[..., n // 2:]`. "gelu" is `jax.nn.gelu` as called bare, the tanh approximation, so
# it equals "gelu_tanh" (as upstream).
GATEUP_ACTIVATIONS: Mapping[str, Callable[[Any], Any]] = MappingProxyType({
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
})


def check_upstream_hints(who: str, bypass_device_check: Any, manual_axis_type: Any) -> None:
    """Upstream Tokamax's `bypass_device_check` is `None`, `True` or `False`, and its
    `manual_axis_type` is `None` or a `jax.sharding.ManualAxisType`; neither changes
    anything here, but a value of another kind is a caller's mistake."""
    if bypass_device_check is not None:
        checks.require_bool(who, "bypass_device_check", bypass_device_check)
    if manual_axis_type is not None and not isinstance(
            manual_axis_type, jax.sharding.ManualAxisType):
        raise TypeError(f"{who}: manual_axis_type must be None or a "
                        f"jax.sharding.ManualAxisType, got {manual_axis_type!r}")


def check_forward_options(who: str, zero_initialize: Any,
                          fuse_gateup_activation: Any) -> None:
    """Upstream Tokamax's `zero_initialize` is a bool (rows past the groups are zeros in
    every implementation here, so it changes nothing); `fuse_gateup_activation` is `None`
    or a name: one of `GATEUP_ACTIVATIONS`, else `NotImplementedError` (upstream's kernel
    for TPU knows more names, e.g. "swigluoai")."""
    checks.require_bool(who, "zero_initialize", zero_initialize)
    if fuse_gateup_activation is None:
        return
    if not isinstance(fuse_gateup_activation, str):
        raise TypeError(f"{who}: fuse_gateup_activation must be None or a name, got "
                        f"{fuse_gateup_activation!r}")
    if fuse_gateup_activation not in GATEUP_ACTIVATIONS:
        raise NotImplementedError(
            f"{who}: fuse_gateup_activation={fuse_gateup_activation!r} is not supported; "
            f"supported: {sorted(GATEUP_ACTIVATIONS)}")


def ragged_dot(lhs: Any, rhs: Any, group_sizes: Any, precision: Any = None,
               preferred_element_type: Any = None, group_offset: Any = None,
               activation: Callable[[Any], Any] | None = None,
               manual_axis_type: Any = None, *,
               implementation: Implementation = None,
               bypass_device_check: bool | None = None,
               zero_initialize: bool = False,
               fuse_gateup_activation: str | None = None) -> Any:
    """Grouped matmul: rows of `lhs` (M, K) in consecutive groups times `rhs[g]` (G, K, N).

    Group g takes `group_sizes[g]` rows (int32, shape (G,), summing to at most M; or a
    `RaggedDotGroupSizes`, whose `value` is used);
    rows past the sum give zeros, as in `jax.lax.ragged_dot`. Concrete sizes are checked
    (each >= 0, summing to at most M); traced ones cannot be, and behave as in
    `jax.lax.ragged_dot`: groups end at row M (under `jax.vmap`, per batch entry, the
    other entries unaffected). The gradients are ragged dots of their own, tuned
    separately.
    `implementation`: `None` (the plain-JAX path, unless a measurement shows a kernel faster
    here: see `tokamax_pass.core.selection`), a name
    from `FAMILY.implementations` (`"mosaic"`: the Mosaic kernel of the platform, GPU or
    TPU), an `Op` instance, a function, or a sequence of those, tried in order until one
    does not raise `NotImplementedError` (as upstream Tokamax does). A function is called
    as `f(lhs, rhs, group_sizes, **keywords)` with the `precision` and
    `preferred_element_type` given (`jax.lax.ragged_dot` is one).

    `activation` (upstream Tokamax's): a function applied to the whole product (rows past
    the groups included), in the accumulator's dtype (float32 for 16-bit floats) before
    the cast to the output dtype; it runs after the op, not fused into a kernel.
    `fuse_gateup_activation` (upstream Tokamax's): `"silu"`, `"gelu"` or `"gelu_tanh"`
    (`"gelu"` is `jax.nn.gelu`'s default, the tanh approximation, as upstream), for rhs
    holding the gate and up weights side by side along N: the output is
    `act(out[:, :N // 2]) * out[:, N // 2:]`, (M, N // 2), in the accumulator's dtype,
    before `activation`; it too runs after the op, so every implementation takes it and
    it has a gradient. Another name raises `NotImplementedError`.
    `zero_initialize` (upstream Tokamax's: zeros in the rows past the groups) is accepted
    and changes nothing: every implementation here gives those zeros.
    `group_offset` is not supported (`NotImplementedError`, as upstream Tokamax).
    `bypass_device_check` (upstream Tokamax's: `True` skips its check of this machine's
    devices) is accepted and changes nothing: implementations are checked against the
    platform being lowered for, never against this machine's devices. So is upstream's
    `manual_axis_type` (`None` or a `jax.sharding.ManualAxisType`, which upstream's TPU
    kernel is told inside a `shard_map`): the implementations here read the manual axes
    from the operands' own types.

    Either operand may be quantized: a `QuantizedArray` or a qwix `QArray` (any object
    with its fields), int8 or float8 values with scales; see `quantized.py` for where
    the scales apply, which implementations take them (`xla`, `triton`; `None` runs
    `triton` where the target runs it, else `xla`) and the gradients (zeros for a
    quantized operand).
    """
    check_upstream_hints("ragged_dot", bypass_device_check, manual_axis_type)
    check_forward_options("ragged_dot", zero_initialize, fuse_gateup_activation)
    if group_offset is not None:
        raise NotImplementedError("ragged_dot: group_offset is not supported")
    if isinstance(group_sizes, RaggedDotGroupSizes):
        group_sizes = group_sizes.value
    _check_output_kind(lhs, rhs, preferred_element_type)

    def call(out_type: Any) -> Any:
        keywords = {k: x for k, x in (("precision", precision),
                                      ("preferred_element_type", out_type)) if x is not None}
        return _dispatch.call(
            implementation, lambda impl: run_family(impl, out_type),
            lambda f: f(lhs, rhs, group_sizes, **keywords), op="ragged_dot")

    def run_family(impl: Implementation, out_type: Any) -> Any:
        if is_quantized(lhs) or is_quantized(rhs):
            return quantized.ragged_dot(
                FAMILY, lhs, rhs, jnp.asarray(group_sizes),
                precision=canonical_precision(precision, op="ragged_dot"),
                preferred_element_type=out_type, implementation=impl)
        return FAMILY(impl, lhs, rhs, group_sizes, precision=precision,
                      preferred_element_type=out_type)

    return with_activation(call, lhs, rhs, preferred_element_type, activation,
                           fuse_gateup_activation)


def with_activation(call: Callable[[Any], Any], lhs: Any, rhs: Any,
                    preferred_element_type: Any, activation: Callable[[Any], Any] | None,
                    fuse_gateup_activation: str | None = None) -> Any:
    """`call(preferred_element_type)`, or with `fuse_gateup_activation` (a name of
    `GATEUP_ACTIVATIONS`) and then `activation`: applied to the product in the
    accumulator's dtype, cast to the output dtype (a float output accumulates in at least
    float32)."""
    if activation is None and fuse_gateup_activation is None:
        return call(preferred_element_type)
    if activation is not None and not callable(activation):
        raise TypeError(f"ragged_dot: activation must be a function or None, got "
                        f"{activation!r}")
    out_dtype = (jnp.dtype(preferred_element_type) if preferred_element_type is not None
                 else jnp.result_type(lhs.dtype, rhs.dtype))
    floating = jnp.issubdtype(out_dtype, jnp.floating)
    if fuse_gateup_activation is not None and not floating:
        raise ValueError(f"ragged_dot: fuse_gateup_activation needs a floating output, "
                         f"got {out_dtype}")
    out = call(jnp.promote_types(out_dtype, jnp.float32) if floating
               else preferred_element_type)
    if fuse_gateup_activation is not None:
        if out.shape[-1] % 2:
            raise ValueError(f"ragged_dot: fuse_gateup_activation splits the output's last "
                             f"dimension into gate and up halves; it is odd ({out.shape[-1]})")
        gate, up = jnp.split(out, 2, axis=-1)
        out = GATEUP_ACTIVATIONS[fuse_gateup_activation](gate) * up
    if activation is not None:
        out = activation(out)
    return out.astype(out_dtype) if floating else out


def _check_output_kind(lhs: Any, rhs: Any, preferred_element_type: Any) -> None:
    """`ValueError` for an output dtype that cannot hold the products (they were cast or
    wrapped to it silently, or failed deep in `jax.lax` naming no op):

    - float operands (either one: an int8 lhs times a bf16 rhs into int32 truncated the
      rhs's fractions) need a floating output;
    - integer operands need an output at least as wide as the wider operand, not bool
      (`jax.lax` raised a TypeError naming no op);
    - integer operands of one width but mixed signedness (uint8 times int8) gave the
      signed dtype, which cannot hold the unsigned operand's values (200 read as -56):
      they need an output both fit in (int16 for uint8 and int8).

    Unreadable dtypes and other operands are `bind`'s to name."""
    try:
        dtypes = (jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))
        wanted = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
    except (TypeError, AttributeError):
        return
    floats = [d for d in dtypes if jnp.issubdtype(d, jnp.floating)]
    if floats:
        if wanted is not None and not jnp.issubdtype(wanted, jnp.floating):
            raise ValueError(
                f"ragged_dot: preferred_element_type must be a floating dtype for {floats[0]} "
                f"operands (the products would be cast to it), got {wanted}")
        return
    if not all(jnp.issubdtype(d, jnp.integer) for d in dtypes):
        return
    if wanted is None:
        unsigned = [d for d in dtypes if jnp.issubdtype(d, jnp.unsignedinteger)]
        signed = [d for d in dtypes if jnp.issubdtype(d, jnp.signedinteger)]
        if unsigned and signed and unsigned[0].itemsize >= signed[0].itemsize:
            wide = (f"jnp.int{16 * unsigned[0].itemsize}" if unsigned[0].itemsize < 4
                    else "jnp.float32")
            raise ValueError(
                f"ragged_dot: integer operands of mixed signedness, lhs {dtypes[0]} and rhs "
                f"{dtypes[1]}, give a result in one operand's dtype, which cannot hold the "
                f"other's values; pass preferred_element_type={wide} (or cast the operands "
                f"to one dtype)")
        return
    holds = all(jnp.iinfo(wanted).min <= jnp.iinfo(d).min
                and jnp.iinfo(wanted).max >= jnp.iinfo(d).max for d in dtypes
                ) if jnp.issubdtype(wanted, jnp.integer) else (
        wanted != jnp.bool_ and wanted.itemsize >= max(d.itemsize for d in dtypes))
    if not holds:
        raise ValueError(
            f"ragged_dot: preferred_element_type {wanted} cannot hold the products of "
            f"lhs {dtypes[0]} and rhs {dtypes[1]}; pass a dtype they fit in, e.g. "
            f"jnp.int32 or jnp.float32")
