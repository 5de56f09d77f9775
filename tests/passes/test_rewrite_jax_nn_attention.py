"""`optimize` rewrites `jax.nn.dot_product_attention` calls into the
`dot_product_attention` op where `implementation=None` picks a kernel for it, for every
argument `jax.nn` takes, and leaves near-misses as written.

The call is recognized while `optimize` traces, before JAX differentiates it: a gradient
taken inside the optimized function runs the op's own backward. On CPU the plain path is
chosen, so `rewritten` keeps every candidate: values and gradients of the rewritten
program (the op's `xla` path and its VJP) are compared with `jax.jit` of the user's
function, in float32 at HIGHEST precision.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _rewriting import REWRITTEN, h200_plan, op_names, outcomes, weighted
from conftest import assert_close, calibrate, random_normal
from tokamax_pass.passes import patterns_attention

B, T, S, N, K, H = 2, 8, 8, 4, 2, 16


def qkv(seed=0, t=T, s=S):
    return (random_normal(seed, (B, t, N, H)), random_normal(seed + 1, (B, s, K, H)),
            random_normal(seed + 2, (B, s, K, H)))


def hiding_mask(seed, t=T, s=S):
    """A random mask (B, 1, T, S) that hides every key of one row."""
    mask = np.asarray(jax.random.bernoulli(jax.random.key(seed), 0.6, (B, 1, t, s)))
    mask = mask.copy()
    mask[0, 0, 3, :] = False
    return jnp.asarray(mask)


# name -> (arrays after q, k, v by keyword, static keywords, key length)
CASES = {
    "plain": ({}, {}, S),
    "bias": ({"bias": random_normal(7, (B, N, T, S))}, {}, S),
    "bias_broadcast": ({"bias": random_normal(7, (T, S))}, {}, S),
    "mask_hiding_a_row": ({"mask": hiding_mask(8)}, {}, S),
    "causal": ({}, {"is_causal": True}, S),
    "scale": ({}, {"scale": 0.3}, S),
    "query_seq_lengths": ({"query_seq_lengths": jnp.array([5, 8], jnp.int32)}, {}, S),
    "key_value_seq_lengths_with_an_empty_one": (
        {"key_value_seq_lengths": jnp.array([6, 0], jnp.int32)}, {}, S),
    "both_seq_lengths_causal": (
        {"query_seq_lengths": jnp.array([7, 3], jnp.int32),
         "key_value_seq_lengths": jnp.array([4, 8], jnp.int32)}, {"is_causal": True}, S),
    "local_window": ({}, {"local_window_size": 2}, S),
    "local_window_causal": ({}, {"local_window_size": (3, 0), "is_causal": True}, S),
    "window_hiding_rows": ({}, {"local_window_size": (1, 1)}, 4),
    "implementation_xla_bias_mask": (
        {"bias": random_normal(7, (B, 1, T, S)), "mask": hiding_mask(9)},
        {"implementation": "xla", "is_causal": True}, S),
}


def attention_of(arrays, options):
    names = list(arrays)

    def attention(q, k, v, *values):
        return jax.nn.dot_product_attention(q, k, v, **dict(zip(names, values, strict=True)),
                                            **options)

    return attention, tuple(arrays.values())


@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_jit(rewritten, case):
    arrays, options, s = CASES[case]
    f, extra = attention_of(arrays, options)
    args = (*qkv(s=s), *extra)
    floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
    cotangent = random_normal(10, (B, T, N, H))
    loss = weighted(f, cotangent)
    with jax.default_matmul_precision("highest"):
        expected_out = jax.jit(f)(*args)
        expected = jax.jit(jax.value_and_grad(loss, argnums=floats))(*args)
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, *args) == [REWRITTEN]
    assert op_names(optimized, *args) == ["DotProductAttention"]
    assert_close(optimized(*args), expected_out)
    for differentiated in (jax.value_and_grad(weighted(optimized, cotangent), argnums=floats),
                           tokamax.optimize(jax.value_and_grad(loss, argnums=floats))):
        value, grads = differentiated(*args)
        assert_close(value, expected[0])
        for actual, wanted in zip(grads, expected[1], strict=True):
            assert_close(actual, wanted)


def test_a_gradient_inside_optimize_runs_the_ops_backward(rewritten):
    q, k, v = qkv()

    def loss(q, k, v):
        return weighted(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True),
                        random_normal(10, (B, T, N, H)))(q, k, v)

    optimized = tokamax.optimize(jax.grad(loss, argnums=(0, 1, 2)))
    assert outcomes(optimized, q, k, v) == [REWRITTEN]
    assert "DotProductAttention" in op_names(optimized, q, k, v)


def test_return_residual(rewritten):
    q, k, v = qkv()
    mask = hiding_mask(8)

    def f(q, k, v):
        out, lse = jax.nn.dot_product_attention(q, k, v, mask=mask, return_residual=True)
        return out.sum(-1) + lse

    cotangent = random_normal(10, (B, T, N))
    loss = weighted(f, cotangent)
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, q, k, v) == [REWRITTEN]
    assert_close(optimized(q, k, v), jax.jit(f)(q, k, v))
    expected = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    actual = jax.grad(weighted(optimized, cotangent), argnums=(0, 1, 2))(q, k, v)
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e)


def test_vmap_scan_remat_and_custom_vjp_bodies(rewritten):
    q, k, v = qkv()
    cotangent = random_normal(10, (B, T, N, H))

    def per_example(q, k, v):  # rank 3: (T, N, H)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    @jax.custom_vjp
    def custom(q, k, v):
        return per_example(q, k, v)

    def custom_fwd(q, k, v):
        return per_example(q, k, v), (q, k, v)

    def custom_bwd(saved, g):
        return jax.vjp(per_example, *saved)[1](g)

    custom.defvjp(custom_fwd, custom_bwd)

    def model(q, k, v):
        def layer(h, _):
            return jax.checkpoint(jax.vmap(per_example))(h, k, v), None

        scanned = jax.lax.scan(layer, q, length=2)[0]
        return ((scanned + jax.vmap(custom)(q, k, v)) * cotangent).sum()

    optimized = tokamax.optimize(model)
    matches = optimized.plan(q, k, v).matches
    assert len(matches) == 2 and all(m.rewritten for m in matches)
    expected = jax.jit(jax.value_and_grad(model, argnums=(0, 1, 2)))(q, k, v)
    for differentiated in (jax.value_and_grad(optimized, argnums=(0, 1, 2)),
                           tokamax.optimize(jax.value_and_grad(model, argnums=(0, 1, 2)))):
        value, grads = differentiated(q, k, v)
        assert_close(value, expected[0])
        for actual, wanted in zip(grads, expected[1], strict=True):
            assert_close(actual, wanted)


def test_a_traced_scale_is_left_as_written(rewritten):
    q, k, v = qkv()

    def f(q, k, v, scale):
        return jax.nn.dot_product_attention(q, k, v, scale=scale)

    scale = jnp.float32(0.3)
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, q, k, v, scale) == [
        "left alone: the scale is traced; the op takes a static one"]
    assert op_names(optimized, q, k, v, scale) == []
    assert_close(optimized(q, k, v, scale), jax.jit(f)(q, k, v, scale))


def test_cudnn_pinned_by_the_caller_is_left_as_written():
    q, k, v = qkv()
    candidate, _ = patterns_attention.candidate_for(q, k, v, implementation="cudnn")
    assert candidate.function is None and "implementation='cudnn'" in candidate.reason


def test_jax_nn_is_its_own_outside_optimize_and_without_the_pattern(rewritten):
    q, k, v = qkv()

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v)

    tokamax.optimize(f).plan(q, k, v)
    assert jax.nn.dot_product_attention is patterns_attention._ORIGINAL
    for option in (False, ("layer_norm",)):
        optimized = tokamax.optimize(f, rewrite=option)
        assert outcomes(optimized, q, k, v) == [] and op_names(optimized, q, k, v) == []
        assert_close(optimized(q, k, v), jax.jit(f)(q, k, v))


def _attention_loss(q, k, v):
    return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)


@pytest.mark.parametrize("transform", [
    lambda f: lambda q, k, v: jax.jvp(lambda q: f(q, k, v), (q,), (v[:, :, :1] * q,))[1],
    lambda f: lambda q, k, v: jax.jvp(jax.jit(lambda q: f(q, k, v)), (q,), (q * 0.5,))[1],
    lambda f: lambda q, k, v: jax.linearize(lambda q: f(q, k, v), q)[1](q),
    lambda f: lambda q, k, v: jax.jacfwd(lambda q: f(q, k, v))(q),
], ids=["jvp", "jvp_of_jit", "linearize", "jacfwd"])
def test_forward_mode_leaves_the_call_as_written(rewritten, transform):
    """An op has no forward-mode derivative: the call stays `jax.nn`'s."""
    q, k, v = qkv()
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    step = transform(_attention_loss)
    optimized = tokamax.optimize(step)
    assert op_names(optimized, q, k, v) == []
    with jax.default_matmul_precision("highest"):
        expected = jax.jit(step)(q, k, v)
    assert_close(optimized(q, k, v), expected)


