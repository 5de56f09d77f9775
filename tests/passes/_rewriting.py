"""Helpers shared by the tests of `optimize`'s plain-JAX patterns."""

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from conftest import H200, assert_close
from tokamax_pass import core

HIGHEST = jax.lax.Precision.HIGHEST
# The outcome `plan()` lists for a match kept on CPU (the `rewritten` fixture).
REWRITTEN = "rewritten: cpu xla"


def weighted(f, cotangent):
    """A scalar loss of `f`'s output: its sum weighted by a random cotangent."""
    return lambda *args: (f(*args).astype(jnp.float32) * cotangent).sum()


def outcomes(optimized, *args):
    return [m.outcome for m in optimized.plan(*args).matches]


def attention_arguments(optimized, *args):
    """The `is_causal`, `local_window_size` and whether a mask array is passed, of each
    attention call the optimized program plans (forward and gradient alike)."""
    found = set()
    for row in optimized.plan(*args):
        arguments = row.bound["arguments"]
        window = arguments["local_window_size"]
        found.add((arguments["is_causal"], None if window is None else tuple(window),
                   arguments["mask"] is not None))
    return found


def h200_plan(f, *args, **options):
    with core.targeting(H200):
        return tokamax.optimize(f, **options).plan(*args)


def op_names(optimized, *args):
    """The ops the optimized program runs, read back from its StableHLO."""
    text = optimized.lower(*args).as_text()
    return [o.op for o in tokamax.inspect(text).ops]


def assert_gradients_match_jit(f, optimized, cotangent, argnums, args, reference_args=None,
                               dtype=None):
    """`optimized`'s loss (`weighted` by `cotangent`) and its gradients in `argnums` at
    `args` match `jax.jit(f)`'s at `reference_args` (the float32 inputs of a bfloat16
    run; default `args`) within `dtype`'s tolerance."""
    loss = jax.value_and_grad(weighted(f, cotangent), argnums=argnums)
    expected = jax.jit(loss)(*(args if reference_args is None else reference_args))
    value, grads = jax.value_and_grad(weighted(optimized, cotangent), argnums=argnums)(*args)
    assert_close(value, expected[0], dtype)
    for actual, wanted in zip(grads, expected[1], strict=True):
        assert_close(actual, wanted, dtype)
