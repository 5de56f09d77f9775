"""`softmax_row_term`, the flash backward's `delta = sum_d out * dout`: exact enough
against a float64 sum on random inputs, at head dims that are and are not powers of two,
with the lse cotangent subtracted; and summed by elementwise adds in a fixed order, with
no reduction or dot that XLA could tile differently from one compile to the next."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_normal
from tokamax_kernels.attention._softmax_row_term import softmax_row_term


@pytest.mark.parametrize("head_dim", [1, 64, 80, 128, 256])
def test_matches_a_float64_sum(head_dim):
    out, dout = (random_normal(i, (2, 40, 3, head_dim), jnp.bfloat16) for i in (5, 6))
    dlse = random_normal(7, (2, 3, 40), jnp.float32)
    want = np.einsum("bqhd,bqhd->bhq", np.asarray(out, np.float64),
                     np.asarray(dout, np.float64))
    got = softmax_row_term(out, dout)
    assert got.shape == (2, 3, 40) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(head_dim))
    np.testing.assert_allclose(softmax_row_term(out, dout, dlse), want - np.asarray(dlse),
                               rtol=1e-5, atol=1e-5 * np.sqrt(head_dim))


def test_sums_without_a_reduction_or_a_dot():
    spec = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
    hlo = jax.jit(softmax_row_term).lower(spec, spec).as_text()
    assert "reduce" not in hlo and "dot_general" not in hlo
