"""A second hardening audit of the ops' bad input (see `tests/ops/test_bad_inputs.py`): each
row crashed deep inside JAX or the op (an `AttributeError`, an `OverflowError`, JAX's
"not a valid JAX type"), or returned a silently wrong result, before the fix it names.

The last section does the same for the library layer (autotuning results and the user
cache, `bound_args_to_json`, export, benchmarking, the command line); the earlier audit
of it is `tests/autotuning/test_bad_framework_inputs.py`.
"""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from tokamax_pass import benchmarking
from tokamax_pass.autotuning import cache as cache_lib
from tokamax_pass.autotuning import discovery, keys
from tokamax_pass.autotuning.entry import Entry, Measurement
from tokamax_pass.cli import main
from tokamax_pass.core.spec import SpecError

Q = jnp.ones((2, 16, 4, 32))
KV = jnp.ones((2, 16, 2, 32))
X = jnp.ones((8, 32))
W = jnp.ones((32, 2, 8))
LHS, RHS = jnp.ones((32, 16)), jnp.ones((4, 16, 8))
SIZES = jnp.array([8, 8, 8, 8], jnp.int32)
LABELS = jnp.arange(8, dtype=jnp.int32)
LCE_W = jnp.ones((32, 64))


def _sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _attention(q=Q, k=KV, v=KV, **kwargs):
    return lambda: tokamax.dot_product_attention(q, k, v, **kwargs)


def _xla_attention(op):
    return lambda: tokamax.dot_product_attention(Q, KV, KV, implementation=op)


