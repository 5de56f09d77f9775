"""What the Pallas Triton flash-attention ops (forward and VJP) share: the input checks,
the `KernelSpec` of a call, block sizes and the padding of the operands to whole blocks.
The tile math the kernel bodies use is `_flash_tiles` (the Mosaic TPU kernels use it too).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tokamax_kernels._gpu import shared_memory_per_block
from tokamax_kernels.attention._flash_tiles import KernelSpec
from tokamax_pass.core import BoundArguments, Target


def clamp_block(block: int, seq: int) -> int:
    """A block no longer than the (power-of-2 padded, at least 16) sequence."""
    return max(16, min(block, pl_next_pow2(seq)))


def pl_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


MAX_HEAD_DIM = 256

# The most shared memory the heuristics let one loop's software pipeline take: what
# three stages of 128-row bf16 key and value tiles at head dim 128 take, tiles that
# compile and ran fastest on the H200 (less where the GPU has less). Float32, wider
# heads, a bias or a mask get fewer rows, then fewer stages, to stay within it (the
# same tiles in float32 ask for more than the H200's shared memory and fail to compile).
PIPELINE_BUDGET = 3 * 128 * (128 + 128) * 2


def pipeline_bytes(*, stages: int, rows: int, head_dims: tuple[int, int], dtype: Any,
                   pair_bytes: int = 0, across: int = 0) -> int:
    """Shared memory of a loop that streams `stages` buffers of two tiles of `rows` rows
    (keys and values, or queries and output gradients) at the (padded) `head_dims` in
    `dtype`, and, with `pair_bytes` (a bias's itemsize, plus 1 for a mask), the bias and
    mask tiles of `rows` x `across` (the block the loop does not stream)."""
    width = sum(padded_head_dim(d) for d in head_dims)
    return stages * rows * (width * jnp.dtype(dtype).itemsize + across * pair_bytes)


def fit_pipeline(*, rows: int, stages: int, head_dims: tuple[int, int], dtype: Any,
                 pair_bytes: int = 0, across: int = 0) -> tuple[int, int]:
    """`(rows, stages)` shrunk until their pipeline (`pipeline_bytes`) fits
    `PIPELINE_BUDGET` and the GPU: rows halved down to 32 first (a smaller tile costs
    less than a shallower pipeline), then stages down to 1."""
    budget = min(PIPELINE_BUDGET, shared_memory_per_block())
    while pipeline_bytes(stages=stages, rows=rows, head_dims=head_dims, dtype=dtype,
                         pair_bytes=pair_bytes, across=across) > budget:
        if rows > 32:
            rows //= 2
        elif stages > 1:
            stages -= 1
        else:
            break
    return rows, stages


def pipeline_fits(*, stages: int, rows: int, head_dims: tuple[int, int], dtype: Any) -> bool:
    """Whether the key/value (or query/gradient) tiles alone fit the GPU's shared memory:
    a config for which this is false cannot compile."""
    needed = pipeline_bytes(stages=stages, rows=rows, head_dims=head_dims, dtype=dtype)
    return needed <= shared_memory_per_block()


def check_pipeline_fits(what: str, fields: str, *, stages: int, rows: int,
                        head_dims: tuple[int, int], dtype: Any) -> None:
    """`NotImplementedError` naming the config fields where the streamed tiles alone need
    more shared memory than the GPU has (`pipeline_fits`): raised when the kernel is
    lowered for the GPU, not as a compile failure deep inside XLA."""
    needed = pipeline_bytes(stages=stages, rows=rows, head_dims=head_dims, dtype=dtype)
    if needed <= shared_memory_per_block():
        return
    raise NotImplementedError(
        f"{what}: {fields} ({rows} rows, {stages} stages) need {needed // 1024} KiB of "
        f"shared memory for head dims {head_dims} in {jnp.dtype(dtype).name}, more than "
        f"the {shared_memory_per_block() // 1024} KiB the GPU has; use fewer rows or stages")


def pair_bytes(bias: Any, mask: Any) -> int:
    """Bytes a call's bias and mask tiles take per query-key pair: the bias's itemsize,
    plus 1 for the mask (streamed as int8)."""
    return (0 if bias is None else jnp.dtype(bias.dtype).itemsize) + (mask is not None)


def check_inputs(ba: BoundArguments, target: Target | None, what: str) -> None:
    """What both Triton kernels need of the inputs and the device."""
    query = ba.arguments["query"]
    if target is not None and target.platform == "cuda" and not target.is_ampere_or_newer:
        raise NotImplementedError(f"{what} needs an Ampere or newer GPU, not {target.device_kind}")
    if jnp.dtype(query.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                      jnp.dtype(jnp.float32)):
        raise NotImplementedError(f"{what} supports bf16, f16 and f32, not {query.dtype}")
    for name in ("query", "value"):
        if ba.arguments[name].shape[-1] > MAX_HEAD_DIM:
            raise NotImplementedError(f"{what} supports head_dim <= {MAX_HEAD_DIM}, got "
                                      f"{ba.arguments[name].shape[-1]} for {name}")


def kernel_spec(arguments: dict[str, Any], seq_q: int, seq_k: int) -> KernelSpec:
    """The kernels' static view of the family's arguments."""
    window = arguments["local_window_size"]
    left, right = window if window is not None else (None, None)
    if arguments["is_causal"]:
        right = 0 if right is None else min(right, 0)
    return KernelSpec(
        scale=arguments["scale"], left=left, right=right, offset=0,
        soft_cap=arguments["logits_soft_cap"], seq_q=seq_q, seq_k=seq_k,
        has_bias=arguments["bias"] is not None, has_mask=arguments["mask"] is not None,
        has_q_lengths=arguments["query_seq_lengths"] is not None,
        has_kv_lengths=arguments["key_value_seq_lengths"] is not None,
        precision=arguments["precision"],
    )


def pad_axis(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def padded_head_dim(head_dim: int) -> int:
    return max(16, pl_next_pow2(head_dim))


def prepare_pairwise(x: jax.Array | None, seq_q: int, seq_k: int, pad_q: int, pad_k: int,
                     dtype: Any = None) -> jax.Array | None:
    """A bias or mask, broadcast along its query/key axes and padded to the kernel tiles."""
    if x is None:
        return None
    x = jnp.broadcast_to(x, (*x.shape[:2], seq_q, seq_k))
    if dtype is not None:
        x = x.astype(dtype)
    return pad_axis(pad_axis(x, 2, pad_q), 3, pad_k)


def prepare_qkv(q: jax.Array, k: jax.Array, v: jax.Array, pad_q: int, pad_k: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    d = padded_head_dim(q.shape[-1])
    q = pad_axis(pad_axis(q, 1, pad_q), 3, d)
    k = pad_axis(pad_axis(k, 1, pad_k), 3, d)
    v = pad_axis(pad_axis(v, 1, pad_k), 3, padded_head_dim(v.shape[-1]))
    return q, k, v


def lengths_i32(x: jax.Array | None) -> jax.Array | None:
    return None if x is None else x.astype(jnp.int32)
