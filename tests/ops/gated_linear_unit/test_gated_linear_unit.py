"""gated_linear_unit: the XLA reference against a float64 numpy reference, forward and grads."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_pass.core import spec

K, N = 8, 6


def np_swish(z):
    return z / (1 + np.exp(-z))


def np_gelu(z):  # jax.nn.gelu's default tanh approximation
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


NP_ACTIVATIONS = {jax.nn.swish: np_swish, jax.nn.gelu: np_gelu, jax.nn.relu: lambda z: z * (z > 0),
                  jax.nn.identity: lambda z: z}


def _np_identity(z):
    return z


def reference(x, w_gate, w_up, activation=np_swish):
    x, w_gate, w_up = (np.asarray(a, np.float64) for a in (x, w_gate, w_up))
    return activation(x @ w_gate) * (x @ w_up)


def reference_grads(x, w_gate, w_up, dout, activation):
    """Gradients of `sum(glu(x) * dout)` by autodiff of a float32 HIGHEST jnp reference."""

    def f(x, w_gate, w_up):
        gate = jnp.matmul(x, w_gate, precision="highest")
        up = jnp.matmul(x, w_up, precision="highest")
        return jnp.sum(activation(gate) * up * dout)

    args = (jnp.asarray(a, jnp.float32) for a in (x, w_gate, w_up))
    return jax.grad(f, argnums=(0, 1, 2))(*args)


def _inputs(x_shape, dtype):
    x = random_normal(0, (*x_shape, K), dtype)
    fused = (random_normal(1, (K, 2, N)) / np.sqrt(K)).astype(dtype)
    return x, fused


@pytest.mark.parametrize("dtype, form, activation", [
    (jnp.float32, "fused", None), (jnp.float32, "pair", None),
    (jnp.bfloat16, "fused", None), (jnp.bfloat16, "pair", None),
    (jnp.float32, "fused", jax.nn.gelu), (jnp.float32, "pair", jax.nn.relu),
    (jnp.bfloat16, "fused", jax.nn.swish), (jnp.float32, "pair", jax.nn.swish),
])
def test_forward_and_gradients_match_reference(dtype, form, activation):
    x, fused = _inputs((2, 3), dtype)
    assert fused.dtype == dtype
    w_gate, w_up = fused[:, 0], fused[:, 1]
    weights = fused if form == "fused" else (w_gate, w_up)
    act = activation or jax.nn.identity  # None: the bilinear GLU, no activation
    out = tokamax.gated_linear_unit(x, weights, activation=activation, precision="highest")
    assert out.shape == (2, 3, N) and out.dtype == dtype
    assert_close(out, reference(x, w_gate, w_up, NP_ACTIVATIONS[act]), dtype)

    dout = random_normal(2, (2, 3, N))

    def loss(x, weights):
        y = tokamax.gated_linear_unit(x, weights, activation=activation, precision="highest")
        return jnp.sum(y.astype(jnp.float32) * dout)

    dx, dweights = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, weights)
    want_dx, want_dgate, want_dup = reference_grads(x, w_gate, w_up, dout, act)
    assert dx.dtype == dtype
    assert_close(dx, want_dx, dtype)
    if form == "fused":
        assert dweights.shape == (K, 2, N) and dweights.dtype == dtype
        dgate, dup = dweights[:, 0], dweights[:, 1]
    else:
        dgate, dup = dweights
    assert_close(dgate, want_dgate, dtype)
    assert_close(dup, want_dup, dtype)


def test_rank_one_x_and_vmap():
    """Rank-1 x under vmap, with the default activation (None: the bilinear GLU)."""
    x, fused = _inputs((4,), jnp.float32)
    dout = random_normal(2, (4, N))  # random cotangents, one per batch element
    batched_weights = jnp.stack([fused, 2 * fused])
    dout2 = random_normal(3, (2, N))

    def vmapped_over_weights(w):
        return jax.vmap(tokamax.gated_linear_unit, in_axes=(None, 0))(x[0], w)

    with jax.default_matmul_precision("highest"):
        out = jax.vmap(lambda x: tokamax.gated_linear_unit(x, fused))(x)
        out2 = vmapped_over_weights(batched_weights)
        dx = jax.vmap(jax.grad(lambda x, ct: jnp.sum(tokamax.gated_linear_unit(x, fused) * ct)))(
            x, dout)
        dweights = jax.grad(lambda w: jnp.sum(vmapped_over_weights(w) * dout2))(batched_weights)
    assert_close(out, reference(x, fused[:, 0], fused[:, 1], _np_identity))
    for i, w in enumerate((fused, 2 * fused)):
        assert_close(out2[i], reference(x[0], w[:, 0], w[:, 1], _np_identity))
        _, want_dgate, want_dup = reference_grads(x[0], w[:, 0], w[:, 1], dout2[i], jax.nn.identity)
        assert_close(dweights[i, :, 0], want_dgate)
        assert_close(dweights[i, :, 1], want_dup)
    want = reference_grads(x, fused[:, 0], fused[:, 1], dout, jax.nn.identity)[0]
    assert_close(dx, want)


def _specs(text):
    payloads = set(re.findall(r'tokamax_pass_spec = "((?:[^"\\]|\\.)*)"', text))
    unescape = lambda s: re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), s)
    return [unescape(p) for p in payloads]


def test_metadata_parses_back_with_default_activation():
    x, fused = _inputs((3,), jnp.bfloat16)
    pair = [fused[:, 0], fused[:, 1]]
    text = jax.jit(lambda x, w: tokamax.gated_linear_unit(x, w, precision="high")).lower(
        x, pair).as_text()
    (payload,) = _specs(text)
    ba = tokamax.BoundArguments.from_json(payload)
    assert type(ba.op) is GatedLinearUnit
    assert ba.arguments["activation"] is jax.nn.identity  # None: no activation
    assert ba.arguments["precision"] is jax.lax.Precision.HIGH
    assert ba.arguments["weights"] == (jax.ShapeDtypeStruct((K, N), jnp.bfloat16),) * 2
    # The parsed arguments bind again (ShapeDtypeStructs) to the same spec: tunable offline.
    assert GatedLinearUnit().bind(**ba.arguments).to_json() == ba.replace(
        op=GatedLinearUnit()).to_json()


def test_local_activation_runs_but_its_spec_does_not_reload():
    x, fused = _inputs((3,), jnp.float32)

    def local_act(z):
        return jnp.tanh(z)

    out = tokamax.gated_linear_unit(x, fused, activation=local_act, precision="highest")
    assert_close(out, reference(x, fused[:, 0], fused[:, 1], np.tanh))
    (payload,) = _specs(jax.jit(lambda x: tokamax.gated_linear_unit(
        x, fused, activation=local_act)).lower(x).as_text())
    with pytest.raises(spec.SpecError, match="not importable"):
        tokamax.BoundArguments.from_json(payload)


_X = jax.ShapeDtypeStruct((3, K), jnp.float32)
_W = jax.ShapeDtypeStruct((K, 2, N), jnp.float32)
_H = jax.ShapeDtypeStruct((K, N), jnp.float32)


@pytest.mark.parametrize("args, kwargs, match", [
    ((jnp.ones((3, K), jnp.int32), _W), {}, "x must be a floating-point"),
    ((jnp.float32(1.0), _W), {}, "x must have rank at least 1"),
    ((_X, jnp.ones((K + 1, 2, N))), {}, r"fused weights must have shape \(8, 2, N\)"),
    ((_X, jnp.ones((K, 3, N))), {}, r"fused weights must have shape \(8, 2, N\)"),
    ((_X, jnp.ones((K, N))), {}, "weights must have rank 3"),
    ((_X, jnp.ones((K, 2, N), jnp.int32)), {}, "weights must be a floating-point"),
    ((_X, (_H, _H, _H)), {}, "a sequence of 3"),
    ((_X, (_H, jnp.ones((K, N + 1)))), {}, "same shape and dtype"),
    ((_X, (_H, jnp.ones((K, N), jnp.bfloat16))), {}, "same shape and dtype"),
    ((_X, (jnp.ones((K + 1, N)), _H)), {}, r"w_gate\) must have shape \(8, N\)"),
    ((_X, _W), {"activation": "relu"}, "activation must be callable"),
    ((_X, _W), {"precision": "ultra"}, "precision must be"),
])
def test_bad_arguments_raise_value_errors_naming_them(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        GatedLinearUnit().bind(*args, **kwargs)


def test_public_function_raises_for_bad_input():
    with pytest.raises(ValueError, match="activation must be callable"):
        tokamax.gated_linear_unit(jnp.ones((2, K)), jnp.ones((K, 2, N)), activation=3)


def test_an_activation_closing_over_a_traced_value_is_a_clear_error():
    """A learnable beta closed over inside jit or grad failed at lowering ("No constant
    handler for type ... Tracer"); a constant closed over is fine."""
    x, w = random_normal(0, (2, 3, K)), random_normal(1, (K, 2, N))

    def glu(x, w, beta):
        return tokamax.gated_linear_unit(
            x, w, activation=lambda g: g * jax.nn.sigmoid(beta * g), implementation="xla")

    for transform in (jax.jit, jax.grad):
        with pytest.raises(ValueError, match="activation closes over a traced value"):
            transform(lambda beta: glu(x, w, beta).sum())(jnp.float32(1.5))
    beta = jnp.float32(1.5)
    gate, up = (jnp.einsum("bsk,kn->bsn", x, w[:, i], precision="highest") for i in (0, 1))
    assert_close(jax.jit(lambda x, w: glu(x, w, beta))(x, w),
                 gate * jax.nn.sigmoid(beta * gate) * up)