# (error, match, call): `match` names the argument.
BAD = [
    # A jax.ShapeDtypeStruct where a value is needed: "Argument 'args[1]' ... is not a
    # valid JAX type" (rank 4), or an AttributeError while folding (other ranks).
    (ValueError, "query must be an array, got a jax.ShapeDtypeStruct", _attention(q=_sds(Q))),
    (ValueError, "bias must be an array, got a jax.ShapeDtypeStruct",
     _attention(Q[0], KV[0], KV[0], bias=_sds(jnp.ones((16, 16))))),
    (ValueError, "key_value_seq_lengths must be an array, got a jax.ShapeDtypeStruct",
     _attention(key_value_seq_lengths=_sds(jnp.ones(2, jnp.int32)))),
    (ValueError, "x must be an array, got a jax.ShapeDtypeStruct",
     lambda: tokamax.layer_norm(_sds(X), None, None)),
    (ValueError, "residual must be an array, got a jax.ShapeDtypeStruct",
     lambda: tokamax.layer_norm(X, None, None, residual=_sds(X))),
    (ValueError, "group_sizes must be an array, got a jax.ShapeDtypeStruct",
     lambda: tokamax.ragged_dot(LHS, RHS, _sds(SIZES))),
    (ValueError, "weights must be an array, got a jax.ShapeDtypeStruct",
     lambda: tokamax.gated_linear_unit(X, (_sds(W[:, 0]), W[:, 1]))),
    (ValueError, "labels must be an array, got a jax.ShapeDtypeStruct",
     lambda: tokamax.linear_softmax_cross_entropy_loss(X, _sds(LABELS), LCE_W)),
    # A query of None (rank-3 key): AttributeError; a ragged list: NumPy's message.
    (ValueError, "query must be an array", _attention(None, KV[0], KV[0])),
    (ValueError, "query must be an array or a list", _attention([[1.0], [1.0, 2.0]],
                                                                KV[0], KV[0])),
    # A window past int32: OverflowError inside jnp.
    (ValueError, "local_window_size must be at most", _attention(local_window_size=2**40)),
    # Negative lengths silently hid every row or key (zeros out); an int64 length past
    # int32 wrapped silently.
    (ValueError, "query_seq_lengths must be >= 0",
     _attention(query_seq_lengths=jnp.array([-1, 4]))),
    (ValueError, "key_value_seq_lengths must be >= 0",
     _attention(key_value_seq_lengths=np.array([4, 2**32 + 3]))),
    (ValueError, "key_value_seq_lengths must be >= 0",
     _attention(Q[0], KV[0], KV[0], key_value_seq_lengths=np.array(-2))),
    # A pinned config or VJP op of the wrong kind: AttributeError deep in the kernel
    # ("'int' object has no attribute 'chunk_q'"), silently ignored (the XLA op), or an
    # AttributeError only under jax.grad.
    (TypeError, "config must be a XlaChunkedConfig",
     _xla_attention(tokamax.XlaChunkedDotProductAttention(config=5))),
    (TypeError, "config must be a NullConfig", _xla_attention(tokamax.DotProductAttention(
        config=tokamax.XlaChunkedDotProductAttention.config_cls(chunk_q=8, chunk_k=8)))),
    (TypeError, "vjp must be a VJP op",
     _xla_attention(tokamax.DotProductAttention(vjp=tokamax.DotProductAttention()))),
    # A VJP op of another family: KeyError 'query' (or a missing-argument TypeError),
    # only under jax.grad.
    (TypeError, "vjp=XlaDotProductAttentionVjp\\(\\) is the gradient of another family",
     lambda: tokamax.layer_norm(X, None, None, implementation=tokamax.LayerNorm(
         vjp=tokamax.XlaDotProductAttentionVjp()))),
    (TypeError, "the gradient of another family \\(RaggedDot\\)",
     _xla_attention(tokamax.DotProductAttention(vjp=tokamax.RaggedDotVjp()))),
    # bytes iterated as names: "unknown implementation 120".
    (TypeError, "implementation must be None", _xla_attention(b"xla")),
    # A nested sequence: "unhashable type: 'list'" from the name lookup.
    (TypeError, "flat sequence of those; the sequence holds \\['xla'\\]",
     _xla_attention([["xla"]])),
    # A 0-d NumPy string passed the `in` check, then crashed in JAX's staging.
    (ValueError, "reduction must be one of", lambda: tokamax.linear_softmax_cross_entropy_loss(
        X, LABELS, LCE_W, reduction=np.array("sum"))),
    # A complex activation's imaginary part was silently dropped by the cast to x's dtype.
    (ValueError, "activation must return real values", lambda: tokamax.gated_linear_unit(
        X, W, activation=lambda a: a.astype(jnp.complex64))),
    # Group sizes of a dtype that cannot count the rows: jax.lax.ragged_dot sums them in
    # that dtype, so int8 sizes over 256 rows wrapped and misplaced rows, silently.
    (ValueError, "group_sizes of dtype int8 .* cannot count the 256 rows of lhs",
     lambda: tokamax.ragged_dot(jnp.ones((256, 4)), jnp.ones((2, 4, 4)),
                                jnp.array([100, 100], jnp.int8))),
    (ValueError, "group_sizes of dtype uint8 .* cannot count the 256 rows of x",
     lambda: tokamax.gated_linear_unit(jnp.ones((256, 4)), jnp.ones((2, 4, 2, 4)),
                                       group_sizes=jnp.array([100, 100], jnp.uint8))),
    # An integer or complex output for float operands: truncated (or cast) silently.
    (ValueError, "preferred_element_type must be a floating dtype for float32 operands",
     lambda: tokamax.ragged_dot(jnp.ones((8, 4)), jnp.ones((2, 4, 4)),
                                jnp.array([4, 4], jnp.int32), preferred_element_type=jnp.int8)),
    (ValueError, "got complex64", lambda: tokamax.ragged_dot(
        jnp.ones((8, 4)), jnp.ones((2, 4, 4)), jnp.array([4, 4], jnp.int32),
        preferred_element_type=jnp.complex64)),
    # Either operand float decides: an int8 lhs times a bf16 rhs into int32 truncated the
    # rhs's fractions (0.5 -> 0), silently.
    (ValueError, "preferred_element_type must be a floating dtype for bfloat16 operands",
     lambda: tokamax.ragged_dot(jnp.ones((8, 4), jnp.int8), jnp.full((2, 4, 4), 0.5, jnp.bfloat16),
                                jnp.array([4, 4], jnp.int32), preferred_element_type=jnp.int32)),
    # Integer operands into a narrower (or bool) output: a TypeError deep in jax.lax.
    (ValueError, "preferred_element_type int16 cannot hold the products of lhs int32",
     lambda: tokamax.ragged_dot(jnp.ones((8, 4), jnp.int32), jnp.ones((2, 4, 4), jnp.int32),
                                jnp.array([4, 4], jnp.int32), preferred_element_type=jnp.int16)),
    # uint8 times int8 gave an int8 result: 200 * -1 * 4 read as -32, silently.
    (ValueError, "integer operands of mixed signedness, lhs uint8 and rhs int8",
     lambda: tokamax.ragged_dot(jnp.full((8, 4), 200, jnp.uint8), -jnp.ones((2, 4, 4), jnp.int8),
                                jnp.array([4, 4], jnp.int32))),
    # A path (or a typo) where StableHLO text was meant: an empty result, silently.
    (ValueError, "must be StableHLO/MLIR or HLO text",
     lambda: tokamax.autotune("model.mlir", progress=False)),
]


