"""`optimize`'s plain-JAX patterns on values split over Explicit mesh axes (what
`jax.make_mesh` gives by default) and under a target's mesh (`core.targeting`): a pattern
is recognized whatever placement tracing records in its equations (`jnp.zeros_like` of a
sharded value, `iota` under a mesh), and the op computing it leaves every result placed
as the user's expression placed it, so the equations after it still type-check.

`rewritten` keeps every candidate on CPU; values and gradients are compared with
`jax.jit` of the user's function, float32 at HIGHEST precision.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tokamax_pass as tokamax
from _rewriting import HIGHEST, REWRITTEN, h200_plan, outcomes
from conftest import assert_close, random_normal

pytestmark = pytest.mark.usefixtures("fake_devices")  # fails, never skips, without 8

B, T, D, V = 4, 3, 16, 8


def _mesh(model_axis=None):
    """"data" Explicit over 2 devices; with `model_axis` (an axis type), a "model" axis of
    2 more devices beside it (Auto: the mixed meshes of data and model parallelism)."""
    if model_axis is None:
        return jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,),
                             devices=jax.devices()[:2])
    return jax.make_mesh((2, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit, model_axis),
                         devices=jax.devices()[:4])


def _rms_norm(x, scale):
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + 1e-6) * scale


def _norm_then_logsumexp(x, scale, cotangent):
    """`logsumexp` after the norm: its `select` meets the norm's result with a zero placed
    like it, which fails to type-check where the op's result is placed otherwise."""
    return jnp.sum(jax.nn.logsumexp(_rms_norm(x, scale), axis=-1) * cotangent)


def _cross_entropy(x, w, labels, cotangent):
    logits = jnp.matmul(x, w, precision=HIGHEST)
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - label_logits) * cotangent)


CASES = {
    # name: loss, its inputs (the first split over "data"), the pattern it holds
    "layer_norm": (_norm_then_logsumexp,
                   lambda: (random_normal(0, (B, T, D)), random_normal(1, (D,)),
                            random_normal(2, (B, T))),
                   "layer_norm"),
    "cross_entropy": (_cross_entropy,
                      lambda: (random_normal(0, (B, T, D)), random_normal(1, (D, V)),
                               jax.random.randint(jax.random.key(2), (B, T), 0, V),
                               random_normal(3, (B, T))),
                      "linear_softmax_cross_entropy_loss"),
}


@pytest.mark.parametrize("name, model_axis", [(name, None) for name in CASES]
                         + [("layer_norm", jax.sharding.AxisType.Auto)])
def test_patterns_over_explicit_axes_match_and_agree_with_jit(name, model_axis, rewritten):
    loss, make, pattern = CASES[name]
    mesh = _mesh(model_axis)
    first, *rest = make()
    first = jax.device_put(first, NamedSharding(mesh, P("data")))
    rest = [jax.device_put(a, NamedSharding(mesh, P("data") if a.ndim == 2 else P()))
            for a in rest]
    grad = jax.grad(loss, argnums=(0, 1))
    with jax.set_mesh(mesh):
        outputs = []
        for f in (loss, grad):  # the forward's match is emitted, the gradient's traced
            optimized = tokamax.optimize(f)
            matches = optimized.plan(first, *rest).matches
            assert [(m.pattern, m.outcome) for m in matches] == [(pattern, REWRITTEN)]
            outputs.append((optimized(first, *rest), jax.jit(f)(first, *rest)))
    (value, want), (grads, want_grads) = outputs
    assert_close(value, want)
    for got, expected in zip(grads, want_grads, strict=True):
        assert got.sharding.spec == expected.sharding.spec
        assert_close(got, expected)


def test_rewritten_result_keeps_the_placement_the_user_wrote(rewritten):
    """An `out_sharding` inside the matched region places the result; the op's result is
    placed the same."""

    def glu(x, w_gate, w_up):
        gate = jnp.matmul(x, w_gate, precision=HIGHEST, out_sharding=P(None, None))
        up = jnp.matmul(x, w_up, precision=HIGHEST, out_sharding=P(None, None))
        return jax.nn.silu(gate) * up

    mesh = _mesh()
    x = jax.device_put(random_normal(0, (B, D)), NamedSharding(mesh, P("data")))
    w_gate, w_up = random_normal(1, (D, V)), random_normal(2, (D, V))
    with jax.set_mesh(mesh):
        optimized = tokamax.optimize(glu)
        assert outcomes(optimized, x, w_gate, w_up) == [REWRITTEN]
        got, want = optimized(x, w_gate, w_up), jax.jit(glu)(x, w_gate, w_up)
    assert got.sharding.spec == want.sharding.spec == P(None, None)
    assert_close(got, want)


def test_one_hot_loss_of_reshaped_labels_matches_for_a_target():
    """Under a target's mesh, `jax.nn.one_hot` of labels made in the trace (a reshape)
    places its `iota`; the match does not depend on it."""

    def loss(x, w, labels):
        logits = jnp.matmul(x.reshape(-1, D), w, precision=HIGHEST)
        one_hot = jax.nn.one_hot(labels.reshape(-1), V)
        return -jnp.sum(one_hot * jax.nn.log_softmax(logits, axis=-1), axis=-1)

    args = (random_normal(0, (B, T, D)), random_normal(1, (D, V)),
            jax.random.randint(jax.random.key(2), (B, T), 0, V))
    assert [m.pattern for m in h200_plan(loss, *args).matches] == [
        "linear_softmax_cross_entropy_loss"]
