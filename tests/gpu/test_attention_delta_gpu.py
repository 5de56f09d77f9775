"""The backward's `delta` on the GPU: the Pallas Triton kernel `attention_delta` runs on
CUDA against a float64 sum (a head dim padded in the kernel, a partial last block, GQA-
and d256-sized heads), and two separate compiles give bitwise equal values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_normal
from tokamax_kernels.attention._delta import attention_delta

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(2, 1000, 4, 80), (2, 4096, 8, 256), (4, 2048, 16, 64)])
def test_kernel_matches_a_float64_sum_and_every_compile(shape):
    out, dout = (random_normal(i, shape, jnp.bfloat16) for i in (3, 4))
    dlse = random_normal(5, (shape[0], shape[2], shape[1]), jnp.float32)
    want = np.einsum("bqhd,bqhd->bhq", np.asarray(out, np.float64),
                     np.asarray(dout, np.float64)) - np.asarray(dlse, np.float64)
    first = np.asarray(jax.jit(attention_delta)(out, dout, dlse))
    np.testing.assert_allclose(first, want, rtol=1e-5, atol=1e-5 * np.sqrt(shape[-1]))
    jax.clear_caches()
    again = np.asarray(jax.jit(attention_delta)(out, dout, dlse))
    np.testing.assert_array_equal(first, again)