@pytest.mark.parametrize("error,match,call", BAD,
                         ids=[f"{i}-{m.split()[0]}" for i, (_, m, _) in enumerate(BAD)])
def test_bad_input_names_the_argument(error, match, call):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8])
def test_narrow_labels_past_their_dtype_range_are_not_nan(dtype):
    """V = 300 wrapped in int8/uint8 labels (`labels >= 300` compared with 44): every
    valid token's loss and gradient read as a label past V, NaN."""
    x, w = jnp.ones((4, 8)), jnp.ones((8, 300)) * jnp.arange(300) / 300
    labels = jnp.array([1, 2, 100, 0], dtype)

    def loss(x, w, labels, implementation):
        return tokamax.linear_softmax_cross_entropy_loss(x, labels, w, reduction="mean",
                                                         implementation=implementation)

    expected = loss(x, w, labels.astype(jnp.int32), "xla")
    for implementation in ("xla", "xla_chunked"):
        np.testing.assert_allclose(loss(x, w, labels, implementation), expected, rtol=1e-6)
        grads = jax.grad(loss, argnums=(0, 1))(x, w, labels, implementation)
        assert all(bool(jnp.isfinite(g).all()) for g in grads)


def test_vmapped_ragged_dot_with_narrow_group_sizes():
    """`jax.vmap` folds the batch into the groups (b * m rows): int8 sizes that count one
    example's 100 rows wrapped over the 200 folded ones, misplacing rows silently."""
    lhs = jax.random.normal(jax.random.key(0), (2, 100, 4))
    rhs = jax.random.normal(jax.random.key(1), (2, 4, 4))
    sizes = jnp.array([60, 40], jnp.int8)
    out = jax.vmap(lambda x: tokamax.ragged_dot(x, rhs, sizes))(lhs)
    expected = jnp.stack([tokamax.ragged_dot(x, rhs, sizes.astype(jnp.int32)) for x in lhs])
    np.testing.assert_allclose(out, expected, rtol=1e-6)