def test_forward_over_reverse_runs_the_ops_backward(rewritten):
    """A Hessian-vector product, `jax.jvp` of `jax.grad`: the op's VJP is plain JAX,
    which forward mode differentiates."""
    q, k, v = qkv()
    tangent = random_normal(9, q.shape)

    def hvp(q, k, v):
        return jax.jvp(jax.grad(lambda q: _attention_loss(q, k, v)), (q,), (tangent,))[1]

    optimized = tokamax.optimize(hvp)
    assert outcomes(optimized, q, k, v) == [REWRITTEN]
    with jax.default_matmul_precision("highest"):
        expected = jax.jit(hvp)(q, k, v)
    assert_close(optimized(q, k, v), expected)


def test_a_function_jitted_inside_keeps_its_plain_trace_outside(rewritten):
    """`jax.jit` caches a traced jaxpr: the one traced inside `optimize`, holding the op,
    is not the one a plain call of the same jitted function gets."""
    q, k, v = qkv()
    jitted = jax.jit(_attention_loss)
    assert outcomes(tokamax.optimize(lambda q, k, v: jitted(q, k, v)), q, k, v) == [REWRITTEN]
    assert not tokamax.inspect(jitted.lower(q, k, v).as_text()).ops


# --- selection: only where a kernel is chosen ------------------------------------------

