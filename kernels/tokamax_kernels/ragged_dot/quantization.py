"""Quantized operands: `QuantizedArray`, and qwix `QArray`s read by their fields.

A quantized array stores 8-bit (or narrower) `qvalue`s with `scale`s of the same rank
whose every dimension divides the value's: each scale covers one tile of values, so
`scale.shape == shape` is per element, a 1 is one scale for the whole axis (per channel
of the other axes), and anything between is per group ("subchannel"). The array it
stands for is `(qvalue - zero_point) * scale`, each scale repeated over its tile, in
the scale's dtype (its `dtype`, as qwix has it).

qwix is not a dependency: any object with qwix `QArray`'s fields (`qvalue`, `scale`,
`zero_point`, `qtype`) is taken as one (`is_quantized`, `as_quantized_array`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The value dtypes a quantized array may store (one byte or less, as qwix requires).
VALUE_DTYPES = tuple(jnp.dtype(d) for d in (
    jnp.int8, jnp.uint8, jnp.int4, jnp.float8_e4m3fn, jnp.float8_e5m2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """Quantized values with per-tile scales (and an optional zero point).

    Attributes:
      qvalue: the stored values (int8, uint8, int4, float8_e4m3fn or float8_e5m2).
      scale: one scale per tile, same rank as `qvalue`, each dimension dividing its own.
      zero_point: `None` (symmetric), or the stored value of 0.0, shaped like `scale`.
      qtype: the values' logical dtype (defaults to `qvalue.dtype`); not traced.
    """

    qvalue: jax.Array
    scale: jax.Array
    zero_point: jax.Array | None = None
    qtype: Any = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self) -> None:
        if self.qtype is None:
            object.__setattr__(self, "qtype", self.qvalue.dtype)
        _check_fields(self.qvalue, self.scale, self.zero_point)

    shape = property(lambda self: tuple(self.qvalue.shape))
    ndim = property(lambda self: self.qvalue.ndim)
    dtype = property(lambda self: self.scale.dtype)

    @property
    def tile_shape(self) -> tuple[int, ...]:
        """Values per scale along each axis."""
        return tuple(o // s for o, s in zip(self.shape, self.scale.shape, strict=True))

    def swapaxes(self, axis1: int, axis2: int) -> QuantizedArray:
        """The same array with two axes swapped (values, scales and zero point alike)."""
        return jax.tree.map(lambda x: jnp.swapaxes(x, axis1, axis2), self)

    @classmethod
    def quantize(cls, x: jax.Array, qtype: Any, *, channelwise_axes: Sequence[int] = (),
                 tiled_axes: Mapping[int, int] | None = None) -> QuantizedArray:
        """Symmetric absmax quantization of `x` to `qtype` (int8, int4 or a float8).

        `channelwise_axes` keep one scale per index; `tiled_axes` maps an axis to its tile
        size (one scale per tile); every other axis shares one scale. Scales take `x`'s
        dtype. Tiles of zeros get scale 1, and an empty axis one scale (a scale per index
        of it would be no scale, which `QuantizedArray` does not take)."""
        qtype = jnp.dtype(qtype)
        signed = [d for d in VALUE_DTYPES if d != jnp.dtype(jnp.uint8)]
        if qtype not in signed:
            raise ValueError(f"quantize: qtype must be one of {[str(d) for d in signed]} "
                             f"(symmetric quantization), got {qtype}")
        tiled = dict(tiled_axes or {})
        scale_shape = []
        for axis, size in enumerate(x.shape):
            if axis in tiled:
                if size % tiled[axis]:
                    raise ValueError(f"quantize: tile {tiled[axis]} does not divide axis "
                                     f"{axis} of size {size}")
                scale_shape.append(size // tiled[axis])
            else:
                scale_shape.append(size if axis in channelwise_axes else 1)
        scale_shape = [max(s, 1) for s in scale_shape]
        tile = tuple(o // s for o, s in zip(x.shape, scale_shape, strict=True))
        blocks = jnp.abs(x.astype(jnp.float32)).reshape(
            [d for s, t in zip(scale_shape, tile, strict=True) for d in (s, t)])
        absmax = blocks.max(axis=tuple(range(1, 2 * x.ndim, 2)), initial=0.0)
        largest = float(jnp.finfo(qtype).max if jnp.issubdtype(qtype, jnp.floating)
                        else jnp.iinfo(qtype).max)
        scale = jnp.where(absmax > 0, absmax / largest, 1.0).astype(x.dtype)
        scaled = x.astype(jnp.float32) / _repeat(scale.astype(jnp.float32), x.shape)
        if jnp.issubdtype(qtype, jnp.integer):
            info = jnp.iinfo(qtype)
            scaled = jnp.clip(jnp.round(scaled), info.min, info.max)
        else:
            scaled = jnp.clip(scaled, -largest, largest)
        return cls(scaled.astype(qtype), scale)


def _check_fields(qvalue: Any, scale: Any, zero_point: Any) -> None:
    """`ValueError` for scales or a zero point that do not tile the values."""
    if not hasattr(qvalue, "shape") or not hasattr(scale, "shape"):
        return  # pytree internals (JAX rebuilds dataclasses with placeholder leaves)
    for name, x in (("scale", scale), ("zero_point", zero_point)):
        if x is None:
            continue
        if len(x.shape) != len(qvalue.shape) or any(
                s == 0 or o % s for o, s in zip(qvalue.shape, x.shape, strict=True)):
            raise ValueError(f"QuantizedArray: {name} shape {tuple(x.shape)} must have the "
                             f"rank of qvalue {tuple(qvalue.shape)} and divide each of its "
                             f"dimensions")
    if hasattr(qvalue, "dtype") and jnp.dtype(qvalue.dtype).itemsize > 1:
        raise ValueError(f"QuantizedArray: qvalue must be 8-bit or narrower, got "
                         f"{qvalue.dtype}")


def is_quantized(x: Any) -> bool:
    """True for a `QuantizedArray` or any object with qwix `QArray`'s fields."""
    return isinstance(x, QuantizedArray) or (
        hasattr(x, "qvalue") and hasattr(x, "scale") and hasattr(x, "zero_point"))