@pytest.mark.parametrize("grouped_glu", [False, True])
def test_vmapped_group_sizes_past_an_entrys_rows_leave_the_others_alone(grouped_glu):
    """Under `jax.vmap` the sizes are traced, so `bind` cannot reject an entry summing past
    its rows; folded into one ragged dot, its excess shifted the next entry's groups and
    silently changed a valid entry's output (and gradient). Each entry now gets what the
    unbatched call gives (rows past its rows belong to no group, as in
    `jax.lax.ragged_dot`)."""
    keys = jax.random.split(jax.random.key(3), 4)
    lhs = jax.random.normal(keys[0], (3, 6, 4))
    sizes = jnp.array([[4, 4], [1, 2], [-2, 3]], jnp.int32)  # 8 > 6 rows; valid; negative
    cotangent = jax.random.normal(keys[1], (3, 6, 5))
    if grouped_glu:
        weights = jax.random.normal(keys[2], (2, 4, 2, 5))

        def call(x, g, dot):
            gate, up = dot(x, weights[:, :, 0], g), dot(x, weights[:, :, 1], g)
            return jax.nn.swish(gate) * up

        def ours(x, g):
            return tokamax.gated_linear_unit(x, weights, group_sizes=g, activation=jax.nn.swish,
                                             implementation="xla")
    else:
        weights = jax.random.normal(keys[2], (2, 4, 5))

        def call(x, g, dot):
            return dot(x, weights, g)

        def ours(x, g):
            return tokamax.ragged_dot(x, weights, g, implementation="xla")

    def dot(x, w, g):
        return jax.lax.ragged_dot(x, w, g, precision="highest")

    entries = list(zip(lhs, sizes, cotangent, strict=True))
    expected = jnp.stack([call(x, g, dot) for x, g, _ in entries])
    np.testing.assert_allclose(jax.vmap(ours)(lhs, sizes), expected, rtol=1e-5, atol=1e-5)
    grads = jax.grad(lambda x: jnp.sum(jax.vmap(ours)(x, sizes) * cotangent))(lhs)
    expected = jnp.stack([jax.grad(lambda x, g=g, ct=ct: jnp.sum(call(x, g, dot) * ct))(x)
                          for x, g, ct in entries])
    np.testing.assert_allclose(grads, expected, rtol=1e-5, atol=1e-5)


def test_mosaic_gpu_key_lengths_of_a_narrow_dtype_are_not_cut():
    """The Mosaic GPU attention clipped int8 key lengths to the key length in int8: 300
    wrapped to 44, so a length of 100 became 44 (keys silently dropped)."""
    from tokamax_kernels.attention import _mosaic_gpu_common as common

    for dtype in (jnp.int8, jnp.uint8, jnp.int32):
        lengths = common.kernel_lengths(jnp.array([100, 5, 0], dtype), 300)
        assert lengths.dtype == jnp.int32 and lengths.tolist() == [100, 5, 0]
    assert common.kernel_lengths(jnp.array([400, -3]), 300).tolist() == [300, 0]


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", [jnp.int4, jnp.uint4, jnp.int2, jnp.int8, jnp.uint16])
@pytest.mark.parametrize("make", [jnp.array, np.array], ids=["jax", "numpy"])
def test_attention_seq_lengths_of_any_integer_dtype(dtype, make):
    """int4 (and other sub-byte) lengths failed deep inside with a `TypePromotionError`
    ("1-bit, 2-bit and 4-bit integers do not support implicit promotion") naming no
    argument: they are taken as int32, which holds each of their values unchanged."""
    q_len, kv_len = ([1, 0], [1, 1]) if dtype == jnp.int2 else ([5, 7], [6, 3])

    def attention(q_lengths, kv_lengths):
        return tokamax.dot_product_attention(
            Q, KV, KV, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            implementation="xla")

    expected = attention(jnp.array(q_len, jnp.int32), jnp.array(kv_len, jnp.int32))
    lengths = make(q_len, dtype=dtype), make(kv_len, dtype=dtype)
    np.testing.assert_array_equal(attention(*lengths), expected)
    np.testing.assert_allclose(jax.jit(attention)(*lengths), expected, rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda q: jnp.sum(tokamax.dot_product_attention(
        q, KV, KV, query_seq_lengths=lengths[0], key_value_seq_lengths=lengths[1],
        implementation="xla")))(Q)
    assert grad.shape == Q.shape and bool(jnp.all(jnp.isfinite(grad)))
    if jnp.issubdtype(dtype, jnp.signedinteger):  # still checked once cast
        with pytest.raises(ValueError, match="query_seq_lengths must be >= 0"):
            attention(make([-1, 1], dtype=dtype), None)
    with pytest.raises(ValueError, match="key_value_seq_lengths must be an integer array"):
        attention(None, make([1, 1], dtype=bool))


