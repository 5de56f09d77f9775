"""Property-based tests (hypothesis): random user data into the public APIs.

Each case either works (and, for the numeric cases, matches a float64 reference) or raises
`ValueError`/`TypeError`/`NotImplementedError` whose message names the bad argument;
never another exception from deep inside JAX. Examples are derandomized, so CI runs the
same 1,000+ cases every time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import string
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokamax_pass as tokamax
from tokamax_kernels.attention.base import DotProductAttention
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.ragged_dot.base import RaggedDot
from tokamax_pass.autotuning import discovery
from tokamax_pass.core import spec

settings.register_profile("ci", derandomize=True, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")

ACCEPTED = (ValueError, TypeError, NotImplementedError)
DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.bool_])
FLOATS = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])
SIZE = st.integers(0, 9)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _names_an_argument(error: Exception, names: tuple[str, ...]) -> bool:
    text = str(error)
    return any(name in text for name in names)


# --- argument checks: bind never crashes, and names what is wrong ------------------------


@settings(max_examples=250)
@given(shape=st.lists(SIZE, min_size=0, max_size=4), dtype=DTYPES,
       scale=st.one_of(st.none(), st.lists(SIZE, min_size=1, max_size=2)),
       axis=st.integers(-5, 5), epsilon=st.floats(-1, 1) | st.just(float("nan")))
def test_layer_norm_bind(shape, dtype, scale, axis, epsilon):
    scale_arg = None if scale is None else _sds(scale, jnp.float32)
    try:
        ba = LayerNorm().bind(_sds(shape, dtype), scale_arg, None, axis=axis, epsilon=epsilon)
    except ACCEPTED as e:
        assert _names_an_argument(e, ("x", "scale", "axis", "epsilon")), e
        return
    assert ba.arguments["axis"] == axis % len(shape) and ba.arguments["epsilon"] >= 0


@settings(max_examples=150)
@given(shape=st.lists(SIZE, min_size=1, max_size=3), dtype=FLOATS,
       residual_shape=st.none() | st.lists(SIZE, min_size=0, max_size=3),
       residual_dtype=DTYPES)
def test_layer_norm_residual_bind(shape, dtype, residual_shape, residual_dtype):
    """A residual of another shape or dtype than x is a ValueError naming `residual`."""
    shape = tuple(shape)
    residual = _sds(shape if residual_shape is None else residual_shape, residual_dtype)
    try:
        ba = LayerNorm().bind(_sds(shape, dtype), None, None, residual=residual)
    except ACCEPTED as e:
        assert "residual" in str(e), e
        assert residual.shape != shape or jnp.dtype(residual.dtype) != jnp.dtype(dtype)
        return
    assert ba.arguments["residual"] is residual


@settings(max_examples=250)
@given(m=SIZE, k=SIZE, n=SIZE, g=st.integers(0, 4), lhs_dtype=DTYPES, rhs_dtype=DTYPES,
       sizes_dtype=st.sampled_from([jnp.int32, jnp.float32]), rank=st.integers(1, 4),
       variant=st.sampled_from(["forward", "dlhs", "drhs", "sideways"]))
def test_ragged_dot_bind(m, k, n, g, lhs_dtype, rhs_dtype, sizes_dtype, rank, variant):
    rhs_shape = (g, k, n)[:rank] if rank <= 3 else (g, k, n, 1)
    try:
        RaggedDot().bind(_sds((m, k), lhs_dtype), _sds(rhs_shape, rhs_dtype),
                         _sds((g,), sizes_dtype), variant=variant)
    except ACCEPTED as e:
        assert _names_an_argument(e, ("lhs", "rhs", "group_sizes", "variant", "K mismatch",
                                      "N mismatch", "M mismatch")), e


@settings(max_examples=200)
@given(b=st.integers(1, 3), t=SIZE, s=SIZE, n=st.integers(1, 4), kv=st.integers(1, 4),
       d=st.sampled_from([0, 8, 16]), dtype=DTYPES, k_dtype=DTYPES,
       window=st.one_of(st.none(), st.integers(-2, 4)),
       soft_cap=st.none() | st.floats(-2, 60) | st.just(float("nan")),
       lengths=st.one_of(st.none(), st.integers(1, 4)))
def test_attention_bind(b, t, s, n, kv, d, dtype, k_dtype, window, soft_cap, lengths):
    q, k = _sds((b, t, n, d), dtype), _sds((b, s, kv, d), k_dtype)
    seq = None if lengths is None else _sds((lengths,), jnp.int32)
    try:
        DotProductAttention().bind(q, k, k, local_window_size=window, logits_soft_cap=soft_cap,
                                   query_seq_lengths=seq)
    except ACCEPTED as e:
        assert _names_an_argument(e, ("query", "key", "value", "heads", "head_dim", "window",
                                      "logits_soft_cap", "query_seq_lengths", "batch")), e


@settings(max_examples=150)
@given(x_shape=st.lists(SIZE, min_size=0, max_size=3), k=SIZE, n=SIZE, dtype=DTYPES,
       fused=st.booleans(), pair_k=SIZE)
def test_gated_linear_unit_bind(x_shape, k, n, dtype, fused, pair_k):
    x = _sds((*x_shape, k), dtype)
    weights = _sds((k, 2, n), dtype) if fused else (_sds((pair_k, n), dtype),
                                                    _sds((k, n), dtype))
    try:
        GatedLinearUnit().bind(x, weights)
    except ACCEPTED as e:
        assert _names_an_argument(e, ("x", "weights", "w_gate", "w_up")), e


@settings(max_examples=150)
@given(x_rank=st.integers(1, 3), m=SIZE, k=SIZE, n=SIZE, g=st.integers(0, 4), dtype=DTYPES,
       w_dtype=DTYPES, sizes_dtype=DTYPES, fused=st.booleans(), grouped_weights=st.booleans(),
       sizes_g=st.integers(0, 4), w_k=SIZE)
def test_grouped_gated_linear_unit_bind(x_rank, m, k, n, g, dtype, w_dtype, sizes_dtype, fused,
                                        grouped_weights, sizes_g, w_k):
    x = _sds((*(m,) * (x_rank - 1), k), dtype)
    lead = (g, w_k) if grouped_weights else (w_k,)
    weights = (_sds((*lead, 2, n), w_dtype) if fused
               else (_sds((*lead, n), w_dtype), _sds((*lead, n), w_dtype)))
    try:
        GatedLinearUnit().bind(x, weights, group_sizes=_sds((sizes_g,), sizes_dtype))
    except ACCEPTED as e:
        assert _names_an_argument(e, ("x", "weights", "w_gate", "w_up", "group_sizes")), e


# --- user data as text: array specs, results, caches, bound-argument lists ---------------

SPEC_TEXT = st.one_of(
    st.text(alphabet=string.ascii_lowercase + string.digits + "[],- ", max_size=20),
    st.builds(lambda d, dims: f"{d}[{','.join(map(str, dims))}]",
              st.sampled_from(["f32", "bf16", "s32", "f16", "q7", "pred", ""]),
              st.lists(st.integers(-2, 9), max_size=4)),
)


@settings(max_examples=200)
@given(text=SPEC_TEXT)
def test_array_specs(text):
    try:
        parsed = spec.parse_array_spec(text)
    except spec.SpecError as e:
        assert "spec" in str(e)
        return
    assert spec.array_spec(parsed) == text.strip()


def _corrupt(document: str, cut: int, junk: str) -> str:
    return document[:cut % (len(document) + 1)] + junk


@pytest.fixture(scope="module")
def result_document():
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    scale = jax.ShapeDtypeStruct((16,), jnp.float32)
    ba = LayerNorm().bind(x, scale, None)
    from tokamax_pass.autotuning import keys
    from tokamax_pass.autotuning.entry import Entry, Measurement

    entry = Entry(keys.canonical(ba), {tokamax.NullConfig(): Measurement((1.0,))},
                  keys.provenance(ba.op))
    return tokamax.AutotuningResult("cpu", [entry]).dumps()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8)


@settings(max_examples=150)
@given(cut=st.integers(0, 10**6), junk=st.text(max_size=5), value=JSON_VALUES,
       key=st.sampled_from(["format", "schema_version", "entries", "device_kind", "op",
                            "arguments", "configs"]))
def test_autotuning_results_load_or_say_why(result_document, cut, junk, value, key):
    """Truncated documents and any value under a known key load or raise SpecError."""
    documents = [_corrupt(result_document, cut, junk)]
    data = json.loads(result_document)
    data[key] = value
    documents.append(json.dumps(data))
    entry = json.loads(result_document)["entries"][0]
    entry[key] = value
    data = json.loads(result_document)
    data["entries"] = [entry]
    documents.append(json.dumps(data))
    for document in documents:
        with contextlib.suppress(spec.SpecError):
            tokamax.AutotuningResult.loads(document)


@settings(max_examples=100)
@given(value=JSON_VALUES, junk=st.text(max_size=8))
def test_bound_args_lists_load_or_say_why(value, junk):
    for text in (json.dumps(value), json.dumps([value]), "[" + junk):
        with contextlib.suppress(spec.SpecError):
            discovery.bound_args_from_json(text if text.lstrip().startswith(("{", "[")) else
                                           "[" + text)


@settings(max_examples=60)
@given(value=JSON_VALUES, cut=st.integers(0, 10**6))
def test_user_cache_files_never_crash_resolution(value, cut, result_document, user_cache):
    """Whatever the user cache file holds, op calls still resolve (a corrupt file is
    reported and skipped)."""
    x = jax.ShapeDtypeStruct((2, 4), jnp.float32)
    for text in (json.dumps(value), _corrupt(result_document, cut, "")):
        user_cache.write_text(text)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lowered = jax.jit(lambda x: tokamax.layer_norm(x, None, None)).lower(x)
        assert "tokamax_pass_spec" in lowered.as_text()


@pytest.fixture(scope="module")
def user_cache(tmp_path_factory):
    from tokamax_pass.autotuning import cache

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cache.ENV_CACHE_DIR, str(tmp_path_factory.mktemp("cache")))
        yield cache.cache_file("cpu")


# --- numerics: random valid inputs match a float64 reference -----------------------------


@settings(max_examples=25)
@given(rows=st.integers(1, 6), features=st.integers(1, 9), subtract_mean=st.booleans(),
       with_scale=st.booleans(), with_offset=st.booleans(), seed=st.integers(0, 2**16))
def test_layer_norm_matches_reference(rows, features, subtract_mean, with_scale, with_offset,
                                      seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, rows, features)).astype(np.float32)
    scale = rng.standard_normal(features).astype(np.float32) if with_scale else None
    offset = rng.standard_normal(features).astype(np.float32) if with_offset else None
    out = tokamax.layer_norm(x, scale, offset, subtract_mean=subtract_mean, implementation="xla")
    xd = x.astype(np.float64)
    mean = xd.mean(-1, keepdims=True) if subtract_mean else 0.0
    want = (xd - mean) / np.sqrt(((xd - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
    want = want * (1 if scale is None else scale) + (0 if offset is None else offset)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-4, atol=2e-4)


@functools.partial(jax.jit, static_argnames="subtract_mean")
def _residual_norm_value_and_grad(h, x, scale, dy, ds, *, subtract_mean):
    """One compiled program per example's shapes (not one per operation, as eagerly)."""
    def loss(h, x):
        y, s = tokamax.layer_norm(h, scale, None, subtract_mean=subtract_mean, residual=x,
                                  implementation="xla")
        return jnp.sum(y * dy) + jnp.sum(s * ds), (y, s)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, x)


