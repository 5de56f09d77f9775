"""Helpers shared by the tests of `optimize`'s plain-JAX patterns."""

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from conftest import H200
from tokamax_pass import core

HIGHEST = jax.lax.Precision.HIGHEST
# The outcome `plan()` lists for a match kept on CPU (the `rewritten` fixture).
REWRITTEN = "rewritten: cpu xla"


def weighted(f, cotangent):
    """A scalar loss of `f`'s output: its sum weighted by a random cotangent."""
    return lambda *args: (f(*args).astype(jnp.float32) * cotangent).sum()


def outcomes(optimized, *args):
    return [m.outcome for m in optimized.plan(*args).matches]


def h200_plan(f, *args, **options):
    with core.targeting(H200):
        return tokamax.optimize(f, **options).plan(*args)


def op_names(optimized, *args):
    """The ops the optimized program runs, read back from its StableHLO."""
    text = optimized.lower(*args).as_text()
    return [o.op for o in tokamax.inspect(text).ops]
