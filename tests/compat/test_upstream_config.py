"""`tokamax_pass.config`: upstream Tokamax's options (`autotuning_cache_miss_fallback`,
`cross_compile`, `ignore_autotuning_cache`), scoped with `with`, validated, read from the
program's `--tokamax_*` arguments only, and acting on config resolution."""

from __future__ import annotations

import sys
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from compat._upstream import random_arrays
from tokamax_pass.core import options

fallback = tokamax.config.autotuning_cache_miss_fallback


def test_option_scope_nests_and_restores():
    assert fallback.value == "heuristics"
    with fallback("autotune"):
        assert fallback.value == "autotune"
        with fallback("error"):
            assert fallback.value == "error"
        assert fallback.value == "autotune"
    assert fallback.value == "heuristics"


def test_option_validation():
    with pytest.raises(ValueError, match="Invalid value"), fallback("sometimes"):
        pass
    with pytest.raises(ValueError, match="Invalid value"), tokamax.config.cross_compile("maybe"):
        pass
    with tokamax.config.cross_compile("true"):
        assert tokamax.config.cross_compile.value is True


# Upstream's argv cases: which arguments of a host program's command line are options.
ARGV_CASES = {
    "pytest_args": (["-s", "-v", "-x", "tests/foo_test.py"], {}),
    "vllm_args": (["serve", "model", "-tp", "8", "-O3"], {}),
    "value_in_same_arg": (["-v", "-x", "--tokamax_cross_compile=true"],
                          {"cross_compile": True}),
    "value_in_next_arg": (["-x", "--tokamax_autotuning_cache_miss_fallback", "error", "foo.py"],
                          {"autotuning_cache_miss_fallback": "error"}),
    "consecutive_bool_options": (
        ["--tokamax_cross_compile", "--tokamax_ignore_autotuning_cache", "-v"],
        {"cross_compile": True, "ignore_autotuning_cache": True}),
    "negated_bool_option": (["-v", "-x", "--notokamax_cross_compile"], {"cross_compile": False}),
}


@pytest.mark.parametrize("case", sorted(ARGV_CASES))
def test_options_from_the_command_line(case):
    args, expected = ARGV_CASES[case]
    with mock.patch.object(sys, "argv", ["prog", *args]):
        for option in options.OPTIONS:
            assert option.value == expected.get(option.name, option.default), option.name
            with option(option.default):  # a scope wins over the command line
                assert option.value == option.default


def _chunked_attention(q):
    return tokamax.dot_product_attention(q, q, q, implementation="xla_chunked")


def test_cache_miss_fallback_and_ignoring_the_cache():
    """`'error'` raises where no cache answers a configurable call; once measured into the
    user cache the call runs, unless the caches are ignored."""
    (q,) = random_arrays(0, ((2, 32, 2, 16), jnp.float32))
    expected = tokamax.dot_product_attention(q, q, q, implementation="xla")
    with fallback("error"), pytest.raises(ValueError, match="no config found"):
        _chunked_attention(q)
    with fallback("autotune"):
        assert jnp.allclose(jax.jit(_chunked_attention)(q), expected, atol=1e-5)
    with fallback("error"):
        assert jnp.allclose(_chunked_attention(q), expected, atol=1e-5)
        with tokamax.config.ignore_autotuning_cache(True), pytest.raises(
                ValueError, match="no config found"):
            _chunked_attention(q)
