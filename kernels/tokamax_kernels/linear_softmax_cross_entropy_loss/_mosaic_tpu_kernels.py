"""The Pallas Mosaic TPU kernels of the LM-head loss: forward, dx and dweights.

All three walk (token block, vocabulary block) tiles of the logits and build each tile
in a float32 VMEM accumulator over H blocks: `acc += x[t, h] @ w[h, v]`. After the last
H block the tile is finished as the family's semantics say (`base.py`): rounded to the
inputs' dtype as `x @ weights` rounds, then soft-capped, in float32. The (tokens, V)
logits never exist; VMEM holds a few tiles and, in the backward, one accumulator.

forward (grid: token blocks, vocabulary blocks, H blocks): an online max / sum-exp over
the vocabulary blocks (that grid axis is sequential) and the label's logit, written per
token at the last vocabulary block: `(lse, label_logit)`, float32 (T, 1).

backward: the tile's `dlogits = (softmax - onehot) * g` (times the soft cap's derivative)
from the `(lse,)` residual, then a second phase of H blocks on the same grid axis
(2 * nh steps: H blocks `k` while `k < nh`, output H blocks `k - nh` after):
- dx (grid: token blocks, vocabulary blocks, 2 nh): `dx[t, j] += dlogits @ w[j, v]^T`,
  summed over the vocabulary blocks in a float32 (nh, block_t, block_h) scratch and
  written at the last vocabulary block.
- dweights (grid: vocabulary blocks, token blocks, 2 nh): `dw[j, v] += x[t, j]^T @
  dlogits`, summed over the token blocks in a float32 (nh, block_h, block_v) scratch.
Each backward kernel recomputes the logits: 2 T H V FLOPs for the tile plus 2 T H V for
its gradient, 8 T H V for the pair (the XLA VJP: 6, sharing one logits GEMM).

Tails: the token and vocabulary blocks are multiples of (16, 128), and the last block
of an axis they do not divide reads past the array's end (unspecified values on a TPU,
NaN in Pallas's interpreter): those rows and columns are masked out with `where` (never
multiplied by zero, which keeps a NaN) and their writes are dropped. An H block is the
whole H or a multiple of 128; a partial last H block is zeroed past H in both operands
of the contraction.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tokamax_kernels._mosaic_tpu import compiler_params

_LANES = 128  # a (rows, 1) vector occupies a (rows, 128) VMEM tile


@dataclasses.dataclass(frozen=True)
class Tiling:
    """One call's static sizes: tokens T, hidden H, vocabulary V, their blocks, the soft
    cap and the inputs' dtype."""

    tokens: int
    hidden: int
    vocab: int
    block_t: int
    block_h: int
    block_v: int
    cap: float | None
    dtype: Any

    @property
    def nt(self) -> int:
        return pl.cdiv(self.tokens, self.block_t)

    @property
    def nh(self) -> int:
        return pl.cdiv(self.hidden, self.block_h)

    @property
    def nv(self) -> int:
        return pl.cdiv(self.vocab, self.block_v)

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    def _tile_bytes(self) -> int:
        """The double-buffered x and w blocks, the three (T, 1) vectors a kernel reads or
        writes, the float32 logits accumulator and ~3 float32 temporaries of a tile."""
        bt, bh, bv = self.block_t, self.block_h, self.block_v
        return (2 * (bt * bh + bh * bv) * self.itemsize + 3 * 2 * bt * _LANES * 4
                + 4 * bt * bv * 4 + 3 * bt * _LANES * 4)

    def forward_vmem(self) -> int:
        return self._tile_bytes()

    def dx_vmem(self) -> int:
        """Plus the dlogits tile, the (T-block, H) accumulator and the dx output block."""
        bt, bh, bv = self.block_t, self.block_h, self.block_v
        return (self._tile_bytes() + bt * bv * self.itemsize + self.nh * bt * bh * 4
                + 2 * bt * bh * self.itemsize)

    def dw_vmem(self) -> int:
        """Plus the dlogits tile, the (H, V-block) accumulator and the dweights block."""
        bt, bh, bv = self.block_t, self.block_h, self.block_v
        return (self._tile_bytes() + bt * bv * self.itemsize + self.nh * bh * bv * 4
                + 2 * bh * bv * self.itemsize)