def test_what_stays_accepted():
    """The checks above leave valid calls alone: traced lengths (not checkable), lengths
    past the sequence (`jax.nn`: attend to all), HLO text with no op, an empty length
    vector of an empty batch."""
    jax.jit(lambda n: tokamax.dot_product_attention(Q, KV, KV, key_value_seq_lengths=n))(
        jnp.array([-1, 40]))
    tokamax.dot_product_attention(Q, KV, KV, query_seq_lengths=jnp.array([40, 0]))
    tokamax.dot_product_attention(Q[:0], KV[:0], KV[:0],
                                  key_value_seq_lengths=jnp.zeros(0, jnp.int32))
    assert discovery.get_bound_args("HloModule m\n") == []
    tokamax.linear_softmax_cross_entropy_loss(X, LABELS, LCE_W, reduction=np.str_("mean"))
    tokamax.ragged_dot(jnp.ones((127, 4)), jnp.ones((2, 4, 4)), jnp.array([100, 27], jnp.int8))


# --- the library layer (autotuning results, export, benchmarking, the command line) ------

def _untraceable(*args):
    raise AssertionError("traced before its arguments were checked")


def _result_json(edit):
    """A one-entry `AutotuningResult` document (an `xla_chunked` attention call), edited."""
    ba = keys.canonical(tokamax.XlaChunkedDotProductAttention().bind(_sds(Q), _sds(KV), _sds(KV)))
    config = tokamax.XlaChunkedDotProductAttention.config_cls(chunk_q=8, chunk_k=8)
    entry = Entry(ba, {config: Measurement((1.0,))}, keys.provenance(ba.op))
    document = json.loads(tokamax.AutotuningResult("cpu", [entry]).dumps())
    edit(document["entries"][0]["configs"][0])
    return json.dumps(document)


# A config its class rejects (ValueError from its checks), a `null` config (AttributeError
# in the kernel when applied), times that are a string (read digit by digit, silently).
BAD_RESULT_CONFIGS = [
    (lambda c: c["config"].update(chunk_q=0), r"entry 0: config .* was rejected: "
                                              r"XlaChunkedConfig: chunk_q must be a positive"),
    (lambda c: c.update(config=None), "entry 0: XlaChunkedConfig must be a JSON object"),
    (lambda c: c.update(evaluation_times_ms="12"),
     "entry 0: 'evaluation_times_ms' must be a list of numbers, got '12'"),
]


@pytest.mark.parametrize("edit,match", BAD_RESULT_CONFIGS)
def test_a_result_with_a_bad_config_is_a_spec_error(edit, match):
    with pytest.raises(SpecError, match=match):
        tokamax.AutotuningResult.loads(_result_json(edit), strict=True)


def test_a_user_cache_with_a_bad_config_is_reported_and_skipped(tmp_path, monkeypatch):
    """The cache reader skips a corrupt file (`SpecError`): a config its class rejected
    raised a bare `ValueError`, which crashed every op call, of any op."""
    monkeypatch.setenv(cache_lib.ENV_CACHE_DIR, str(tmp_path))
    cache_lib._USER.invalidate()
    path = cache_lib.cache_file(tokamax.core.current_target().device_kind)
    path.write_text(_result_json(BAD_RESULT_CONFIGS[0][0]))
    with pytest.warns(UserWarning, match="skipping an entry .*file .*entry 0: .*was rejected"):
        tokamax.layer_norm(X, None, None)
    cache_lib._USER.invalidate()


LIBRARY_BAD = [
    # `f`'s first argument taken for the path: "loss() missing 1 required positional
    # argument", from tracing `f` without it.
    (TypeError, "bound_args_to_json: path must be None, a path or a writable file, got "
                "ArrayImpl; f's arguments follow it",
     lambda tmp: discovery.bound_args_to_json(_untraceable, X)),
    # An unwritable path failed only after `f` was traced, in pathlib.
    (FileNotFoundError, "bound_args_to_json: cannot write path .* does not exist",
     lambda tmp: discovery.bound_args_to_json(_untraceable, tmp / "no" / "calls.json", X)),
    # A platform's name read as a cuda device kind: the artifact was built, for a cuda
    # device named "cpu", with heuristic configs.
    (ValueError, "export: device_kind must name a device model .* got the platform 'cpu'",
     lambda tmp: tokamax.export(_untraceable, X, device_kind="cpu")),
    (ValueError, "got the platform 'gpu'",
     lambda tmp: tokamax.export(_untraceable, X, device_kind=["gpu"])),
    # An empty device kind was taken for none (while "," was an error).
    (ValueError, "device_kind must name a device kind",
     lambda tmp: tokamax.export(_untraceable, X, device_kind="")),
    # A string flag read as true: the checks ran for `check="no"`.
    (TypeError, "load_artifact: check must be True or False, got 'no'",
     lambda tmp: tokamax.load_artifact(tmp, check="no")),
    # `standardize_function(..., seed=None)` keeps inputs abstract: "Argument of type
    # ShapeDtypeStruct is not a valid JAX type" from inside the executable's call.
    (ValueError, r"benchmark: args\[0\] is a jax.ShapeDtypeStruct; .*random_initialize",
     lambda tmp: benchmarking.compile_benchmark(*benchmarking.standardize_function(
         jnp.sum, _sds(X), seed=None))([_sds(X)], method="wallclock")),
]


