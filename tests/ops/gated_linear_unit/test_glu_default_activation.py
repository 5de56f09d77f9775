"""`gated_linear_unit(activation=None)` is the bilinear GLU, `(x @ w_gate) * (x @ w_up)`, as
in upstream Tokamax: no activation, in every implementation, forward and gradients, against
a float32 HIGHEST reference with random inputs and cotangents."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from tokamax_kernels.gated_linear_unit import (
    PallasMosaicTpuGatedLinearUnit,
    PallasTritonGatedLinearUnit,
    PallasTritonGatedLinearUnitVjp,
    pallas_mosaic_tpu,
    pallas_triton,
)

K, N = 128, 128
SIZES = (5, 0, 9, 7)  # grouped calls: 21 of 24 rows, an empty group


def _bilinear(x, w_gate, w_up):
    gate = jnp.matmul(x, w_gate, precision="highest")
    return gate * jnp.matmul(x, w_up, precision="highest")


def _dense_reference(x, weights):
    return _bilinear(x, weights[:, 0], weights[:, 1])


def _grouped_reference(x, weights):
    rows, start = [], 0
    for g, size in enumerate(SIZES):
        rows.append(_bilinear(x[start:start + size], weights[g, :, 0], weights[g, :, 1]))
        start += size
    rows.append(jnp.zeros((x.shape[0] - start, N), jnp.float32))
    return jnp.concatenate(rows)


_TRITON = PallasTritonGatedLinearUnit(
    interpret=True, config=pallas_triton.Config(block_m=16, block_n=32, block_k=32,
                                                num_warps=4, num_stages=2),
    vjp=PallasTritonGatedLinearUnitVjp(
        interpret=True, config=pallas_triton.Config(block_m=16, block_n=32, block_k=32,
                                                    num_warps=4, num_stages=2)))
_MOSAIC_TPU = PallasMosaicTpuGatedLinearUnit(
    interpret=True, config=pallas_mosaic_tpu.Config(block_m=16, block_n=128, block_k=128))


@pytest.mark.parametrize("implementation, grouped", [
    ("xla", False), ("xla", True), (_TRITON, False), (_MOSAIC_TPU, False),
], ids=["xla", "xla-grouped", "triton", "mosaic_tpu"])
def test_none_is_the_bilinear_glu(implementation, grouped):
    x = random_normal(0, (sum(SIZES) + 3, K) if grouped else (2, 11, K))
    lead = (len(SIZES),) if grouped else ()
    weights = random_normal(1, (*lead, K, 2, N)) / np.sqrt(K)
    group_sizes = jnp.asarray(SIZES, jnp.int32) if grouped else None
    reference = _grouped_reference if grouped else _dense_reference
    cotangent = random_normal(2, (*x.shape[:-1], N))

    def glu(x, weights):
        return tokamax.gated_linear_unit(x, weights, group_sizes=group_sizes,
                                         precision="highest", implementation=implementation)

    assert_close(jax.jit(glu)(x, weights), reference(x, weights))
    got = jax.jit(jax.grad(lambda x, w: jnp.sum(glu(x, w) * cotangent), argnums=(0, 1)))(
        x, weights)
    want = jax.grad(lambda x, w: jnp.sum(reference(x, w) * cotangent), argnums=(0, 1))(
        x, weights)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


def test_none_differs_from_swish():
    """The old default (swish) is one argument away, and not what `None` computes."""
    x = random_normal(0, (2, 3, K))
    weights = random_normal(1, (K, 2, N)) / np.sqrt(K)
    with jax.default_matmul_precision("highest"):
        bilinear = tokamax.gated_linear_unit(x, weights, implementation="xla")
        swish = tokamax.gated_linear_unit(x, weights, activation=jax.nn.swish,
                                          implementation="xla")
        gate, up = x @ weights[:, 0], x @ weights[:, 1]
    assert_close(swish, jax.nn.swish(gate) * up)
    assert float(jnp.max(jnp.abs(bilinear - swish))) > 0.1
