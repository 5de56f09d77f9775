"""Small helpers shared by the Pallas Triton kernels: dtype and device checks, sizes."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from tokamax_pass.core import Target

# Dtypes Triton computes with; float64 has no tensor-core or fast path there.
TRITON_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonKernel:
    """Mixin of the Pallas Triton implementations (listed before the family class).

    They run on CUDA GPUs, or on any platform in the Pallas interpreter with
    `interpret=True` (how the CPU tests run them).
    """

    interpret: bool = False

    implementation: ClassVar[str] = "triton"
    platforms: ClassVar[frozenset[str] | None] = frozenset({"cuda"})

    def check_supported_target(self, target: Target) -> None:
        if self.interpret:
            return
        super().check_supported_target(target)  # type: ignore[misc]
        if target.platform == "cuda" and target.device_kind is None:
            # Pallas lowers Triton for the GPU it names (its compute capability); an
            # export for `platforms=["cuda"]` with no device kind names none.
            raise NotImplementedError(
                f"{type(self).__name__} lowers for a known GPU: name it (export's "
                f"device_kind=, tokamax-pass export --device-kind, or an abstract mesh's "
                f"AbstractDevice); use implementation='xla' or None")


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiles of a Triton matmul kernel (powers of 2; blocks >= 16 for tensor cores).

    `block_m` x `block_n` is a program's output tile and `block_k` its contraction step,
    unless a kernel says otherwise (the ragged dot's drhs variant does).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1) or value < (16 if name != "num_warps" else 1):
                raise ValueError(f"{type(self).__name__}.{name} must be a power of 2 "
                                 f"(>= 16 for blocks), got {value}")


def require_triton_dtype(name: str, value: Any) -> None:
    """`NotImplementedError` (so `implementation=None` falls back) for non-Triton dtypes."""
    if value is not None and jnp.dtype(value.dtype) not in TRITON_DTYPES:
        raise NotImplementedError(
            f"{name} has dtype {value.dtype}; the Triton kernel handles f16, bf16 and f32"
        )


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def compiler_params(num_warps: int, num_stages: int) -> pltriton.CompilerParams:
    """Triton compiler params: passing them is what makes the GPU backend pick Triton."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
