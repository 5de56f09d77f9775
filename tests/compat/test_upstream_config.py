"""`tokamax_pass.config`: upstream Tokamax's options (`autotuning_cache_miss_fallback`,
`cross_compile`, `ignore_autotuning_cache`), scoped with `with`, validated, read from the
program's `--tokamax_*` arguments only or set as absl flags, keys of JAX's jit caches, and
acting on config resolution."""

from __future__ import annotations

import subprocess
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
    with pytest.raises(ValueError, match="Invalid value"):
        fallback("sometimes")  # raised by the call, as upstream, before any `with`
    with pytest.raises(ValueError, match="Invalid value"), tokamax.config.cross_compile("maybe"):
        pass
    with tokamax.config.cross_compile("true"):
        assert tokamax.config.cross_compile.value is True


@pytest.mark.parametrize(("given", "expected"), [(1, True), (0, False), ("T", True),
                                                 ("0", False)])
def test_boolean_options_take_what_absl_boolean_flags_take(given, expected):
    with tokamax.config.ignore_autotuning_cache(given):
        assert tokamax.config.ignore_autotuning_cache.value is expected


@pytest.mark.parametrize("given", [2, "yes", None, 1.0])
def test_boolean_options_refuse_other_values(given):
    with pytest.raises(ValueError, match="Invalid value"), \
            tokamax.config.ignore_autotuning_cache(given):
        pass


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


@pytest.fixture(scope="module")
def options_without_absl():
    """The three options as defined where absl is not installed: read from `sys.argv`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(options, "absl_flags", None)
        return [options.ConfigOption(o.name, o.default, o.help, o.choices)
                for o in options.OPTIONS]


@pytest.mark.parametrize("case", sorted(ARGV_CASES))
def test_options_from_the_command_line(case, options_without_absl):
    args, expected = ARGV_CASES[case]
    with mock.patch.object(sys, "argv", ["prog", *args]):
        for option in options_without_absl:
            assert option.value == expected.get(option.name, option.default), option.name
            assert option.flag.value == option.value
            with option(option.default):  # a scope wins over the command line
                assert option.value == option.default


def test_a_program_without_sys_argv_gets_the_defaults(options_without_absl, monkeypatch):
    """Python embedded in another program may have no `sys.argv`."""
    monkeypatch.delattr(sys, "argv")
    assert [option.value for option in options_without_absl] == [
        option.default for option in options_without_absl]


def test_absl_flags_set_options_and_a_scope_wins():
    """With absl installed, `FLAGS.tokamax_<name> = v` and `flagsaver` set the option for
    the program, and `with option(v):` wins over them."""
    flags = pytest.importorskip("absl.flags")
    from absl.testing import flagsaver

    option = tokamax.config.ignore_autotuning_cache
    assert option.flag.name == "tokamax_ignore_autotuning_cache"
    assert option.flag.default is False
    with flagsaver.flagsaver():
        flags.FLAGS.tokamax_ignore_autotuning_cache = True
        assert option.value is True
        with option(False):
            assert option.value is False
        with flagsaver.flagsaver(tokamax_autotuning_cache_miss_fallback="error"):
            assert fallback.value == "error"
            assert option.value is True
        assert fallback.value == "heuristics"
    assert option.value is False


def test_absl_app_run_parses_the_options(tmp_path):
    """A program run by `absl.app.run` parses `--tokamax_<name>` (not an
    UnrecognizedFlagError); before, the module read them from `sys.argv` itself."""
    pytest.importorskip("absl.flags")
    script = tmp_path / "program.py"
    script.write_text(
        "from absl import app\n"
        "import tokamax_pass as tokamax\n"
        "config = tokamax.config\n"
        "print(config.cross_compile.value, config.autotuning_cache_miss_fallback.value)\n"
        "def main(argv):\n"
        "    print(config.cross_compile.flag.value, config.autotuning_cache_miss_fallback.value,"
        " argv[1:])\n"
        "app.run(main)\n")
    ran = subprocess.run(
        [sys.executable, str(script), "--tokamax_cross_compile",
         "--tokamax_autotuning_cache_miss_fallback", "error", "rest"],
        capture_output=True, text=True, check=False)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.splitlines() == ["True error", "True error ['rest']"]


@pytest.mark.parametrize("option", options.OPTIONS, ids=lambda o: o.name)
def test_a_jitted_function_is_traced_again_under_another_value(option):
    """Options are keys of JAX's jit caches: a jitted function whose trace reads an option
    is traced again when the option's value differs, and reuses the trace when it is
    the same."""
    other = "error" if option.choices else not option.default
    seen = []

    @jax.jit
    def f(x):
        seen.append(option.value)
        return x + 1

    f(1.0)
    with option(other):
        f(1.0)
        f(1.0)
    f(1.0)
    assert seen == [option.default, other]


def test_a_program_wide_value_is_a_jit_key_too():
    """`FLAGS.tokamax_<name> = v` (absl) retraces a jitted function as a scope does."""
    flags = pytest.importorskip("absl.flags")
    from absl.testing import flagsaver

    option = tokamax.config.ignore_autotuning_cache
    seen = []
    f = jax.jit(lambda x: seen.append(option.value) or x + 1)
    f(1.0)
    with flagsaver.flagsaver():
        flags.FLAGS.tokamax_ignore_autotuning_cache = True
        f(1.0)
    f(1.0)
    assert seen == [False, True]


def test_an_optimized_function_is_traced_again_under_another_value():
    """`optimize` reuses no program traced under another option value: under
    `autotuning_cache_miss_fallback('error')` a configurable call with no cache entry
    raises, though the same call ran under `'heuristics'`."""
    seen = []

    def f(q):
        seen.append(fallback.value)
        return _chunked_attention(q)

    optimized = tokamax.optimize(f)
    (q,) = random_arrays(1, ((2, 16, 2, 8), jnp.float32))
    with tokamax.config.ignore_autotuning_cache(True):
        optimized(q)
        with fallback("error"), pytest.raises(ValueError, match="no config found"):
            optimized(q)
    assert seen == ["heuristics", "error"]


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
