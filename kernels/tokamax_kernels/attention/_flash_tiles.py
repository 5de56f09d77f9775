"""The tile math of flash attention that every tiled kernel shares (Pallas Triton and
Pallas Mosaic TPU): the static facts of a call (`KernelSpec`), logits in the base-2 domain
(`log2(e)` folded into the scale so the softmax uses `exp2`), the positional visibility
of a tile, and the ranges of blocks a tile row or column can see, so fully masked blocks
are skipped and fully visible ones skip the mask.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Natural-log logits below this (after the scale and a bias) count as hidden; see `logits2`.
HIDDEN_LOGIT = -1e5


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
        # Held at a floor the compiler cannot blur: a bias near float32's lowest value
        # (Hugging Face's padding bias) would overflow to -inf here, a row of them to NaN,
        # and one of -1e10 leaves logits so large that a fused `s - max` is off by
        # thousands (inf or 0). A row a bias hides whole has every logit exactly at the
        # floor, so it averages its values, as plain JAX does.
        return jnp.maximum(x * LOG2E, HIDDEN_LOGIT * LOG2E), None
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
