"""Shared pieces of the Pallas Triton flash-attention kernels (forward, dK/dV, dQ).

One `KernelSpec` carries every static choice a kernel body needs (scale, window,
soft cap, which optional inputs exist); the helpers below compute the logits in the
base-2 domain (`log2(e)` folded into the scale so the softmax uses `exp2`), the
positional visibility of a tile, and the ranges of blocks a tile row or column
can see, so fully masked blocks are skipped and fully visible ones skip the mask.
The input checks and the padding of the operands to whole blocks live here too: the
forward op and its VJP op both use them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tokamax_pass.core import BoundArguments, Target

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Static facts shared by the forward and backward kernels.

    `left`/`right`: visible keys of query `i` are `i + offset - left <= j <= i + offset + right`
    (`None` = unbounded); causal is `right = 0`. `seq_q`/`seq_k` are the true (unpadded)
    lengths; lengths arrays, when given, shorten them per batch row.
    """

    scale: float
    left: int | None
    right: int | None
    offset: int
    soft_cap: float | None
    seq_q: int
    seq_k: int
    has_bias: bool
    has_mask: bool
    has_q_lengths: bool
    has_kv_lengths: bool
    precision: Any

    @property
    def positional(self) -> bool:
        """Whether some tiles need a positional mask (window, causal or padding)."""
        return self.left is not None or self.right is not None

    def dot(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """`a @ b` accumulated in float32."""
        return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=self.precision)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def clamp_block(block: int, seq: int) -> int:
    """A block no longer than the (power-of-2 padded, at least 16) sequence."""
    return max(16, min(block, pl_next_pow2(seq)))


def pl_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def logits2(spec: KernelSpec, qk: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, Any]:
    """Base-2 logits `log2(e) * softcap(scale * qk + bias)` and what their derivative needs.

    Returns `(s2, tanh)`; `tanh` is the soft cap's `tanh(x / cap)` (or `None`).
    """
    if bias is None and spec.soft_cap is None:
        return qk * (spec.scale * LOG2E), None
    x = qk * spec.scale
    if bias is not None:
        x = x + bias.astype(jnp.float32)
    if spec.soft_cap is None:
        return x * LOG2E, None
    t = jnp.tanh(x * (1.0 / spec.soft_cap))
    return t * (spec.soft_cap * LOG2E), t


def dlogits(spec: KernelSpec, ds: jax.Array, t: jax.Array | None) -> jax.Array:
    """Gradient w.r.t. `scale * qk + bias` from the gradient `ds` w.r.t. the capped logits."""
    return ds if t is None else ds * (1.0 - t * t)


def visible(spec: KernelSpec, rows: jax.Array, cols: jax.Array, kv_len: Any, *,
            transposed: bool = False) -> jax.Array:
    """Positional visibility (window and key length) of the tile `rows x cols`, or of
    `cols x rows` when `transposed`."""
    r, c = (rows[None, :], cols[:, None]) if transposed else (rows[:, None], cols[None, :])
    ok = c < kv_len
    diff = c - (r + spec.offset)
    if spec.right is not None:
        ok = ok & (diff <= spec.right)
    if spec.left is not None:
        ok = ok & (diff >= -spec.left)
    return ok


def _div(x: Any, y: int) -> Any:
    return lax.div(x, jnp.int32(y)) if isinstance(x, jax.Array) else x // y


def kv_block_ranges(spec: KernelSpec, r0: Any, bq: int, bk: int, num_kb: int, kv_len: Any
                    ) -> tuple[Any, Any, Any, Any]:
    """For the query rows `[r0, r0 + bq)`: kv blocks `[a, b)` masked, `[b, c)` fully visible,
    `[c, d)` masked; blocks outside `[a, d)` see nothing."""
    r0 = r0 + spec.offset
    r1 = r0 + bq - 1
    zero = jnp.int32(0)
    a = zero if spec.left is None else _div(jnp.maximum(r0 - spec.left, 0), bk)
    full_lo = zero if spec.left is None else _div(jnp.maximum(r1 - spec.left + bk - 1, 0), bk)
    d = jnp.int32(num_kb) if spec.right is None else _div(jnp.maximum(r1 + spec.right + bk, 0), bk)
    full_hi = (jnp.int32(num_kb) if spec.right is None
               else _div(jnp.maximum(r0 + spec.right + 1, 0), bk))
    d = jnp.minimum(d, _div(kv_len + bk - 1, bk))
    full_hi = jnp.minimum(full_hi, _div(kv_len, bk))
    d = jnp.maximum(d, a)
    b = jnp.clip(full_lo, a, d)
    c = jnp.clip(full_hi, b, d)
    return a, b, c, d


def q_block_ranges(spec: KernelSpec, c0: Any, bk: int, bq: int, num_qb: int, q_len: Any,
                   kv_len: Any) -> tuple[Any, Any, Any, Any]:
    """For the key columns `[c0, c0 + bk)`: q blocks `[a, b)` masked, `[b, c)` fully visible,
    `[c, d)` masked (the transpose of `kv_block_ranges`)."""
    c1 = c0 + bk - 1
    zero = jnp.int32(0)
    a = zero if spec.right is None else _div(jnp.maximum(c0 - spec.offset - spec.right, 0), bq)
    full_lo = (zero if spec.right is None
               else _div(jnp.maximum(c1 - spec.offset - spec.right + bq - 1, 0), bq))
    d = (jnp.int32(num_qb) if spec.left is None
         else _div(jnp.maximum(c1 - spec.offset + spec.left + bq, 0), bq))
    full_hi = (jnp.int32(num_qb) if spec.left is None
               else _div(jnp.maximum(c0 - spec.offset + spec.left + 1, 0), bq))
    d = jnp.minimum(d, _div(q_len + bq - 1, bq))
    d = jnp.where(c0 < kv_len, d, zero)
    # A key block that crosses the key length needs its columns masked for every row.
    full_hi = jnp.where(c1 < kv_len, full_hi, zero)
    d = jnp.maximum(d, a)
    b = jnp.clip(full_lo, a, d)
    c = jnp.clip(full_hi, b, d)
    return a, b, c, d


MAX_HEAD_DIM = 256


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
