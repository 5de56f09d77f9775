"""A tunable user-defined op for the pass and export tests: `y = x * x * scale`, computed in
row chunks (importable by name), and results that pick its configs."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_pass.autotuning import AutotuningResult
from tokamax_pass.autotuning.entry import Entry, Measurement
from tokamax_pass.core import BoundArguments, Family, NullConfig, Op, VjpOp, register_family


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    chunk: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Square(Op[NullConfig]):
    """`x * x * scale` (scale broadcast over rows); the XLA reference."""

    def bind(self, x: Any, scale: Any) -> BoundArguments:
        if x.ndim != 2 or scale.shape != (x.shape[1],):
            raise ValueError(f"square: x must be (rows, n) and scale (n,), got {x.shape}, "
                             f"{scale.shape}")
        return BoundArguments(self, dict(x=x, scale=scale))

    def _fwd(self, x, scale, *, config, return_residuals):
        return x * x * scale, None


def _chunked(fn, x, chunk):
    rows, n = x.shape
    return fn(x.reshape(rows // chunk, chunk, n)).reshape(rows, n)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedSquare(Square):
    config_cls = ChunkConfig
    implementation = "chunked"
    # A user's op may declare its kernel safe to run unmeasured; these tests exercise
    # config resolution, not the choice of implementation.
    plain_jax_path = True

    def check_supported(self, ba, target):
        super().check_supported(ba, target)
        if ba.arguments["x"].shape[0] % 4:
            raise NotImplementedError("rows must be a multiple of 4")

    def _fwd(self, x, scale, *, config, return_residuals):
        return _chunked(lambda c: c * c * scale, x, config.chunk), None

    def _get_heuristics_config(self, ba):
        return ChunkConfig(2)

    def _get_autotuning_configs(self, ba):
        return {ChunkConfig(1), ChunkConfig(4)}

    def _default_vjp(self):
        return ChunkedSquareVjp()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedSquareVjp(VjpOp):
    config_cls = ChunkConfig
    implementation = "chunked"
    plain_jax_path = True

    def _fwd(self, residuals, out, dout, *, config, return_residuals, x, scale):
        dx = _chunked(lambda c: c, 2 * x * scale * dout, config.chunk)
        return {"x": dx, "scale": jnp.sum(x * x * dout, axis=0)}, None

    def _get_heuristics_config(self, ba):
        return ChunkConfig(2)

    def _get_autotuning_configs(self, ba):
        return {ChunkConfig(1), ChunkConfig(4)}


SQUARE = register_family(Family("square",
                                {"chunked": ChunkedSquare, "xla": Square},
                                automatic=("chunked", "xla")))


def square(x, scale, implementation=None):
    return SQUARE(implementation, x, scale)


def square_loss(x, scale):
    return jnp.sum(jnp.sin(square(x, scale)))


def fastest_result(*pairs: tuple[BoundArguments, ChunkConfig]) -> AutotuningResult:
    """A result measuring one config per call as fastest (what `autotune` would return)."""
    entries = [Entry(ba, {cfg: Measurement(evaluation_times_ms=(1.0,)),
                          ChunkConfig(2): Measurement(evaluation_times_ms=(5.0,))}, {})
               for ba, cfg in pairs]
    return AutotuningResult(jax.devices()[0].device_kind, entries)


def square_bound(x, scale):
    return ChunkedSquare().bind(jax.ShapeDtypeStruct(x.shape, x.dtype),
                                jax.ShapeDtypeStruct(scale.shape, scale.dtype))


def square_vjp_bound(x, scale):
    s = jax.ShapeDtypeStruct
    return ChunkedSquareVjp().bind(None, s(x.shape, x.dtype), s(x.shape, x.dtype),
                                   x=s(x.shape, x.dtype), scale=s(scale.shape, scale.dtype))