@settings(max_examples=25)
@given(rows=st.integers(1, 6), features=st.integers(1, 9), subtract_mean=st.booleans(),
       with_scale=st.booleans(), seed=st.integers(0, 2**16))
def test_layer_norm_with_residual_matches_reference(rows, features, subtract_mean, with_scale,
                                                    seed):
    """`layer_norm(h, residual=x)` is `(norm(x + h), x + h)`, forward and gradient."""
    rng = np.random.default_rng(seed)
    h, x, dy, ds = (rng.standard_normal((2, rows, features)).astype(np.float32)
                    for _ in range(4))
    scale = rng.standard_normal(features).astype(np.float32) if with_scale else None

    (_, (y, s)), (dh, dx) = _residual_norm_value_and_grad(h, x, scale, dy, ds,
                                                          subtract_mean=subtract_mean)
    sd = x.astype(np.float64) + h
    mean = sd.mean(-1, keepdims=True) if subtract_mean else 0.0
    rstd = 1 / np.sqrt(((sd - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
    x_hat = (sd - mean) * rstd
    np.testing.assert_allclose(np.asarray(s), sd, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y), x_hat * (1 if scale is None else scale),
                               rtol=2e-4, atol=2e-4)
    g = dy * (1 if scale is None else scale)  # the norm's VJP in float64, plus ds
    want = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdims=True)
                   - (g.mean(-1, keepdims=True) if subtract_mean else 0.0)) + ds
    tolerance = 2e-4 * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(np.asarray(dh), want, atol=tolerance)
    np.testing.assert_array_equal(np.asarray(dh), np.asarray(dx))