Q = jax.ShapeDtypeStruct((4, 4096, 32, 128), jnp.bfloat16)
KV = jax.ShapeDtypeStruct((4, 4096, 8, 128), jnp.bfloat16)


def causal(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def test_on_an_h200_a_kernel_replaces_the_call(calibration_dir):
    plan = h200_plan(causal, Q, KV, KV)
    (match,) = plan.matches
    assert match.rewritten and match.implementation["cuda"] != "xla"
    assert [row.implementation for row in plan] == [match.implementation["cuda"]]
    assert match.source_line.endswith("(causal)")


def test_where_the_plain_path_is_chosen_the_call_stays(monkeypatch):
    monkeypatch.setattr("tokamax_pass.passes.rewrite.rewrite_wins", lambda chosen: False)
    plan = h200_plan(causal, Q, KV, KV)
    (match,) = plan.matches
    assert not match.rewritten and match.reason.startswith("the plain path is chosen")
    assert len(plan) == 0


def test_export_records_the_rewrite_and_its_cpu_program_computes_the_same(calibration_dir):
    """Kept for the H200's kernel, the rewrite runs the op's `xla` path on CPU."""
    calibrate(calibration_dir, {"PallasMosaicGpuFlashAttention": 0.8,
                                "PallasTritonFlashAttention": 0.7, "DotProductAttention": 0.05})
    q = random_normal(0, (B, 1024, N, 64), jnp.bfloat16)
    k, v = (random_normal(i, (B, 1024, K, 64), jnp.bfloat16) for i in (1, 2))
    artifact = tokamax.optimize(causal).export(q, k, v, platforms=["cpu", "cuda"],
                                               device_kind="NVIDIA H200")
    (entry,) = artifact.manifest["rewrites"]
    assert entry["pattern"] == "dot_product_attention" and entry["rewritten"]
    assert entry["implementation"]["cpu"] == "xla" and entry["implementation"]["cuda"] != "xla"
    assert entry["source_line"].endswith("(causal)")
    # What chose the kernel, per platform: the predicted times.
    cpu, cuda = entry["reason"].split(" | ")
    assert cpu.startswith("cpu DotProductAttention: ")
    assert cuda.startswith("cuda Pallas") and "predicted" in cuda
    expected = jax.jit(causal)(*(a.astype(jnp.float32) for a in (q, k, v)))
    assert_close(artifact.exported.call(q, k, v), expected, jnp.bfloat16)
