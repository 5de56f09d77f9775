"""`optimize`'s rewrites keep the values and gradients of random plain-JAX functions.

`_spelling_fuzz.generate` composes, from a seed, a function out of the spellings the pass
matches and near misses of them; each is compared with `jax.jit` of itself, every
rewrite candidate kept (the `rewritten` fixture). CI runs a few fixed seeds; `-m slow`
runs `TOKAMAX_PASS_FUZZ_SEEDS` more (`start:stop`, default `0:300`).
"""

import os

import pytest

from _spelling_fuzz import check, generate

# Seeds whose functions cover each family (attention written out and `jax.nn`'s, norms,
# gated linear units, cross-entropy, ragged dots), rewritten ones and near misses.
CI_SEEDS = [0, 1, 2, 6, 10, 36, 40]


def _slow_seeds() -> range:
    start, stop = os.environ.get("TOKAMAX_PASS_FUZZ_SEEDS", "0:300").split(":")
    return range(int(start), int(stop))


def _assert_rewrite_keeps_values(seed: int) -> None:
    case = generate(seed)
    outcome = check(case, seed)
    assert outcome.mismatch is None, (
        f"seed {seed}: {case.description}: {outcome.mismatch} (rewritten: "
        f"{outcome.rewritten})")


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_rewrites_keep_values_and_gradients(rewritten, seed):
    _assert_rewrite_keeps_values(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", _slow_seeds())
def test_rewrites_keep_values_and_gradients_of_more_seeds(rewritten, seed):
    _assert_rewrite_keeps_values(seed)