@settings(max_examples=25)
@given(sizes=st.lists(st.integers(0, 5), min_size=1, max_size=4), extra_rows=st.integers(0, 3),
       k=st.integers(1, 6), n=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_ragged_dot_matches_reference(sizes, extra_rows, k, n, seed):
    rng = np.random.default_rng(seed)
    m = sum(sizes) + extra_rows
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    out = tokamax.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32), implementation="xla",
                             precision=jax.lax.Precision.HIGHEST)
    want = np.zeros((m, n))
    start = 0
    for g, size in enumerate(sizes):
        want[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs[g]
        start += size
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)


@settings(max_examples=20)
@given(sizes=st.lists(st.integers(0, 5), min_size=1, max_size=4), extra_rows=st.integers(0, 3),
       k=st.integers(1, 6), n=st.integers(1, 6), fused=st.booleans(), seed=st.integers(0, 2**16))
def test_grouped_gated_linear_unit_matches_reference(sizes, extra_rows, k, n, fused, seed):
    rng = np.random.default_rng(seed)
    m, g = sum(sizes) + extra_rows, len(sizes)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((g, k, 2, n)).astype(np.float32)
    weights = w if fused else (w[:, :, 0], w[:, :, 1])
    out = tokamax.gated_linear_unit(x, weights, group_sizes=jnp.asarray(sizes, jnp.int32),
                                    activation=jax.nn.swish, implementation="xla",
                                    precision=jax.lax.Precision.HIGHEST)
    want = np.zeros((m, n))
    start = 0
    for group, size in enumerate(sizes):
        rows = x[start:start + size].astype(np.float64)
        gate, up = rows @ w[group, :, 0], rows @ w[group, :, 1]
        want[start:start + size] = gate / (1 + np.exp(-gate)) * up
        start += size
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)


