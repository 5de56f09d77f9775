"""Bad input to the tuning APIs (`autotune`, `AutotuningResult`, the user cache,
`benchmarking`) found by an audit after `tests/autotuning/test_bad_framework_inputs.py`: each
crashed deep (in `threading`, XLA, `dict`, a file's `write`) or lost results silently before.
"""

from __future__ import annotations

import io
import json

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from tokamax_pass import benchmarking
from tokamax_pass.autotuning import cache as cache_lib
from tokamax_pass.autotuning import keys
from tokamax_pass.autotuning.entry import Entry, Measurement
from tokamax_pass.autotuning.result import AutotuningResult
from tokamax_pass.core.spec import SpecError

X = jnp.ones((8, 32))
Q = jnp.ones((2, 32, 2, 16), jnp.bfloat16)
CHUNKED = tokamax.XlaChunkedDotProductAttention
CONFIG_A = CHUNKED.config_cls(chunk_q=8, chunk_k=8)
CONFIG_B = CHUNKED.config_cls(chunk_q=16, chunk_k=16)


@pytest.fixture(autouse=True)
def _user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cache_lib.ENV_CACHE_DIR, str(tmp_path / "user"))
    cache_lib._USER.invalidate()
    yield
    cache_lib._USER.invalidate()


def _call():
    """The `xla_chunked` attention call at `Q`, as a cache key sees it."""
    return keys.canonical(CHUNKED().bind(Q, Q, Q))


def _document(edit=lambda entry: None, device_kind="cpu"):
    """A one-entry result document (config A timed 1 ms, B 2 ms), its entry edited."""
    ba = _call()
    entry = Entry(ba, {CONFIG_A: Measurement((1.0,)), CONFIG_B: Measurement((2.0,))},
                  keys.provenance(ba.op))
    document = json.loads(AutotuningResult("cpu", [entry]).dumps())
    document["device_kind"] = device_kind
    edit(document["entries"][0])
    return json.dumps(document)


def _times(config_index, times):
    return lambda entry: entry["configs"][config_index].update(evaluation_times_ms=times)


# --- AutotuningResult documents -------------------------------------------------------

@pytest.mark.parametrize("edit,match", [
    # `dict("abc")`: a bare ValueError, which the user cache's reader (it skips a
    # SpecError) let through to every op call.
    (lambda e: e.update(provenance="abc"), "entry 0: 'provenance' must be a JSON object"),
    (lambda e: e.update(provenance=[1, 2]), "entry 0: 'provenance' must be a JSON object"),
    # "string indices must be integers", "'int' object is not subscriptable".
    (lambda e: e.update(configs="ab"), "entry 0: 'configs' must be a list of objects"),
    (lambda e: e.update(configs={"a": 1}), "entry 0: 'configs' must be a list of objects"),
    (lambda e: e.update(configs=[5]), "entry 0: 'configs' must be a list of objects"),
    (lambda e: e["configs"][0].pop("config"), "'configs' must be a list of objects, each "
                                              "with a 'config'"),
    # Config B's NaN or negative time was taken for the fastest, silently.
    (_times(1, [float("nan")]), r"entry 0: 'evaluation_times_ms' must be .* each >= 0"),
    (_times(1, [-1.0]), r"entry 0: 'evaluation_times_ms' must be .* each >= 0"),
])
def test_a_malformed_entry_is_a_spec_error(edit, match):
    with pytest.raises(SpecError, match=match):
        AutotuningResult.loads(_document(edit), strict=True)


def test_well_formed_entries_still_load():
    result = AutotuningResult.loads(_document(lambda e: e.update(provenance=None)))
    assert result.best_config(_call()) == CONFIG_A
    result = AutotuningResult.loads(_document(_times(1, [0, 1e300])))
    assert result.best_config(_call()) == CONFIG_A


def test_a_user_cache_entry_with_a_bad_provenance_is_reported_and_skipped():
    """Every op call reads the user cache: a string provenance crashed them all."""
    path = cache_lib.cache_file("cpu")
    path.parent.mkdir(parents=True)
    path.write_text(_document(lambda e: e.update(provenance="abc")))
    with pytest.warns(UserWarning, match="skipping an entry .*cache file .*entry 0: .*provenance"):
        out = tokamax.dot_product_attention(Q, Q, Q)
    assert out.shape == Q.shape


@pytest.mark.parametrize("kind", ["H200", "nvidia_h200"])
def test_a_misspelled_device_kind_is_an_error(tmp_path, kind):
    """`"H200"` is no device's kind: its result applied nowhere, and `save_to_cache` wrote
    it to `h200.json`, a file no device reads."""
    with pytest.raises(ValueError, match=f"AutotuningResult: device_kind {kind!r} .* did "
                                         f"you mean 'NVIDIA H200'"):
        AutotuningResult(kind)
    with pytest.raises(SpecError, match=f"autotuning result: device_kind {kind!r} .*did you "
                                        f"mean 'NVIDIA H200'"):
        AutotuningResult.loads(_document(device_kind=kind))
    for real in ("NVIDIA H200", "NVIDIA H20", "cpu", None):
        assert AutotuningResult(real).device_kind == real


def test_dump_to_a_binary_file(tmp_path):
    """`load` reads a file opened in binary mode; `dump` to one raised a bare "a bytes-like
    object is required, not 'str'"."""
    result = AutotuningResult.loads(_document())
    buffer = io.BytesIO()
    result.dump(buffer)
    assert AutotuningResult.loads(buffer.getvalue()) == result
    with open(tmp_path / "r.json", "wb") as f:
        result.dump(f)
    with open(tmp_path / "r.json", "rb") as f:
        assert AutotuningResult.load(f) == result
    text = io.StringIO()
    result.dump(text)
    assert text.getvalue() == result.dumps()


