"""A user-defined tunable op family for the autotuning tests (importable by name)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_pass.core import BoundArguments, Family, NullConfig, Op, register_family


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    chunk: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedMatmul(Op[NullConfig]):
    """`x @ w`; the family's XLA reference."""

    def bind(self, x: Any, w: Any) -> BoundArguments:
        if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
            raise ValueError(f"chunked_matmul: x {x.shape} and w {w.shape} do not multiply")
        return BoundArguments(self, {"x": x, "w": w})

    def _fwd(self, x: Any, w: Any, *, config: Any, return_residuals: bool) -> tuple[Any, Any]:
        return jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST), None


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaChunkedMatmul(ChunkedMatmul):
    """`x @ w` summed over K in chunks. A chunk that does not divide K drops the
    remainder (wrong numerics, on purpose: the autotuner must catch it); chunk 0 fails."""

    config_cls = ChunkConfig
    implementation = "xla_chunked"

    def _fwd(self, x: Any, w: Any, *, config: ChunkConfig, return_residuals: bool
             ) -> tuple[Any, Any]:
        if config.chunk <= 0:
            raise ValueError(f"chunk must be positive, got {config.chunk}")
        k = x.shape[1]
        out = jnp.zeros((x.shape[0], w.shape[1]), jnp.float32)
        for start in range(0, k - config.chunk + 1, config.chunk):
            out += jnp.dot(x[:, start:start + config.chunk], w[start:start + config.chunk],
                           precision=jax.lax.Precision.HIGHEST)
        return out.astype(x.dtype), None

    def _get_heuristics_config(self, ba: BoundArguments) -> ChunkConfig:
        return ChunkConfig(chunk=ba.arguments["x"].shape[1] // 2)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[ChunkConfig]:
        k = ba.arguments["x"].shape[1]
        return {ChunkConfig(k), ChunkConfig(k // 4), ChunkConfig(0), ChunkConfig(k - 8)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlowLoweringMatmul(XlaChunkedMatmul):
    """`XlaChunkedMatmul` declared slow to lower, as Mosaic GPU kernels are: the autotuner
    sends its candidates to worker processes."""

    slow_lowering = True


FAMILY = register_family(Family(
    name="chunked_matmul",
    implementations={"xla": ChunkedMatmul, "xla_chunked": XlaChunkedMatmul},
    automatic=("xla_chunked", "xla"),
))


def chunked_matmul(x: Any, w: Any, *, implementation: Any = None) -> Any:
    return FAMILY(implementation, x, w)


def loss(x: Any, w: Any) -> Any:
    """A module-level function with one tunable op (CLI tests import it by name)."""
    return jnp.sum(chunked_matmul(x, w, implementation="xla_chunked") ** 2)