@pytest.mark.parametrize("error,match,call", LIBRARY_BAD,
                         ids=[m.split(":")[0].split()[0] + f"-{i}"
                              for i, (_, m, _) in enumerate(LIBRARY_BAD)])
def test_library_bad_input_names_the_argument(tmp_path, error, match, call):
    with pytest.raises(error, match=match):
        call(tmp_path)


@pytest.mark.parametrize("jit_kwargs", [{"static_argnums": 1}, {"static_argnums": -1},
                                        {"static_argnames": "mode"}])
def test_a_static_str_argument_given_by_position(jit_kwargs):
    """Export reads str arguments as array specs ('bf16[8,32]'): a static str failed with
    "'sum' is not an array spec". And `optimize` gave `jax.jit` `static_argnums=()` beside
    `static_argnames`, so jit did not find the position the name has: the call failed in
    JAX ("Error interpreting argument ... as an abstract array"), as `jax.jit` does not."""

    def f(x, mode):
        return getattr(tokamax.layer_norm(x, None, None), mode)()

    optimized = tokamax.optimize(f, **jit_kwargs)
    assert float(optimized(X, "sum")) == float(jax.jit(f, **jit_kwargs)(X, "sum"))
    assert optimized.export(X, "sum").manifest["in_specs"] == ["f32[8,32]"]


def test_cli_checks_the_library_cache_directory_before_tuning(tmp_path, monkeypatch):
    """`--write-library-cache` under a file failed after tuning, the result lost (unless
    -o was given); `json:loads` fails when traced, so the check comes first."""
    monkeypatch.delenv("TOKAMAX_PASS_TRACEBACK", raising=False)
    (tmp_path / "file").write_text("x")
    argv = ["autotune", "json:loads", "--args", "f32[8]", "--write-library-cache",
            str(tmp_path / "file" / "lib")]
    with pytest.raises(SystemExit, match="NotADirectoryError: "
                                         "--write-library-cache .* is a file"):
        main(argv)


def test_optimize_warns_when_no_result_is_for_the_device_compiled_for():
    """A result tuned on another device kind was silently unused by `optimize`."""
    def f(x):
        return tokamax.layer_norm(x, None, None)

    elsewhere = tokamax.AutotuningResult("NVIDIA H200", [])
    with pytest.warns(UserWarning, match=r"results= are for \['NVIDIA H200'\].*none of them"):
        tokamax.optimize(f, results=elsewhere)(X)
    here = tokamax.AutotuningResult(tokamax.core.current_target().device_kind, [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokamax.optimize(f, results=[elsewhere, here])(X)
        tokamax.optimize(f, results=elsewhere).export(X, device_kind="NVIDIA H200")


def test_ragged_dot_mixed_signedness_with_a_wide_output_is_exact():
    """The fix the mixed-signedness error names (a `preferred_element_type` both operands
    fit in) gives the exact products."""
    lhs, rhs = jnp.full((8, 4), 200, jnp.uint8), -jnp.ones((2, 4, 4), jnp.int8)
    out = tokamax.ragged_dot(lhs, rhs, jnp.array([4, 4], jnp.int32),
                             preferred_element_type=jnp.int16)
    assert out.dtype == jnp.int16
    np.testing.assert_array_equal(out, np.full((8, 4), -800))
