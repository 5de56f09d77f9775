"""xla_chunked with its gradients computed in the forward pass (`gradients="forward"`):
values and gradients against a float32 reference and the recomputing mode, a scalar
cotangent other than 1, the GEMMs a plain forward and a training step lower to, and the
cases the mode refuses (a per-token loss, another VJP op)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from tokamax_kernels.linear_softmax_cross_entropy_loss import (
    LinearSoftmaxCrossEntropyLossVjp,
    XlaChunkedLinearSoftmaxCrossEntropyLoss,
    XlaChunkedLinearSoftmaxCrossEntropyLossVjp,
    XlaChunkedLossConfig,
)

B, S, H, V = 2, 13, 16, 37  # 26 tokens: 4-token chunks leave a last one overlapping
FORWARD = XlaChunkedLossConfig(5, 8, gradients="forward", chunk_tokens=4)
BACKWARD = XlaChunkedLossConfig(5, 8)
lce = tokamax.linear_softmax_cross_entropy_loss


def inputs(seed: int, out_of_range: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 x (B, S, H) and weights (H, V); labels with some ignored (-1) and, if
    `out_of_range`, some >= V."""
    x = random_normal(seed, (B, S, H), jnp.float32)
    weights = random_normal(seed + 1, (H, V), jnp.float32) / np.sqrt(H) * 2
    labels = jax.random.randint(jax.random.key(seed + 2), (B, S), 0, V)
    labels = labels.at[:, 3].set(-1)
    if out_of_range:
        labels = labels.at[:, 7].set(V).at[1, 11].set(V + 5)
    return x, labels, weights


def reference(x: jax.Array, labels: jax.Array, weights: jax.Array, reduction: str,
              cap: float | None) -> jax.Array:
    """float32 at HIGHEST: `-log_softmax(logits)[label]` per counted token; a label >= V
    contributes its log-sum-exp (the family's gradient for it: base.py)."""
    vocab = weights.shape[1]
    logits = jnp.matmul(x, weights, precision=jax.lax.Precision.HIGHEST)
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1),
                                 jnp.clip(labels, 0, vocab - 1)[..., None], axis=-1)[..., 0]
    in_range = (labels >= 0) & (labels < vocab)
    losses = jnp.where(in_range, -picked, 0.0)
    losses += jnp.where(labels >= vocab, jax.nn.logsumexp(logits, axis=-1), 0.0)
    total = jnp.sum(losses)
    return total if reduction == "sum" else total / jnp.maximum(jnp.sum(labels >= 0), 1)


def chunked(config: XlaChunkedLossConfig) -> XlaChunkedLinearSoftmaxCrossEntropyLoss:
    return XlaChunkedLinearSoftmaxCrossEntropyLoss(config=config)


def value_and_gradients(loss, x, labels, weights, cotangent):
    """`(loss, dx, dweights)` of `loss(x, labels, weights)` (jitted: labels traced) for a
    scalar cotangent `cotangent`."""

    @jax.jit
    def run(x, labels, weights, cotangent):
        out, pullback = jax.vjp(lambda x, w: loss(x, labels, w), x, weights)
        return (out, *pullback(cotangent))

    return run(x, labels, weights, cotangent)


def _cotangent(seed: int) -> jax.Array:
    """A random scalar cotangent away from 1 and 0."""
    return 1.5 + jax.random.uniform(jax.random.key(seed), (), jnp.float32)


@pytest.mark.exhaustive
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("out_of_range", [False, True])
def test_matches_the_float32_reference_and_the_recomputing_mode(reduction, cap, out_of_range):
    seed = 10 * (reduction == "mean") + 20 * (cap is not None) + 40 * out_of_range
    x, labels, weights = inputs(seed, out_of_range)
    g = _cotangent(seed + 5)
    kwargs = dict(reduction=reduction, logits_soft_cap=cap, precision="highest")
    got = value_and_gradients(lambda x, lb, w: chunked(FORWARD)(x, lb, w, **kwargs),
                              x, labels, weights, g)
    recomputed = value_and_gradients(lambda x, lb, w: chunked(BACKWARD)(x, lb, w, **kwargs),
                                     x, labels, weights, g)
    want = value_and_gradients(lambda x, lb, w: reference(x, lb, w, reduction, cap),
                               x, labels, weights, g)
    if out_of_range:  # the loss is NaN (base.py); the gradients are finite
        assert np.isnan(float(got[0])) and np.isnan(float(recomputed[0]))
    else:
        assert_close(got[0], want[0])
        assert_close(got[0], recomputed[0])
    for ours, other, theirs in zip(got[1:], recomputed[1:], want[1:], strict=True):
        assert bool(jnp.all(jnp.isfinite(ours)))
        assert_close(ours, theirs)
        assert_close(ours, other)


def _dot_count(f, *args) -> int:
    return jax.jit(f).lower(*args).as_text().count("stablehlo.dot_general")