# --- the user cache ---------------------------------------------------------------------

def test_clear_takes_a_named_device_kind(tmp_path):
    """`device_kind=""` read as "every kind" and deleted every device kind's file; an int
    failed as "'int' object has no attribute 'lower'"."""
    AutotuningResult.loads(_document()).save_to_cache(tmp_path)
    with pytest.raises(ValueError, match="clear: device_kind must name a device kind"):
        cache_lib.clear(tmp_path, "")
    with pytest.raises(TypeError, match="clear: device_kind must be a str"):
        cache_lib.clear(tmp_path, 5)
    assert (tmp_path / "cpu.json").exists()
    assert cache_lib.clear(tmp_path, "cpu") == [str(tmp_path / "cpu.json")]


def test_write_library_cache_takes_a_result(tmp_path):
    with pytest.raises(TypeError, match="write_library_cache: result must be an "
                                        "AutotuningResult, got int"):
        cache_lib.write_library_cache(5, tmp_path)


# --- autotune ---------------------------------------------------------------------------

def _untraceable(x):
    raise AssertionError("traced before the options were checked")


@pytest.mark.parametrize("timeout", [float("inf"), float("nan")])
def test_autotune_timeout_must_be_finite(timeout):
    """`timeout=inf` overflowed in `threading` ("timestamp out of range for platform
    time_t") after the function was traced."""
    with pytest.raises(ValueError, match="autotune: timeout must be > 0 and finite"):
        tokamax.autotune(_untraceable, X, timeout=timeout)


def _attention(q, scale=None):
    return tokamax.dot_product_attention(q, q, q, scale=scale, implementation="xla_chunked")


@pytest.mark.parametrize("kwargs,match", [
    ({"max_config": 1}, "max_config= is neither an option of autotune nor a parameter of f; "
                        "did you mean max_configs="),
    ({"iteration": 1}, "did you mean iterations="),
    ({"scale": 0.5, "ignore_cach": True}, "did you mean ignore_cache="),
])
def test_autotune_names_a_misspelled_option(kwargs, match):
    """A misspelled option went to `f`: "_attention() got an unexpected keyword argument
    'max_config'", from tracing it."""
    with pytest.raises(TypeError, match=f"autotune: .*{match}"):
        tokamax.autotune(_attention, Q, progress=False, **kwargs)


def test_keywords_of_f_still_reach_it():
    """`f`'s own keywords, even one close to an option, and any keyword `**kwargs` takes."""
    def attention_iteration(q, iteration=0):
        return _attention(q)

    tune = dict(progress=False, max_configs=1, iterations=1)
    assert len(tokamax.autotune(attention_iteration, Q, iteration=2, **tune)) == 1
    assert len(tokamax.autotune(lambda q, **kw: _attention(q), Q, max_config=1, **tune)) == 1
    assert len(tokamax.autotune(_attention, q=Q, scale=0.5, **tune)) == 1


# --- optimize ---------------------------------------------------------------------------

def test_optimize_autotune_names_an_unhashable_static_argument():
    """With `autotune=` the set of tuned signatures raised a bare "unhashable type: 'set'";
    `jax.jit` (`autotune="never"`) raises a `ValueError` naming the static argument."""
    f = lambda q, axes: _attention(q).sum()
    for autotune in ("never", "missing"):
        with pytest.raises(ValueError, match="static arguments|Non-hashable static"):
            tokamax.optimize(f, static_argnums=1, autotune=autotune)(Q, {1, 2})
    with pytest.raises(ValueError, match=r"optimize: an argument is a set \(\{1, 2\}\), "
                                         r"neither an array nor hashable"):
        tokamax.optimize(f, static_argnums=1, autotune="missing")(Q, {1, 2})
    assert tokamax.optimize(f, static_argnums=1, autotune="missing")(Q, (1, 2)).shape == ()


# --- benchmarking -----------------------------------------------------------------------

def _sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("call,error,match", [
    # An int32 argument of the random-input program: "An overflow was encountered while
    # parsing an argument to a jitted computation".
    (lambda: benchmarking.standardize_function(jnp.sum, _sds((2,)), seed=2**31), ValueError,
     r"standardize_function: seed must be an int in \[0, 2147483647\] or None"),
    # jax.ShapeDtypeStruct takes a negative dimension: XLA's "invalid tensor dimension size".
    (lambda: benchmarking.standardize_function(jnp.sum, X, _sds((-1, 3))), ValueError,
     r"array argument 1 is a jax.ShapeDtypeStruct of shape \(-1, 3\); dimensions must be"),
    # "'NoneType' object is not iterable".
    (lambda: benchmarking.compile_benchmark(lambda xs: xs[0], [X])(None), TypeError,
     "benchmark: args must be the list of arrays compile_benchmark compiled for, got "
     "NoneType"),
])
def test_benchmarking_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_the_largest_seed_still_works():
    _, (a,) = benchmarking.standardize_function(jnp.sum, _sds((2,)),
                                                seed=benchmarking.MAX_SEED)
    assert a.shape == (2,)
    _, arrays = benchmarking.standardize_function(jnp.sin, X, mode="vjp",
                                                  seed=benchmarking.MAX_SEED)
    assert arrays