@settings(max_examples=25)
@given(batch=st.lists(st.integers(1, 2), max_size=2), t=st.integers(1, 7), s=st.integers(1, 7),
       kv_heads=st.integers(1, 2), group=st.integers(1, 2), causal=st.booleans(),
       implementation=st.sampled_from(["xla", "xla_chunked"]), seed=st.integers(0, 2**16))
def test_attention_residual_matches_reference(batch, t, s, kv_heads, group, causal,
                                              implementation, seed):
    """`return_residual=True` with any leading batch axes (none too): the output and lse
    (shape `(*batch, T, N)`, natural log) against a float64 reference; a row whose mask
    hides every key gets zeros and `jax.nn`'s masked lse, `-0.7 * float32 max`."""
    rng = np.random.default_rng(seed)
    n, d = kv_heads * group, 4
    q = rng.standard_normal((*batch, t, n, d)).astype(np.float32)
    k, v = (rng.standard_normal((*batch, s, kv_heads, d)).astype(np.float32) for _ in range(2))
    mask = rng.random((t, s)) < 0.6
    out, lse = tokamax.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                             implementation=implementation,
                                             return_residual=True)
    assert out.shape == q.shape and lse.shape == q.shape[:-1] and lse.dtype == np.float32
    keep = mask & (np.tril(np.ones((t, s), bool)) if causal else True)
    kd = np.repeat(k.astype(np.float64), group, axis=-2)
    vd = np.repeat(v.astype(np.float64), group, axis=-2)
    logits = np.einsum("...tnd,...snd->...nts", q.astype(np.float64), kd) / np.sqrt(d)
    logits = np.where(keep, logits, -np.inf)
    seen = keep.any(-1)  # (t,)
    peak = np.where(seen[:, None], logits.max(-1, keepdims=True, initial=-np.inf), 0.0)
    total = np.exp(logits - peak).sum(-1, keepdims=True)
    want_lse = np.where(seen, (peak + np.log(np.where(seen[:, None], total, 1.0)))[..., 0],
                        -0.7 * float(np.finfo(np.float32).max))
    probs = np.exp(logits - peak) / np.where(total > 0, total, 1.0)
    want = np.einsum("...nts,...snd->...tnd", probs, vd)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(lse), np.swapaxes(want_lse, -1, -2), rtol=1e-5,
                               atol=1e-5)


@settings(max_examples=20)
@given(value=st.one_of(st.none(), st.integers(0, 1), st.text(max_size=3), st.floats()))
def test_attention_return_residual_takes_only_a_bool(value):
    q = jnp.ones((2, 3, 1, 4), jnp.float32)
    with pytest.raises(TypeError, match="return_residual"):
        tokamax.dot_product_attention(q, q, q, implementation="xla", return_residual=value)
