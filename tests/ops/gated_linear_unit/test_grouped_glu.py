"""The grouped gated linear unit (`gated_linear_unit(..., group_sizes=...)`, MoE expert
GEMMs) by the `xla` implementation: forward and gradients of x and the weights against a
per-group float32 HIGHEST reference (uneven and empty groups, rows past the last group,
swish and gelu, fused and pair weights, bf16 and f32, random cotangents, nested vmap); its
gradient runs through the `ragged_dot` family; bad input names the argument; implementations
without a grouped form step aside; calls without `group_sizes` are unchanged."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from tokamax_kernels.gated_linear_unit import (
    GatedLinearUnit,
    GatedLinearUnitVjp,
    PallasTritonGatedLinearUnit,
)
from tokamax_kernels.ragged_dot.base import RaggedDot
from tokamax_pass import core

glu = tokamax.gated_linear_unit
SIZES = (37, 0, 61, 50)  # uneven, one empty group; 148 of 160 rows: the tail gives zeros
M, K, N, G = 160, 48, 40, len(SIZES)


def reference(x, weights, sizes, activation):
    """Group by group in float32 at HIGHEST precision; zeros past the last group."""
    x = x.astype(jnp.float32)
    if isinstance(weights, tuple):
        w_gate, w_up = (w.astype(jnp.float32) for w in weights)
    else:
        w_gate, w_up = weights[:, :, 0].astype(jnp.float32), weights[:, :, 1].astype(jnp.float32)
    rows, start = [], 0
    for g, size in enumerate(sizes):
        xg = x[start:start + size]
        gate = jnp.matmul(xg, w_gate[g], precision="highest")
        up = jnp.matmul(xg, w_up[g], precision="highest")
        rows.append(activation(gate) * up)
        start += size
    rows.append(jnp.zeros((x.shape[0] - start, w_gate.shape[2]), jnp.float32))
    return jnp.concatenate(rows)


def inputs(fused, dtype, seed=0, m=M, k=K, n=N, g=G):
    x = random_normal(seed, (m, k), dtype)
    if fused:
        weights = (random_normal(seed + 1, (g, k, 2, n)) / np.sqrt(k)).astype(dtype)
    else:
        weights = tuple((random_normal(seed + i, (g, k, n)) / np.sqrt(k)).astype(dtype)
                        for i in (1, 2))
    return x, weights


def check_against_reference(fn, x, weights, sizes, activation, dtype, seed=0):
    """`fn(x, weights)` and its gradients against the reference, random cotangent (one
    compiled program gives the output and the gradients)."""
    want = reference(x, weights, sizes, activation)
    cotangent = random_normal(seed + 7, want.shape)

    def loss(x, w):
        out = fn(x, w)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        x, weights)
    assert out.dtype == dtype and out.shape == want.shape
    assert_close(out, want, dtype)
    start = sum(sizes)
    assert not np.any(np.asarray(out[start:], np.float32))
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), (x, weights))
    wants = jax.grad(lambda x, w: jnp.sum(reference(x, w, sizes, activation) * cotangent),
                     argnums=(0, 1))(*wide)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(wants), strict=True):
        assert got.dtype == dtype
        assert_close(got, expected, dtype)


# Every pair of (fused, activation, dtype) values in four cases (a half fraction of the
# 2x2x2 product: bf16 exactly when the weights are fused and the activation is swish, or
# paired and gelu). Ids as pytest gave the full product's (dtype-activation-fused).
PAIRWISE = [(fused, activation, jnp.bfloat16 if fused == (activation is jax.nn.swish)
             else jnp.float32)
            for fused in (True, False) for activation in (jax.nn.swish, jax.nn.gelu)]
PAIRWISE_IDS = [f"{jnp.dtype(d).name}-{a.__name__}-{f}" for f, a, d in PAIRWISE]


@pytest.mark.parametrize("fused, activation, dtype", PAIRWISE, ids=PAIRWISE_IDS)
def test_xla_matches_reference(fused, activation, dtype):
    x, weights = inputs(fused, dtype, seed=3)
    sizes = jnp.array(SIZES, jnp.int32)

    def fn(x, w):
        return glu(x, w, group_sizes=sizes, activation=activation, implementation="xla",
                   precision="highest" if dtype == jnp.float32 else None)

    check_against_reference(fn, x, weights, SIZES, activation, dtype, seed=3)


def test_none_runs_xla_on_cpu_with_traced_group_sizes():
    x, weights = inputs(True, jnp.bfloat16, seed=5)

    def fn(x, w, sizes):
        return glu(x, w, group_sizes=sizes, activation=jax.nn.swish)

    sizes = jnp.array(SIZES, jnp.int32)
    assert_close(jax.jit(fn)(x, weights, sizes), reference(x, weights, SIZES, jax.nn.swish),
                 jnp.bfloat16)


def test_xla_forward_is_the_plain_expression():
    """One (G, K, 2N) ragged dot for fused weights, as `ragged_dot` then the activation."""
    x, weights = inputs(True, jnp.bfloat16, seed=9)
    sizes = jnp.array(SIZES, jnp.int32)
    g, k, _, n = weights.shape
    both = jax.lax.ragged_dot(x, weights.reshape(g, k, 2 * n), sizes)
    plain = (jax.nn.swish(both[:, :n].astype(jnp.float32))
             * both[:, n:].astype(jnp.float32)).astype(x.dtype)
    out = glu(x, weights, group_sizes=sizes, activation=jax.nn.swish, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))
    text = jax.export.export(
        jax.jit(lambda x, w, s: glu(x, w, group_sizes=s, implementation="xla")),
        platforms=["cuda"])(x, weights, sizes).mlir_module()
    assert text.count("stablehlo.composite \"chlo.ragged_dot\"") == 1


@pytest.mark.parametrize("fused", [True, False])
def test_gradient_runs_ragged_dot_family_calls(fused):
    """The backward's GEMMs are `ragged_dot` op calls (dlhs, drhs): `None` can run measured
    kernels for them. Fused weights: one of each; a pair: two of each."""
    x, weights = inputs(fused, jnp.bfloat16, seed=11)
    sizes = jnp.array(SIZES, jnp.int32)
    ba = GatedLinearUnitVjp().bind(
        (jax.ShapeDtypeStruct((M, 2 * N), x.dtype) if fused
         else (jax.ShapeDtypeStruct((M, N), x.dtype),) * 2),
        jax.ShapeDtypeStruct((M, N), x.dtype), jax.ShapeDtypeStruct((M, N), x.dtype),
        x=x, weights=weights, group_sizes=sizes, activation=jax.nn.swish, precision=None)
    calls = GatedLinearUnitVjp().evidence_calls(ba)
    variants = [c.arguments["variant"] for c in calls]
    assert variants == (["dlhs", "drhs"] if fused else ["dlhs", "dlhs", "drhs", "drhs"])
    assert all(isinstance(c.op, RaggedDot) for c in calls)
    if fused:
        assert calls[0].arguments["rhs"].shape == (len(SIZES), K, 2 * N)
    grad = jax.jit(jax.grad(lambda x, w, s: jnp.sum(glu(x, w, group_sizes=s).astype(
        jnp.float32)), argnums=(0, 1)))
    text = jax.export.export(grad, platforms=["cuda"])(x, weights, sizes).mlir_module()
    composites = [line for line in text.splitlines()
                  if 'stablehlo.composite "chlo.ragged_dot"' in line]
    ragged_dot_calls = [line for line in composites if "ragged_dot.base.RaggedDot\\22" in line]
    assert len(composites) == (1 if fused else 2) + len(calls)
    assert len(ragged_dot_calls) == len(calls)


def test_dense_calls_keep_their_arguments():
    """No `group_sizes` key: dense calls keep their cache keys and residual-free forward."""
    x = jax.ShapeDtypeStruct((4, 8, 16), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((16, 2, 24), jnp.bfloat16)
    ba = GatedLinearUnit().bind(x, w)
    assert "group_sizes" not in ba.arguments
    assert "group_sizes" not in ba.cache_key


BAD = [
    # (x shape, weights, group sizes, what the message names)
    ((M, K), ("fused", (K, 2, N)), ((4,), jnp.int32), "weights"),
    ((M, K), ("pair", (K, N)), ((4,), jnp.int32), "w_gate"),
    ((M, K), ("fused", (4, K, 2, N)), ((3,), jnp.int32), "group_sizes"),
    ((M, K), ("fused", (4, K + 1, 2, N)), ((4,), jnp.int32), "K = the last axis of x"),
    ((M, K), ("fused", (4, K, 3, N)), ((4,), jnp.int32), "(G, K, 2, N)"),
    ((M, K), ("fused", (4, K, 2, N)), ((4,), jnp.float32), "group_sizes must be an integer"),
    ((M, K), ("fused", (4, K, 2, N)), ((4, 1), jnp.int32), "group_sizes"),
    ((2, M, K), ("fused", (4, K, 2, N)), ((4,), jnp.int32), "x"),
]


@pytest.mark.parametrize("x_shape, weights, sizes, names", BAD)
def test_bad_input_names_the_argument(x_shape, weights, sizes, names):
    x = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16)
    form, shape = weights
    w = (jax.ShapeDtypeStruct(shape, jnp.bfloat16) if form == "fused"
         else (jax.ShapeDtypeStruct(shape, jnp.bfloat16),) * 2)
    gs = jax.ShapeDtypeStruct(*sizes)
    with pytest.raises(ValueError, match=names.replace("(", r"\(").replace(")", r"\)")):
        jax.eval_shape(lambda x, w, s: glu(x, w, group_sizes=s), x, w, gs)


def test_concrete_bad_group_sizes_and_mixed_dtypes():
    x, weights = inputs(True, jnp.bfloat16)
    with pytest.raises(ValueError, match="group_sizes must be >= 0"):
        glu(x, weights, group_sizes=jnp.array([5, -1, 3, 0], jnp.int32))
    with pytest.raises(ValueError, match="group_sizes sum to 161"):
        glu(x, weights, group_sizes=jnp.array([100, 61, 0, 0], jnp.int32))
    with pytest.raises(ValueError, match="one dtype"):
        glu(x.astype(jnp.float32), weights, group_sizes=jnp.array(SIZES, jnp.int32))
    with pytest.raises(ValueError, match="group_sizes must be an int32 array"):
        glu(x, weights, group_sizes=list(SIZES))


def test_triton_has_no_grouped_form_and_none_steps_past_it():
    x, weights = inputs(True, jnp.bfloat16)
    sizes = jnp.array(SIZES, jnp.int32)
    triton = PallasTritonGatedLinearUnit(interpret=True)  # runs here: only the form is missing
    with pytest.raises(NotImplementedError, match="no grouped form"):
        glu(x, weights, group_sizes=sizes, implementation=triton)
    want = glu(x, weights, group_sizes=sizes, implementation="xla")
    got = glu(x, weights, group_sizes=sizes, implementation=(triton, "xla"))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def check_nested_vmap(implementation, x, weights, sizes, activation=jax.nn.swish,
                      dtype=jnp.float32, seed=0):
    """Nested `jax.vmap` of a grouped call against the reference entry by entry: x
    (2, 2, M, K) and `sizes` (2, 2, G) mapped at both levels, the weights (2, ...) only at
    the outer one (the inner entries share them); the gradients of x and the weights
    under a random cotangent."""
    def fn(x, weights):
        def one(x, w, s):
            return glu(x, w, group_sizes=s, activation=activation,
                       implementation=implementation)
        return jax.vmap(jax.vmap(one, in_axes=(0, None, 0)))(x, weights, jnp.asarray(sizes))

    def want_fn(x, weights):
        return jnp.stack([jnp.stack([
            reference(x[i, j], jax.tree.map(lambda w, i=i: w[i], weights),
                      tuple(int(n) for n in sizes[i, j]), activation)
            for j in range(2)]) for i in range(2)])

    wide = jax.tree.map(lambda a: a.astype(jnp.float32), (x, weights))
    cotangent = random_normal(seed + 7, (*x.shape[:-1], jax.tree.leaves(weights)[0].shape[-1]))

    def output_and_grads(fn, x, w):  # one compiled program for the output and gradients
        def loss(x, w):
            out = fn(x, w)
            return jnp.sum(out.astype(jnp.float32) * cotangent), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
        return out, grads

    out, grads = jax.jit(functools.partial(output_and_grads, fn))(x, weights)
    want, wants = jax.jit(functools.partial(output_and_grads, want_fn))(*wide)
    assert_close(out, want, dtype)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(wants), strict=True):
        assert_close(got, expected, dtype)


def nested_vmap_inputs(fused, dtype, seed=0, m=M, k=K, n=N, g=G):
    """x (2, 2, M, K), weights per outer entry, and uneven sizes per entry (an empty group
    somewhere, rows past the last group)."""
    x = random_normal(seed, (2, 2, m, k), dtype)
    shape = (2, g, k, 2, n) if fused else (2, g, k, n)
    parts = [(random_normal(seed + i, shape) / np.sqrt(k)).astype(dtype) for i in (1, 2)]
    sizes = np.random.default_rng(seed).integers(1, m // g + 1, (2, 2, g), np.int32)
    sizes[0, 1, 1] = 0
    return x, parts[0] if fused else tuple(parts), sizes


@pytest.mark.parametrize("fused", [True, False])
def test_xla_under_nested_vmap_matches_reference(fused):
    check_nested_vmap("xla", *nested_vmap_inputs(fused, jnp.float32, seed=41))


def test_mosaic_gpu_refuses_a_grouped_call_under_vmap():
    """Its kernel has no batching: the error names the implementations that take it."""
    x = jax.ShapeDtypeStruct((2, 1024, 2048), jnp.bfloat16)
    weights = jax.ShapeDtypeStruct((8, 2048, 2, 5632), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((2, 8), jnp.int32)

    def f(x, weights, sizes):
        def one(x, w, s):
            return glu(x, w, group_sizes=s, implementation="mosaic_gpu")
        return jax.vmap(one, in_axes=(0, None, 0))(x, weights, sizes)

    with core.targeting("NVIDIA H200", "cuda"), pytest.raises(
            NotImplementedError, match="grouped calls .group_sizes. under jax.vmap; use "
                                       "implementation='xla' or, on a TPU, 'mosaic_tpu'"):
        jax.export.export(jax.jit(f), platforms=["cuda"])(x, weights, sizes)
