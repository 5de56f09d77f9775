"""linear_softmax_cross_entropy_loss's `label_smoothing` and `z_loss`, for every
implementation the base suite runs on CPU (`xla`, `xla_chunked` at small tiles, the
Mosaic TPU kernels in Pallas interpret mode): loss and gradients of a random cotangent
against a float32 HIGHEST reference with materialized logits, optax-style smoothed
targets and PaLM's z-loss term; the kernels run once; the options' bounds and the
combination that is not supported."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from test_linear_softmax_cross_entropy_suite import IMPLEMENTATIONS, V, _inputs
from tokamax_kernels.linear_softmax_cross_entropy_loss import api

lce = api.linear_softmax_cross_entropy_loss
# (reduction, dtype, soft cap, label smoothing, z-loss): smoothing alone, z-loss alone
# with the soft cap, and both together, over the three reductions.
CASES = [("mean", jnp.float32, None, 0.2, 0.0), ("none", jnp.float32, 1.5, 0.0, 0.05),
         ("sum", jnp.bfloat16, None, 0.2, 0.05)]


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def reference(x, labels, weights, reduction, cap, label_smoothing, z_loss):
    """Cross entropy against `(1 - eps) onehot + eps / V` plus `z * logsumexp**2`, of
    float32 HIGHEST logits; labels < 0 ignored."""
    logits = jnp.matmul(x.astype(jnp.float32), weights.astype(jnp.float32), precision="highest")
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    targets = jax.nn.one_hot(jnp.maximum(labels, 0), V)
    targets = (1.0 - label_smoothing) * targets + label_smoothing / V
    losses = -jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1)
    losses = losses + z_loss * jnp.square(jax.nn.logsumexp(logits, axis=-1))
    losses = jnp.where(labels >= 0, losses, 0.0)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / jnp.maximum((labels >= 0).sum(), 1)


@pytest.mark.exhaustive
@pytest.mark.parametrize("reduction, dtype, cap, smoothing, z_loss", CASES, ids=[
    f"{r}-{jnp.dtype(d).name}-cap{c}-ls{s}-z{z}" for r, d, c, s, z in CASES])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_loss_and_gradients_match_reference(implementation, reduction, dtype, cap,
                                            smoothing, z_loss):
    x, labels, weights = _inputs(dtype, seed=21)
    options = dict(logits_soft_cap=cap, label_smoothing=smoothing, z_loss=z_loss)
    want = reference(x, labels, weights, reduction, cap, smoothing, z_loss)
    cotangent = random_normal(22, want.shape)
    op = IMPLEMENTATIONS[implementation]()

    def loss(fn, x, weights):  # the output rides along as auxiliary data
        out = fn(x, weights)
        return jnp.sum(out * cotangent), out

    (_, out), (dx, dweights) = jax.jit(jax.value_and_grad(functools.partial(
        loss, lambda x, w: lce(x, labels, w, reduction=reduction, precision="highest",
                               implementation=op, **options)),
        argnums=(0, 1), has_aux=True))(x, weights)
    assert out.dtype == jnp.float32 and out.shape == want.shape
    assert_close(out, want, dtype)
    _, (want_dx, want_dweights) = jax.value_and_grad(functools.partial(
        loss, lambda x, w: reference(x, labels, w, reduction, cap, smoothing, z_loss)),
        argnums=(0, 1), has_aux=True)(x.astype(jnp.float32), weights.astype(jnp.float32))
    assert dx.dtype == dtype and dweights.dtype == dtype
    assert_close(dx, want_dx, dtype)
    assert_close(dweights, want_dweights, dtype)
    assert not np.any(np.asarray(dx, np.float32)[np.asarray(labels) < 0])  # ignored: no gradient


def _op_calls(implementation, **options) -> int:
    """Op calls (forward and VJP) in the traced loss-and-gradients program."""
    x, labels, weights = _inputs(jnp.float32, seed=23)
    op = IMPLEMENTATIONS[implementation]()

    def loss(x, weights):
        return lce(x, labels, weights, reduction="mean", implementation=op, **options)

    return str(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(x, weights)).count(
        "tokamax_call")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_implementation_runs_once_forward_and_once_backward(implementation):
    """The options add terms around the implementation's call, not a second call."""
    assert _op_calls(implementation, label_smoothing=0.1, z_loss=1e-3) == 2
    assert _op_calls(implementation, label_smoothing=0.1) == 2