def as_quantized_array(x: Any) -> QuantizedArray:
    """`x` (a `QuantizedArray` or a qwix-like `QArray`) as a `QuantizedArray`."""
    if isinstance(x, QuantizedArray):
        return x
    return QuantizedArray(jnp.asarray(x.qvalue), jnp.asarray(x.scale),
                          None if x.zero_point is None else jnp.asarray(x.zero_point),
                          getattr(x, "qtype", None))


def _repeat(scale: jax.Array, shape: Sequence[int]) -> jax.Array:
    """`scale` repeated over its tiles to `shape`."""
    for axis, (o, s) in enumerate(zip(shape, scale.shape, strict=True)):
        if o != s:
            scale = jnp.repeat(scale, o // s, axis=axis)
    return scale


def dequantize(x: Any) -> jax.Array:
    """The array `x` stands for: `(qvalue - zero_point) * scale` in the scale's dtype."""
    x = as_quantized_array(x)
    values = x.qvalue.astype(jnp.float32)
    if x.zero_point is not None:
        values = values - _repeat(x.zero_point.astype(jnp.float32), x.shape)
    return (values * _repeat(x.scale.astype(jnp.float32), x.shape)).astype(x.scale.dtype)


def blocked_scale(x: Any, contracting_axis: int) -> tuple[jax.Array, jax.Array | None]:
    """`(values, scale)` for a dot over `contracting_axis`: the stored values and their
    scales repeated to full size on the other axes, one per block on the contracting
    axis (its size there: the number of blocks, 1 when constant along it). A plain array
    gives `(x, None)`; a quantized one with a zero point is dequantized instead
    (`(dequantize(x), None)`)."""
    if not is_quantized(x):
        return x, None
    x = as_quantized_array(x)
    if x.zero_point is not None:
        return dequantize(x), None
    full = list(x.shape)
    full[contracting_axis] = x.scale.shape[contracting_axis]
    return x.qvalue, _repeat(x.scale, full)


def post_scale(x: Any, contracting_axis: int) -> tuple[jax.Array, jax.Array | None]:
    """`blocked_scale` where the scales are constant along the contracting axis (size 1
    there: they multiply the product after the dot); others are dequantized."""
    values, scale = blocked_scale(x, contracting_axis)
    if scale is not None and scale.shape[contracting_axis] != 1:
        return dequantize(x), None
    return values, scale


def zero_cotangent(x: Any) -> Any:
    """A zero cotangent shaped like `x`'s leaves (`float0` for integer leaves)."""
    def zero(leaf: Any) -> Any:
        if jnp.issubdtype(leaf.dtype, jnp.integer) or leaf.dtype == jnp.bool_:
            return np.zeros(leaf.shape, jax.dtypes.float0)
        return jnp.zeros_like(leaf)
    return jax.tree.map(zero, x)