def test_only_a_differentiated_forward_computes_the_gradients():
    """A plain forward lowers to the logits product alone; a training step to three
    products (logits, dx, dweights), none recomputed in the backward."""
    x, labels, weights = inputs(0, False)
    op = chunked(FORWARD)

    def loss(x, weights):
        return op(x, labels, weights, reduction="mean")

    assert _dot_count(loss, x, weights) == 1
    assert _dot_count(jax.grad(loss, argnums=(0, 1)), x, weights) == 3
    step = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, weights)
    assert "gradients='forward'" in str(step)  # the scaling VJP op, config pinned


def test_only_a_pinned_config_computes_gradients_in_the_forward_pass():
    """Pinned, the mode makes three products in a step; `implementation="xla_chunked"`
    (its heuristics, which recompute) makes four, and so does `None` choosing it."""
    x, labels, weights = inputs(3, False)

    def step(implementation):
        def loss(x, w):
            return lce(x, labels, w, reduction="sum", implementation=implementation)
        return jax.grad(loss, argnums=(0, 1))

    assert _dot_count(step(chunked(FORWARD)), x, weights) == 3
    assert _dot_count(step("xla_chunked"), x, weights) == 4  # the logits recomputed
    dx, dw = jax.jit(step(chunked(FORWARD)))(x, weights)
    want = jax.grad(lambda x, w: reference(x, labels, w, "sum", None),
                    argnums=(0, 1))(x, weights)
    assert_close(dx, want[0])
    assert_close(dw, want[1])


def test_a_vjp_op_without_the_forward_s_config_or_a_second_order_gradient_is_refused():
    """A pinned VJP op of this module without the forward's config reads `(lse,)`; the
    second-order gradient differentiates the family's reference, whose residuals are
    `(lse,)` too: both a clear NotImplementedError, not a failure inside JAX."""
    x, labels, weights = inputs(4, False)
    unpinned = XlaChunkedLinearSoftmaxCrossEntropyLoss(
        config=FORWARD, vjp=XlaChunkedLinearSoftmaxCrossEntropyLossVjp())
    with pytest.raises(NotImplementedError, match="only"):
        unpinned(x, labels, weights)

    def loss(x):
        return chunked(FORWARD)(x, labels, weights, reduction="sum")

    with pytest.raises(NotImplementedError, match="second-order"):
        jax.grad(lambda x: jnp.sum(jax.grad(loss)(x) ** 2))(x)


def test_a_per_token_loss_or_another_vjp_op_is_refused():
    """reduction="none" has a per-token cotangent, and another VJP op reads the family's
    `(lse,)` residuals: both NotImplementedError, which moves a list of implementations
    on to the next."""
    x, labels, weights = inputs(1, False)
    with pytest.raises(NotImplementedError, match="scalar loss"):
        chunked(FORWARD)(x, labels, weights, reduction="none")
    other = XlaChunkedLinearSoftmaxCrossEntropyLoss(
        config=FORWARD, vjp=LinearSoftmaxCrossEntropyLossVjp())
    with pytest.raises(NotImplementedError, match="only"):
        other(x, labels, weights)
    losses = lce(x, labels, weights, reduction="none",
                 implementation=(chunked(FORWARD), "xla"))  # falls back to xla
    assert losses.shape == labels.shape


@pytest.mark.usefixtures("fake_devices")
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_call_over_token_sharded_inputs_matches_the_reference(reduction):
    """The family's partition rule splits its `(lse,)` residual, not stored gradients: a
    call of this mode over sharded inputs runs unpartitioned, and XLA partitions the
    program it lowers to (plain `jax.jit` over inputs sharded on the tokens)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    x, labels, weights = inputs(70, out_of_range=False)
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("d")))
    g = _cotangent(75)
    kwargs = dict(reduction=reduction, precision="highest")
    got = value_and_gradients(lambda x, lb, w: chunked(FORWARD)(x, lb, w, **kwargs),
                              sharded, labels, weights, g)
    want = value_and_gradients(lambda x, lb, w: reference(x, lb, w, reduction, None),
                               x, labels, weights, g)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def test_under_vmap_each_entry_scales_its_own_gradients():
    """Under `jax.vmap` each batch entry stores its own gradients and its own cotangent
    scales them (per-entry cotangents of different signs)."""
    x = random_normal(80, (3, 10, H), jnp.float32)
    weights = random_normal(81, (3, H, V), jnp.float32) / np.sqrt(H) * 2
    labels = jax.random.randint(jax.random.key(82), (3, 10), 0, V)
    cotangent = jnp.array([1.5, -0.7, 2.2], jnp.float32)

    def batched(loss):
        @jax.jit
        def run(x, weights):
            out, pullback = jax.vjp(lambda x, w: jax.vmap(loss)(x, labels, w), x, weights)
            return (out, *pullback(cotangent))
        return run(x, weights)

    got = batched(lambda x, lb, w: chunked(FORWARD)(x, lb, w, reduction="mean",
                                                    precision="highest"))
    want = batched(lambda x, lb, w: reference(x, lb, w, "mean", None))
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)