def test_zero_options_trace_the_program_without_them():
    x, labels, weights = _inputs(jnp.float32, seed=24)

    def jaxpr(**options):
        return str(jax.make_jaxpr(jax.grad(
            lambda x: lce(x, labels, weights, reduction="mean", **options)))(x))

    assert jaxpr(label_smoothing=0.0, z_loss=0) == jaxpr()
    assert jaxpr(z_loss=1e-4) != jaxpr()


@pytest.mark.usefixtures("fake_devices")
def test_token_sharded_inputs_are_not_gathered():
    """x and labels split over 8 fake devices (batch over "data", sequence over "model"):
    the options' terms, as the op, run per device on its tokens, no all-gather, equal to
    the unsharded reference forward and backward ("mean" over the global count)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x, labels, weights = _inputs(jnp.float32, seed=30, shape=(8, 6))
    options = dict(label_smoothing=0.1, z_loss=0.01)

    def grads(x, labels, weights):
        return jax.value_and_grad(lambda x, w: lce(
            x, labels, w, reduction="mean", precision="highest", implementation="xla_chunked",
            **options), argnums=(0, 1))(x, weights)

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x_sharded = jax.device_put(x, NamedSharding(mesh, P("data", "model", None)))
    labels_sharded = jax.device_put(labels, NamedSharding(mesh, P("data", "model")))
    with jax.set_mesh(mesh):
        compiled = jax.jit(grads).lower(x_sharded, labels_sharded, weights).compile()
        out, (dx, dweights) = compiled(x_sharded, labels_sharded, weights)
    assert "all-gather" not in compiled.as_text()
    want, (want_dx, want_dweights) = jax.value_and_grad(
        lambda x, w: reference(x, labels, w, "mean", None, **options), argnums=(0, 1))(
        x, weights)
    assert_close(out, want)
    assert_close(dx, want_dx)
    assert_close(dweights, want_dweights)


def test_optimize_keeps_the_options():
    """`optimize` resolves the op's call inside the options' terms: the same loss and
    gradients as the call traced by `jax.jit`."""
    x, labels, weights = _inputs(jnp.bfloat16, seed=29)

    def loss(x, weights):
        return lce(x, labels, weights, reduction="mean", label_smoothing=0.1, z_loss=0.01)

    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, weights)
    got = jax.value_and_grad(tokamax.optimize(loss), argnums=(0, 1))(x, weights)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(a, b, jnp.bfloat16)


def test_traced_out_of_range_label_keeps_a_nan_loss_and_finite_gradients():
    """A label >= V (traced) still has a NaN loss; masked out after the loss, it adds
    nothing to the gradients (its z-loss term adds no NaN)."""
    x, labels, weights = _inputs(jnp.float32, seed=25)
    labels = labels.at[0, 4].set(V + 3)

    def losses(x, labels, weights):
        return lce(x, labels, weights, reduction="none", label_smoothing=0.1, z_loss=0.01,
                   precision="highest", implementation="xla_chunked")

    out = jax.jit(losses)(x, labels, weights)
    assert np.isnan(out[0, 4]) and np.isfinite(np.delete(np.asarray(out).ravel(), 4)).all()

    def masked(x, weights, labels):
        return jnp.sum(jnp.where(labels < V, losses(x, labels, weights), 0.0))

    grads = jax.jit(jax.grad(masked, argnums=(0, 1)))(x, weights, labels)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert not np.any(np.asarray(grads[0])[0, 4])


def test_a_function_implementation_gets_the_options():
    x, labels, weights = _inputs(jnp.float32, seed=26)
    seen = {}

    def plain(x, labels, weights, **keywords):
        seen.update(keywords)
        return jnp.zeros(())

    lce(x, labels, weights, z_loss=0.01, implementation=plain)
    assert seen == {"z_loss": 0.01}


@pytest.mark.parametrize("options, error, match", [
    (dict(label_smoothing=0.1, logits_soft_cap=30.0), NotImplementedError, "soft-capped"),
    (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\]"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing must be a finite number"),
    (dict(z_loss=-1e-4), ValueError, "z_loss must be a finite number"),
    (dict(z_loss=float("nan")), ValueError, "z_loss must be a finite number"),
    (dict(z_loss=0.1, reduction="avg"), ValueError, "reduction must be one of"),
])
def test_bad_options_raise(options, error, match):
    x, labels, weights = _inputs(jnp.float32, seed=27)
    with pytest.raises(error, match=match):
        lce(x, labels, weights, **options)


def test_traced_options_raise():
    x, labels, weights = _inputs(jnp.float32, seed=28)
    with pytest.raises(ValueError, match="z_loss"):
        jax.jit(lambda z: lce(x, labels, weights, z_loss=z))(0.1)
