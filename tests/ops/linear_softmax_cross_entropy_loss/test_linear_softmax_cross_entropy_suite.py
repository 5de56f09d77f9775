"""The linear_softmax_cross_entropy_loss base suite: every implementation gets the same cases.

`xla_chunked` runs at small tiles (several token and vocabulary blocks, the last of each
overlapping the one before it); the Mosaic TPU kernels run in Pallas interpret mode at
blocks that leave a partial last block on every axis; both also run at their heuristic
tiles. The Mosaic GPU kernels run in GPU interpret mode and lower for an H200 in
`test_mosaic_gpu_linear_softmax_cross_entropy.py`. Each case checks the loss and the
gradients of a random cotangent against a float32 HIGHEST reference (optax-style, labels
below 0 ignored): every reduction, bf16 and f32, the logits soft cap, `vmap` over sequences
with shared weights, out-of-range labels, and bad input.

What only one implementation has (configs, heuristics, lowering, memory) stays in its own
file beside this one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, random_normal
from tokamax_kernels.linear_softmax_cross_entropy_loss import (
    LinearSoftmaxCrossEntropyLoss,
    MosaicTpuLossConfig,
    PallasMosaicTpuLinearSoftmaxCrossEntropyLoss,
    PallasMosaicTpuLinearSoftmaxCrossEntropyLossVjp,
    XlaChunkedLinearSoftmaxCrossEntropyLoss,
    XlaChunkedLinearSoftmaxCrossEntropyLossVjp,
    XlaChunkedLossConfig,
    api,
)

# 26 tokens (16-row TPU blocks and 5-token chunks leave a partial last block), H = 200
# (128-deep TPU steps), V = 300 (128-wide TPU blocks, 64-wide chunks).
B, S, H, V = 2, 13, 200, 300
lce = api.linear_softmax_cross_entropy_loss


def _chunked(config: XlaChunkedLossConfig | None) -> LinearSoftmaxCrossEntropyLoss:
    return XlaChunkedLinearSoftmaxCrossEntropyLoss(
        config=config, vjp=XlaChunkedLinearSoftmaxCrossEntropyLossVjp(config=config))


def _mosaic_tpu(config: MosaicTpuLossConfig | None) -> LinearSoftmaxCrossEntropyLoss:
    return PallasMosaicTpuLinearSoftmaxCrossEntropyLoss(
        interpret=True, config=config,
        vjp=PallasMosaicTpuLinearSoftmaxCrossEntropyLossVjp(interpret=True, config=config))


IMPLEMENTATIONS: dict[str, Callable[[], LinearSoftmaxCrossEntropyLoss]] = {
    "xla": LinearSoftmaxCrossEntropyLoss,
    "xla_chunked": lambda: _chunked(XlaChunkedLossConfig(5, 64)),
    "mosaic_tpu": lambda: _mosaic_tpu(
        MosaicTpuLossConfig(block_tokens=16, block_vocab=128, block_h=128)),
}
HEURISTIC_TILES: dict[str, Callable[[], LinearSoftmaxCrossEntropyLoss]] = {
    "xla_chunked": lambda: _chunked(None),
    "mosaic_tpu": lambda: _mosaic_tpu(None),
}
# Six cases in which every pair of options takes all its value pairs: each reduction in
# both dtypes and with and without the soft cap, each dtype with and without the cap.
CASES = [("sum", jnp.float32, None), ("sum", jnp.bfloat16, 1.5),
         ("mean", jnp.float32, 1.5), ("mean", jnp.bfloat16, None),
         ("none", jnp.float32, 1.5), ("none", jnp.bfloat16, None)]


@functools.partial(jax.jit, static_argnums=(3, 4))
def reference(x, labels, weights, reduction, cap=None):
    """optax-style softmax cross entropy of float32 HIGHEST logits; labels < 0 ignored."""
    logits = jnp.matmul(x.astype(jnp.float32), weights.astype(jnp.float32), precision="highest")
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    losses = jnp.where(labels >= 0, lse - picked, 0.0)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / jnp.maximum((labels >= 0).sum(), 1)


def _inputs(dtype, seed=0, shape=(B, S)):
    x = random_normal(seed, (*shape, H), dtype)
    weights = (random_normal(seed + 1, (H, V)) / np.sqrt(H) * 2).astype(dtype)
    labels = jax.random.randint(jax.random.key(seed + 2), shape, 0, V)
    ignored = jax.random.bernoulli(jax.random.key(seed + 3), 0.25, shape)
    # The last class, in a partial last vocabulary block, is one token's label.
    labels = jnp.where(ignored, -1, labels).ravel().at[1].set(V - 1).reshape(shape)
    assert 0 < int((labels < 0).sum()) < labels.size  # some tokens ignored, some counted
    return x, labels, weights


def _check(op, dtype, reduction, cap, seed=0):
    x, labels, weights = _inputs(dtype, seed)
    kwargs = dict(reduction=reduction, logits_soft_cap=cap, precision="highest")
    want = reference(x, labels, weights, reduction, cap)
    cotangent = random_normal(seed + 9, want.shape)

    def loss(fn, x, weights):  # the output rides along as auxiliary data
        out = fn(x, weights)
        return jnp.sum(out * cotangent), out

    # One compiled program gives the loss and both gradients.
    (_, out), (dx, dweights) = jax.jit(jax.value_and_grad(functools.partial(
        loss, lambda x, w: lce(x, labels, w, implementation=op, **kwargs)), argnums=(0, 1),
        has_aux=True))(x, weights)
    assert out.dtype == jnp.float32 and out.shape == want.shape
    assert_close(out, want, dtype)
    _, (want_dx, want_dweights) = jax.value_and_grad(functools.partial(
        loss, lambda x, w: reference(x, labels, w, reduction, cap)), argnums=(0, 1),
        has_aux=True)(x.astype(jnp.float32), weights.astype(jnp.float32))
    assert dx.dtype == dtype and dweights.dtype == dtype
    assert_close(dx, want_dx, dtype)
    assert_close(dweights, want_dweights, dtype)
    assert not np.any(np.asarray(dx, np.float32)[np.asarray(labels) < 0])  # ignored: no gradient


@pytest.mark.exhaustive
@pytest.mark.parametrize("reduction, dtype, cap", CASES, ids=[
    f"{r}-{jnp.dtype(d).name}" + ("-soft_cap" if c else "") for r, d, c in CASES])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_loss_and_gradients_match_reference(implementation, reduction, dtype, cap):
    _check(IMPLEMENTATIONS[implementation](), dtype, reduction, cap)


@pytest.mark.parametrize("implementation", HEURISTIC_TILES)
def test_heuristic_tiles_match_reference(implementation):
    _check(HEURISTIC_TILES[implementation](), jnp.bfloat16, "mean", None, seed=3)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_over_sequences_with_shared_weights(implementation):
    """Per-sequence mean losses under `vmap`; the weights' gradient sums the batch."""
    op = IMPLEMENTATIONS[implementation]()
    x, labels, weights = _inputs(jnp.float32, seed=5, shape=(3, 2, 7))
    cotangent = random_normal(6, (3,))

    def ours(x, labels, weights):
        return lce(x, labels, weights, reduction="mean", precision="highest",
                   implementation=op)

    def theirs(x, labels, weights):
        return reference(x, labels, weights, "mean")

    def total(fn, x, weights):
        out = jax.vmap(fn, in_axes=(0, 0, None))(x, labels, weights)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.value_and_grad(functools.partial(total, ours), argnums=(0, 1),
                                         has_aux=True)(x, weights)
    (_, want), want_grads = jax.value_and_grad(functools.partial(total, theirs),
                                               argnums=(0, 1), has_aux=True)(x, weights)
    assert_close(out, want)
    assert_close(out[1], theirs(x[1], labels[1], weights))
    for got, expected in zip(grads, want_grads, strict=True):
        assert_close(got, expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_traced_out_of_range_labels_give_nan_and_all_ignored_mean_is_zero(implementation):
    op = IMPLEMENTATIONS[implementation]()
    x, labels, weights = _inputs(jnp.float32, seed=7)
    losses = jax.jit(lambda lab: lce(x, lab, weights, reduction="none", implementation=op))(
        labels.at[0, 3].set(V))
    assert np.isnan(losses[0, 3]) and np.isfinite(np.delete(np.asarray(losses).ravel(), 3)).all()
    out = lce(x, jnp.full_like(labels, -1), weights, reduction="mean", implementation=op)
    assert float(out) == 0.0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_traced_out_of_range_label_has_the_gradient_of_plain_jax(implementation):
    """A label >= V (traced) has a NaN loss and, as autodiff of plain JAX's `lse -
    take_along_axis(logits, label)` gives it, the gradient of its log-sum-exp alone: a
    token masked out after the loss (`jnp.where`) adds nothing, not NaN."""
    op = IMPLEMENTATIONS[implementation]()
    x, labels, weights = _inputs(jnp.float32, seed=11)
    labels = labels.at[1, 2].set(V).at[0, 5].set(V + 7)
    out_of_range = np.asarray(labels) >= V
    cotangent = random_normal(12, labels.shape)

    def plain(x, labels, weights):
        logits = jnp.matmul(x, weights, precision="highest")
        picked = jnp.take_along_axis(logits, labels[..., None], axis=-1, mode="fill")[..., 0]
        return jnp.where(labels >= 0, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0)

    def ours(x, labels, weights):
        return lce(x, labels, weights, reduction="none", precision="highest",
                   implementation=op)

    for keep_out_of_range in (False, True):  # masked out after the loss, or kept (a NaN loss)
        def loss(fn, x, weights, labels, keep=keep_out_of_range):
            losses = fn(x, labels, weights)
            return jnp.sum(jnp.where(keep | (labels < V), losses, 0.0) * cotangent)

        # Labels traced (an argument of the jitted function): concrete ones >= V raise.
        grads = jax.jit(jax.grad(functools.partial(loss, ours), argnums=(0, 1)))(
            x, weights, labels)
        want = jax.grad(functools.partial(loss, plain), argnums=(0, 1))(x, weights, labels)
        for got, expected in zip(grads, want, strict=True):
            assert np.isfinite(np.asarray(got)).all()
            assert_close(got, expected, jnp.float32)
        assert keep_out_of_range or not np.any(np.asarray(grads[0])[out_of_range])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bad_input_raises_value_errors_naming_the_argument(implementation):
    op = IMPLEMENTATIONS[implementation]()
    x, labels, weights = _inputs(jnp.float32, seed=8)
    with pytest.raises(ValueError, match=f"labels must be < V = {V}"):
        lce(x, jnp.full_like(labels, V), weights, implementation=op)
    with pytest.raises(ValueError, match="labels must be an integer array"):
        lce(x, labels.astype(jnp.float32), weights, implementation=op)
    with pytest.raises(ValueError, match="H mismatch"):
        lce(x, labels, weights[1:], implementation=op)
    with pytest.raises(ValueError, match="reduction must be one of"):
        lce(x, labels, weights, reduction="avg", implementation=op)
    with pytest.raises(ValueError, match="same dtype"):
        lce(x, labels, weights.astype(jnp.bfloat16), implementation=op)
