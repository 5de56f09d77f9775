"""`attention_delta`, the flash backward's `delta = sum_d out * dout`: exact enough
against a float64 sum on random inputs, at head dims that are and are not powers of two
and sequences that do and do not fill the Triton kernel's last block, with the lse
cotangent subtracted; summed without a reduction or dot that XLA could tile differently
from one compile to the next: by the Triton kernel on CUDA, a chain of adds elsewhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import H200, random_normal
from tokamax_kernels.attention._delta import attention_delta, delta_by_triton
from tokamax_pass import core


def _float64_delta(out, dout):
    return np.einsum("bqhd,bqhd->bhq", np.asarray(out, np.float64),
                     np.asarray(dout, np.float64))


@pytest.mark.parametrize("head_dim", [1, 64, 80, 128, 256])
def test_matches_a_float64_sum(head_dim):
    out, dout = (random_normal(i, (2, 40, 3, head_dim), jnp.bfloat16) for i in (5, 6))
    dlse = random_normal(7, (2, 3, 40), jnp.float32)
    want = _float64_delta(out, dout)
    got = attention_delta(out, dout)
    assert got.shape == (2, 3, 40) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(head_dim))
    np.testing.assert_allclose(attention_delta(out, dout, dlse), want - np.asarray(dlse),
                               rtol=1e-5, atol=1e-5 * np.sqrt(head_dim))


@pytest.mark.parametrize("shape", [(2, 300, 3, 80), (3, 64, 2, 256), (2, 37, 4, 64)])
def test_triton_kernel_matches_a_float64_sum(shape):
    """Interpreted: every head and row, a head dim padded to 128 and a partial block."""
    out, dout = (random_normal(i, shape, jnp.bfloat16) for i in (8, 9))
    got = jax.jit(lambda o, d: delta_by_triton(o, d, interpret=True))(out, dout)
    np.testing.assert_allclose(got, _float64_delta(out, dout), rtol=1e-5,
                               atol=1e-5 * np.sqrt(shape[-1]))


def test_sums_without_a_reduction_or_a_dot():
    spec = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
    hlo = jax.jit(attention_delta).lower(spec, spec).as_text()
    assert "reduce" not in hlo and "dot_general" not in hlo
    with core.targeting(H200):
        cuda = jax.export.export(jax.jit(attention_delta), platforms=["cuda"],
                                 disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(spec, spec)
    text = cuda.mlir_module()
    assert "__gpu$xla.gpu.triton" in text and "attention_delta" in text
    assert "stablehlo.reduce" not in text and "dot_general" not in text