def _dot(a: jax.Array, b: jax.Array, contracting: tuple[int, int]) -> jax.Array:
    """`a . b` over the given axes in float32; float32 operands at full precision."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((contracting[0],), (contracting[1],)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


def _iota(shape: tuple[int, ...], axis: int, start: Any) -> jax.Array:
    return start + lax.broadcasted_iota(jnp.int32, shape, axis)


def _zero_past(a: jax.Array, axis: int, start: Any, size: int) -> jax.Array:
    """Block `a` (starting at index `start` along `axis`) with the entries at `size` and
    past zeroed. The select runs on a float32 copy (a form Mosaic lowers on every
    generation, whatever the packing of `a`'s dtype); the result has `a`'s dtype."""
    kept = _iota(a.shape, axis, start) < size
    return jnp.where(kept, a.astype(jnp.float32), 0.0).astype(a.dtype)


def _accumulate_logits(tl: Tiling, x_ref: Any, w_ref: Any, acc_ref: Any, h: Any) -> None:
    """`acc += x @ w` for H block `h` (`acc` zeroed at the first), H's tail zeroed."""
    x, w = x_ref[...], w_ref[...]
    if tl.hidden % tl.block_h:
        x = _zero_past(x, 1, h * tl.block_h, tl.hidden)
        w = _zero_past(w, 0, h * tl.block_h, tl.hidden)

    @pl.when(h == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += _dot(x, w, (1, 0))


def _finished_logits(tl: Tiling, acc: jax.Array) -> jax.Array:
    """The float32 tile as `x @ weights` in the inputs' dtype gives it, soft-capped."""
    logits = acc.astype(tl.dtype).astype(jnp.float32)
    return logits if tl.cap is None else tl.cap * jnp.tanh(logits / tl.cap)


def _forward_kernel(labels_ref, x_ref, w_ref, lse_ref, picked_ref, acc_ref, max_ref, sum_ref,
                    pick_ref, *, tl: Tiling) -> None:
    v, h = pl.program_id(1), pl.program_id(2)
    _accumulate_logits(tl, x_ref, w_ref, acc_ref, h)

    @pl.when(h == tl.nh - 1)
    def _vocabulary_block():
        logits = _finished_logits(tl, acc_ref[...])
        columns = _iota(logits.shape, 1, v * tl.block_v)
        if tl.vocab % tl.block_v:
            logits = jnp.where(columns < tl.vocab, logits, -jnp.inf)
        first = v == 0
        old_max = jnp.where(first, -jnp.inf, max_ref[...])
        new_max = jnp.maximum(old_max, jnp.max(logits, axis=1, keepdims=True))
        total = jnp.sum(jnp.exp(logits - new_max), axis=1, keepdims=True)
        sum_ref[...] = jnp.where(first, 0.0, sum_ref[...] * jnp.exp(old_max - new_max)) + total
        max_ref[...] = new_max
        hit = jnp.sum(jnp.where(columns == labels_ref[...], logits, 0.0), axis=1, keepdims=True)
        pick_ref[...] = jnp.where(first, 0.0, pick_ref[...]) + hit

        @pl.when(v == tl.nv - 1)
        def _store():
            lse_ref[...] = max_ref[...] + jnp.log(sum_ref[...])
            picked_ref[...] = pick_ref[...]


def _row_vector(tl: Tiling, index_map: Any) -> pl.BlockSpec:
    return pl.BlockSpec((tl.block_t, 1), index_map)


def lce_forward(x: jax.Array, labels: jax.Array, weights: jax.Array, *, tl: Tiling,
                interpret: Any) -> tuple[jax.Array, jax.Array]:
    """`(lse, label_logit)`, float32 (T, 1), of x (T, H), int32 labels (T, 1), weights (H, V)."""
    scratch = [pltpu.VMEM((tl.block_t, tl.block_v), jnp.float32),
               *(pltpu.VMEM((tl.block_t, 1), jnp.float32) for _ in range(3))]
    return pl.pallas_call(
        functools.partial(_forward_kernel, tl=tl),
        grid=(tl.nt, tl.nv, tl.nh),
        in_specs=[_row_vector(tl, lambda t, v, h: (t, 0)),
                  pl.BlockSpec((tl.block_t, tl.block_h), lambda t, v, h: (t, h)),
                  pl.BlockSpec((tl.block_h, tl.block_v), lambda t, v, h: (h, v))],
        out_specs=[_row_vector(tl, lambda t, v, h: (t, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((tl.tokens, 1), jnp.float32)] * 2,
        scratch_shapes=scratch,
        compiler_params=compiler_params(("parallel", "arbitrary", "arbitrary"),
                                        tl.forward_vmem()),
        interpret=interpret,
        name="tokamax_lce_forward",
    )(labels, x, weights)


def _dlogits(tl: Tiling, acc: jax.Array, labels: jax.Array, lse: jax.Array, g: jax.Array,
             t: Any, v: Any) -> jax.Array:
    """The tile's `(softmax - onehot) * g` (times `1 - (logits / cap)^2` with a soft cap)
    in the inputs' dtype, zero on rows past T and columns past V."""
    logits = _finished_logits(tl, acc)
    columns = _iota(logits.shape, 1, v * tl.block_v)
    dlogits = (jnp.exp(logits - lse) - (columns == labels).astype(jnp.float32)) * g
    if tl.cap is not None:
        dlogits = dlogits * (1.0 - jnp.square(logits / tl.cap))
    if tl.vocab % tl.block_v:
        dlogits = jnp.where(columns < tl.vocab, dlogits, 0.0)
    if tl.tokens % tl.block_t:
        dlogits = jnp.where(_iota(logits.shape, 0, t * tl.block_t) < tl.tokens, dlogits, 0.0)
    return dlogits.astype(tl.dtype)


def _dx_kernel(labels_ref, lse_ref, g_ref, x_ref, w_ref, dx_ref, acc_ref, dl_ref, dx_acc_ref,
               *, tl: Tiling) -> None:
    t, v, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(k < tl.nh)
    def _logits():
        _accumulate_logits(tl, x_ref, w_ref, acc_ref, k)

        @pl.when(k == tl.nh - 1)
        def _gradient_tile():
            dl_ref[...] = _dlogits(tl, acc_ref[...], labels_ref[...], lse_ref[...], g_ref[...],
                                   t, v)

    @pl.when(k >= tl.nh)
    def _dx():
        j = k - tl.nh
        w = w_ref[...]  # w[j, v]
        if tl.vocab % tl.block_v:  # columns past V meet dlogits' zeros: no NaN there
            w = _zero_past(w, 1, v * tl.block_v, tl.vocab)

        @pl.when(v == 0)
        def _zero():
            dx_acc_ref[j] = jnp.zeros(dx_acc_ref.shape[1:], jnp.float32)

        dx_acc_ref[j] += _dot(dl_ref[...], w, (1, 1))

        @pl.when(v == tl.nv - 1)
        def _store():
            dx_ref[...] = dx_acc_ref[j].astype(dx_ref.dtype)


def lce_dx(x: jax.Array, labels: jax.Array, weights: jax.Array, lse: jax.Array, g: jax.Array,
           *, tl: Tiling, interpret: Any) -> jax.Array:
    """dx (T, H) in x's dtype, from the lse residual and the per-token cotangent `g`
    (float32 (T, 1)). The dx block moves only at the last vocabulary block, one H block
    per second-phase step, so each is written back once, whole."""
    nh, nv = tl.nh, tl.nv

    def x_index(t, v, k):  # the second phase keeps the last block: no copy
        return t, jnp.minimum(k, nh - 1)

    def w_index(t, v, k):
        return lax.rem(k, nh), v

    def dx_index(t, v, k):
        return t, jnp.where(v == nv - 1, jnp.maximum(k - nh, 0), 0)

    rows = _row_vector(tl, lambda t, v, k: (t, 0))
    return pl.pallas_call(
        functools.partial(_dx_kernel, tl=tl),
        grid=(tl.nt, nv, 2 * nh),
        in_specs=[rows, rows, rows,
                  pl.BlockSpec((tl.block_t, tl.block_h), x_index),
                  pl.BlockSpec((tl.block_h, tl.block_v), w_index)],
        out_specs=pl.BlockSpec((tl.block_t, tl.block_h), dx_index),
        out_shape=jax.ShapeDtypeStruct((tl.tokens, tl.hidden), tl.dtype),
        scratch_shapes=[pltpu.VMEM((tl.block_t, tl.block_v), jnp.float32),
                        pltpu.VMEM((tl.block_t, tl.block_v), tl.dtype),
                        pltpu.VMEM((nh, tl.block_t, tl.block_h), jnp.float32)],
        compiler_params=compiler_params(("parallel", "arbitrary", "arbitrary"), tl.dx_vmem()),
        interpret=interpret,
        name="tokamax_lce_dx",
    )(labels, lse, g, x, weights)


def _dw_kernel(labels_ref, lse_ref, g_ref, x_ref, w_ref, dw_ref, acc_ref, dl_ref, dw_acc_ref,
               *, tl: Tiling) -> None:
    v, t, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(k < tl.nh)
    def _logits():
        _accumulate_logits(tl, x_ref, w_ref, acc_ref, k)

        @pl.when(k == tl.nh - 1)
        def _gradient_tile():
            dl_ref[...] = _dlogits(tl, acc_ref[...], labels_ref[...], lse_ref[...], g_ref[...],
                                   t, v)

    @pl.when(k >= tl.nh)
    def _dw():
        j = k - tl.nh
        # x[t, j]^T as an explicit transpose of a float32 tile (a form Mosaic lowers on
        # every generation), rows past T zeroed, back in the inputs' dtype for the MXU.
        x = x_ref[...].astype(jnp.float32)
        if tl.tokens % tl.block_t:
            x = _zero_past(x, 0, t * tl.block_t, tl.tokens)
        x_t = x.T.astype(tl.dtype)

        @pl.when(t == 0)
        def _zero():
            dw_acc_ref[j] = jnp.zeros(dw_acc_ref.shape[1:], jnp.float32)

        dw_acc_ref[j] += _dot(x_t, dl_ref[...], (1, 0))

        @pl.when(t == tl.nt - 1)
        def _store():
            dw_ref[...] = dw_acc_ref[j].astype(dw_ref.dtype)


def lce_dweights(x: jax.Array, labels: jax.Array, weights: jax.Array, lse: jax.Array,
                 g: jax.Array, *, tl: Tiling, interpret: Any) -> jax.Array:
    """dweights (H, V) in the weights' dtype (see `lce_dx`); the dweights block moves
    only at the last token block."""
    nh, nt = tl.nh, tl.nt

    def x_index(v, t, k):
        return t, lax.rem(k, nh)

    def w_index(v, t, k):  # the second phase keeps the last block: no copy
        return jnp.minimum(k, nh - 1), v

    def dw_index(v, t, k):
        return jnp.where(t == nt - 1, jnp.maximum(k - nh, 0), 0), v

    rows = _row_vector(tl, lambda v, t, k: (t, 0))
    return pl.pallas_call(
        functools.partial(_dw_kernel, tl=tl),
        grid=(tl.nv, nt, 2 * nh),
        in_specs=[rows, rows, rows,
                  pl.BlockSpec((tl.block_t, tl.block_h), x_index),
                  pl.BlockSpec((tl.block_h, tl.block_v), w_index)],
        out_specs=pl.BlockSpec((tl.block_h, tl.block_v), dw_index),
        out_shape=jax.ShapeDtypeStruct((tl.hidden, tl.vocab), tl.dtype),
        scratch_shapes=[pltpu.VMEM((tl.block_t, tl.block_v), jnp.float32),
                        pltpu.VMEM((tl.block_t, tl.block_v), tl.dtype),
                        pltpu.VMEM((nh, tl.block_h, tl.block_v), jnp.float32)],
        compiler_params=compiler_params(("parallel", "arbitrary", "arbitrary"), tl.dw_vmem()),
        interpret=interpret,
        name="tokamax_lce_dweights",
    )(labels, lse, g, x, weights)
