"""PallasMosaicTpuLinearSoftmaxCrossEntropyLoss and its VJP on CPU beyond the base suite
(`test_linear_softmax_cross_entropy_suite.py`, which runs its numerics in Pallas interpret
mode): the lse residual contract, the kernels alone in the TPU interpreter,
and the forward and gradient lowered for TPUs (`tpu_custom_call`) by `jax.export`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from conftest import assert_close, measured, random_normal, reference_precision
from test_linear_softmax_cross_entropy import reference
from tokamax_kernels.linear_softmax_cross_entropy_loss import (
    LinearSoftmaxCrossEntropyLoss,
    MosaicTpuLossConfig,
    PallasMosaicTpuLinearSoftmaxCrossEntropyLoss,
    PallasMosaicTpuLinearSoftmaxCrossEntropyLossVjp,
    XlaChunkedLinearSoftmaxCrossEntropyLoss,
    api,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss._mosaic_tpu_kernels import (
    lce_dweights,
    lce_dx,
    lce_forward,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.base import float32_logits
from tokamax_kernels.linear_softmax_cross_entropy_loss.pallas_mosaic_tpu import tiling
from tokamax_pass import core

# 26 tokens in 16-row blocks, H = 200 in 128-deep steps and V = 300 in 128-wide blocks:
# every axis has a partial last block (read past the end: NaN in the interpreter).
B, S, H, V = 2, 13, 200, 300
BLOCKS = MosaicTpuLossConfig(block_tokens=16, block_vocab=128, block_h=128)
lce = api.linear_softmax_cross_entropy_loss


def _op(config: MosaicTpuLossConfig | None = BLOCKS
        ) -> PallasMosaicTpuLinearSoftmaxCrossEntropyLoss:
    return PallasMosaicTpuLinearSoftmaxCrossEntropyLoss(
        interpret=True, config=config,
        vjp=PallasMosaicTpuLinearSoftmaxCrossEntropyLossVjp(interpret=True, config=config))


def _inputs(dtype, seed=0, shape=(B, S)):
    x = random_normal(seed, (*shape, H), dtype)
    weights = (random_normal(seed + 1, (H, V)) / np.sqrt(H) * 2).astype(dtype)
    labels = jax.random.randint(jax.random.key(seed + 2), shape, 0, V)
    ignored = jax.random.bernoulli(jax.random.key(seed + 3), 0.25, shape)
    # The last class, in the partial last vocabulary block, is one token's label.
    labels = jnp.where(ignored, -1, labels).ravel().at[1].set(V - 1).reshape(shape)
    assert 0 < int((labels < 0).sum()) < labels.size  # some tokens ignored, some counted
    return x, labels, weights


@pytest.mark.parametrize("forward", ["xla", "mosaic_tpu"])
def test_pairs_with_the_xla_ops_through_the_lse_residual(forward):
    """The family's residual contract: either forward's `(lse,)` feeds either backward."""
    x, labels, weights = _inputs(jnp.float32, seed=4)
    if forward == "xla":
        op = LinearSoftmaxCrossEntropyLoss(vjp=_op().vjp_op())
    else:
        op = _op().replace(vjp=XlaChunkedLinearSoftmaxCrossEntropyLoss().vjp_op())
    grads = jax.grad(lambda x, w: lce(x, labels, w, implementation=op, precision="highest"),
                     argnums=(0, 1))(x, weights)
    want = jax.grad(lambda x, w: reference(x, labels, w, "sum"), argnums=(0, 1))(x, weights)
    for got, expected in zip(grads, want, strict=True):
        assert_close(got, expected)


def test_kernels_in_the_tpu_interpreter():
    """The three kernels alone under `pltpu.InterpretParams`, which models TPU block
    pipelining: an output block is written back when its index changes (the dx and
    dweights blocks move only in the last vocabulary / token block), unwritten VMEM is NaN."""
    cap = 2.0
    x, labels, weights = _inputs(jnp.float32, seed=3)
    tokens = B * S
    x, labels = x.reshape(tokens, H), labels.reshape(tokens)
    g = random_normal(4, (tokens,))
    with reference_precision():
        logits = float32_logits(x, weights, None, cap)
        lse = jax.nn.logsumexp(logits, axis=-1)
        onehot = jax.nn.one_hot(labels, V)  # all zeros for an ignored (-1) label
        dlogits = (jax.nn.softmax(logits) - onehot) * g[:, None] * (1 - (logits / cap) ** 2)
        want_dx, want_dweights = dlogits @ weights.T, x.T @ dlogits
    tl = tiling(BLOCKS, tokens, H, V, jnp.float32, cap)
    interpret = pltpu.InterpretParams()
    got_lse, picked = lce_forward(x, labels[:, None], weights, tl=tl, interpret=interpret)
    assert_close(got_lse[:, 0], lse)
    counted = np.asarray(labels) >= 0
    want_picked = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[:, None], axis=1)[:, 0]
    assert_close(picked[counted, 0], want_picked[counted])
    operands = (x, labels[:, None], weights, lse[:, None], g[:, None])
    assert_close(lce_dx(*operands, tl=tl, interpret=interpret), want_dx)
    assert_close(lce_dweights(*operands, tl=tl, interpret=interpret), want_dweights)


def test_unsupported_inputs_and_bad_configs():
    x, labels, weights = _inputs(jnp.float32)
    with pytest.raises(NotImplementedError, match="bf16 and f32"):
        _op()(x.astype(jnp.float16), labels, weights.astype(jnp.float16))
    got = lce(x.astype(jnp.float16), labels, weights.astype(jnp.float16),
              implementation=(_op(), "xla"))  # falls back
    assert np.isfinite(float(got))
    too_big = MosaicTpuLossConfig(block_tokens=4096, block_vocab=4096, block_h=4096)
    big = (jax.ShapeDtypeStruct((8192, 4096), jnp.float32),
           jax.ShapeDtypeStruct((8192,), jnp.int32),
           jax.ShapeDtypeStruct((4096, 32768), jnp.float32))
    with core.targeting("TPU v5p", "tpu"), pytest.raises(NotImplementedError, match="VMEM"):
        jax.eval_shape(lambda *a: _op(too_big)(*a), *big)
    with pytest.raises(NotImplementedError, match="tpu"):
        PallasMosaicTpuLinearSoftmaxCrossEntropyLoss()(x, labels, weights)  # CPU, no interpret
    with pytest.raises(ValueError, match="block_tokens must be a positive multiple of 16"):
        MosaicTpuLossConfig(block_tokens=24, block_vocab=128, block_h=128)
    with pytest.raises(ValueError, match="block_h must be a positive multiple of 128"):
        MosaicTpuLossConfig(block_tokens=16, block_vocab=128, block_h=96)


def _bound(tokens: int, hidden: int, vocab: int, dtype=jnp.bfloat16):
    args = (jax.ShapeDtypeStruct((tokens, hidden), dtype),
            jax.ShapeDtypeStruct((tokens,), jnp.int32),
            jax.ShapeDtypeStruct((hidden, vocab), dtype))
    forward = PallasMosaicTpuLinearSoftmaxCrossEntropyLoss.bind(*args)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    vjp = PallasMosaicTpuLinearSoftmaxCrossEntropyLossVjp().bind(
        (args[1],), scalar, scalar, **forward.arguments)
    return forward, vjp


def test_heuristics_follow_the_tpu_generation():
    forward, vjp = _bound(16384, 4096, 128256)
    configs = {}
    for kind in ("TPU v4", "TPU v5p", "TPU v6 lite"):
        with core.targeting(kind, "tpu"):
            configs[kind] = (forward.heuristics_config, vjp.heuristics_config)
            for ba in (forward, vjp):
                assert ba.heuristics_config in ba.autotuning_configs
                assert len(ba.autotuning_configs) > 2
                ba.op.replace(config=ba.heuristics_config).check_supported(ba, None)
    # v6e's VMEM (128 MiB) takes 4x the tile of v4's (16 MiB); the backward's (block, H)
    # accumulators shrink its tiles.
    v4, v6 = configs["TPU v4"][0], configs["TPU v6 lite"][0]
    assert v6.block_tokens * v6.block_vocab >= 4 * v4.block_tokens * v4.block_vocab
    assert all(c.block_h == 512 for pair in configs.values() for c in pair)
    # The small test shape: one block per axis, rounded up to (16, 128) multiples.
    small, _ = _bound(B * S, H, V)
    assert small.heuristics_config == MosaicTpuLossConfig(block_tokens=32, block_vocab=384,
                                                          block_h=256)
    # No tile holds the backward's accumulators at H = 65536 in v4's VMEM: not supported.
    _, huge = _bound(16384, 65536, 32000)
    with core.targeting("TPU v4", "tpu"), pytest.raises(NotImplementedError, match="VMEM"):
        _ = huge.heuristics_config


def _export(implementation, dtype=jnp.bfloat16, kind="TPU v6 lite", vmapped=False):
    def f(x, labels, weights):
        def loss(x, weights):
            def one(x, labels):
                return lce(x, labels, weights, reduction="mean", logits_soft_cap=30.0,
                           implementation=implementation)
            return jax.vmap(one)(x, labels).sum() if vmapped else one(x, labels)
        return jax.value_and_grad(loss, argnums=(0, 1))(x, weights)

    args = (jax.ShapeDtypeStruct((4, 1000, 1024), dtype),
            jax.ShapeDtypeStruct((4, 1000), jnp.int32),
            jax.ShapeDtypeStruct((1024, 32000), dtype))
    with core.targeting(kind, "tpu"):
        return jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_tpu_forward_and_gradients(dtype):
    text = _export("mosaic_tpu", dtype)
    assert text.count("tpu_custom_call") == 3  # forward, dx, dweights
    assert "PallasMosaicTpuLinearSoftmaxCrossEntropyLossVjp" in text
    assert "4000x32000" not in text and "1000x32000" not in text  # never the logits


def test_lowers_for_tpu_under_vmap_and_mosaic_names_the_tpu_kernel():
    text = _export("mosaic", kind="TPU v5p", vmapped=True)
    assert text.count("tpu_custom_call") == 3
    assert "PallasMosaicTpuLinearSoftmaxCrossEntropyLoss" in text


def test_none_runs_the_tpu_kernel_only_where_measured_faster():
    assert "tpu_custom_call" not in _export(None, kind="TPU v5p")
    args = (jax.ShapeDtypeStruct((4, 1000, 1024), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 1000), jnp.int32),
            jax.ShapeDtypeStruct((1024, 32000), jnp.bfloat16))
    faster = measured("TPU v5p", {PallasMosaicTpuLinearSoftmaxCrossEntropyLoss(): 1.0,
                                  XlaChunkedLinearSoftmaxCrossEntropyLoss(): 2.0,
                                  LinearSoftmaxCrossEntropyLoss(): 3.0},
                      *args, reduction="mean", logits_soft_cap=30.0)
    with faster:
        assert "tpu_custom_call" in _export(None, kind="TPU v5p")


def test_no_hidden_axis_is_refused_and_a_sequence_moves_on():
    """H = 0 (every logit 0): the kernels refuse it with a NotImplementedError (no block
    config could be made: a ValueError), so a sequence moves on to `xla`."""
    x, weights = jnp.zeros((B, S, 0)), jnp.zeros((0, V))
    labels = jax.random.randint(jax.random.key(0), (B, S), 0, V)
    with pytest.raises(NotImplementedError, match="H = 0"):
        lce(x, labels, weights, implementation=PallasMosaicTpuLinearSoftmaxCrossEntropyLoss(
            interpret=True))
    loss = lce(x, labels, weights, implementation=[
        PallasMosaicTpuLinearSoftmaxCrossEntropyLoss(interpret=True), "xla"])
    assert_close(loss, B * S * np.log(V))
