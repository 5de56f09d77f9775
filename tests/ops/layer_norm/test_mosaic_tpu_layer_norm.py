"""PallasMosaicTpuLayerNorm and its VJP on CPU, beyond the base suite
(`test_layer_norm_suite.py`, which runs its numerics in Pallas interpret mode): the kernels
alone in the TPU interpreter, the family's residual contract with the XLA ops, bf16
statistics, what the kernel refuses, its heuristics per TPU generation, and the forward and
gradient lowered for TPUs (`tpu_custom_call`) by `jax.export`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import tokamax_pass
from conftest import assert_close, measured, random_normal, reference_precision
from tokamax_kernels.layer_norm import (
    LayerNorm,
    PallasMosaicTpuLayerNorm,
    PallasMosaicTpuLayerNormVjp,
    api,
)
from tokamax_kernels.layer_norm._mosaic_tpu_common import Config
from tokamax_kernels.layer_norm._mosaic_tpu_kernels import (
    layer_norm_backward,
    layer_norm_forward,
)
from tokamax_pass import core

EPS = 1e-6
# 2 x 19 = 38 rows in 16-row blocks (the last block has 6 rows and reads past the end:
# NaN in the interpreter); 200 features, not a multiple of the 128 lanes.
SHAPE = (2, 19, 200)
BLOCKS = Config(block_rows=16)


def _op(config: Config | None = BLOCKS) -> PallasMosaicTpuLayerNorm:
    return PallasMosaicTpuLayerNorm(
        interpret=True, config=config,
        vjp=PallasMosaicTpuLayerNormVjp(interpret=True, config=config))


def _inputs(dtype, *, scale=True, offset=True, residual=True, shape=SHAPE, seed=0):
    n = shape[-1]
    return dict(
        x=(3 * random_normal(seed, shape) - 1).astype(dtype),
        scale=(1 + 0.5 * random_normal(seed + 1, (n,))).astype(dtype) if scale else None,
        offset=random_normal(seed + 2, (n,), dtype) if offset else None,
        residual=(2 * random_normal(seed + 3, shape) + 0.5).astype(dtype) if residual else None,
    )


def _call(implementation, inputs, subtract_mean, **kwargs):
    return api.FAMILY(implementation, inputs["x"], inputs["scale"], inputs["offset"],
                      epsilon=EPS, subtract_mean=subtract_mean, residual=inputs["residual"],
                      **kwargs)


def _float32(inputs):
    return {k: None if v is None else v.astype(jnp.float32) for k, v in inputs.items()}


def _loss(implementation, subtract_mean, cotangents, inputs):
    """A scalar of every output (y, and s with a residual), each with its own random
    cotangent."""
    out = _call(implementation, inputs, subtract_mean)
    outs = out if isinstance(out, tuple) else (out,)
    return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, cotangents, strict=True))


def test_kernels_in_the_tpu_interpreter():
    """Both kernels alone under `pltpu.InterpretParams`, which models TPU block pipelining
    (an output block is written back when its index changes; unwritten VMEM is NaN)."""
    inputs = _inputs(jnp.float32)
    rows, n = 38, SHAPE[-1]
    x, residual = inputs["x"].reshape(rows, n), inputs["residual"].reshape(rows, n)
    scale, offset = inputs["scale"].reshape(1, n), inputs["offset"].reshape(1, n)
    interpret = pltpu.InterpretParams()
    y, s, mean, rstd = layer_norm_forward(x, residual, scale, offset, epsilon=EPS,
                                          subtract_mean=True, block_rows=16,
                                          vmem_bytes=1 << 20, interpret=interpret)
    with reference_precision():
        (want_y, want_s), (want_mean, want_rstd) = LayerNorm()._fwd(
            x, inputs["scale"], inputs["offset"], axis=1, epsilon=EPS, subtract_mean=True,
            config=None, return_residuals=True, residual=residual)
    for got, want in ((y, want_y), (s, want_s), (mean[:, 0], want_mean),
                      (rstd[:, 0], want_rstd)):
        assert_close(got, want)

    dy, ds = random_normal(20, (rows, n)), random_normal(21, (rows, n))
    dx, dscale, doffset = layer_norm_backward(
        s, dy, mean, rstd, scale, ds, subtract_mean=True, want_dscale=True, want_doffset=True,
        block_rows=16, vmem_bytes=1 << 20, interpret=interpret)

    def forward(s, scale, offset):
        return LayerNorm()._fwd(s, scale, offset, axis=1, epsilon=EPS, subtract_mean=True,
                                config=None, return_residuals=False)[0]

    with reference_precision():
        _, vjp = jax.vjp(forward, want_s, inputs["scale"], inputs["offset"])
        want_dx, want_dscale, want_doffset = vjp(dy)
    assert_close(dx, want_dx + ds)
    assert_close(dscale, want_dscale)
    assert_close(doffset, want_doffset)


@pytest.mark.parametrize("forward", ["xla", "mosaic_tpu"])
def test_pairs_with_the_xla_ops_through_the_mean_rstd_residuals(forward):
    """The family's residual contract: either forward's `(mean, rstd)` feeds either
    backward (the XLA VJP is autodiff of the XLA forward)."""
    inputs = _inputs(jnp.float32, seed=4)
    if forward == "xla":
        op = LayerNorm(vjp=_op().vjp_op())
    else:
        op = _op().replace(vjp=LayerNorm().vjp_op())
    cotangents = [random_normal(30, SHAPE), random_normal(31, SHAPE)]
    grads = jax.grad(functools.partial(_loss, op, True, cotangents))(inputs)
    with reference_precision():
        want = jax.grad(functools.partial(_loss, LayerNorm(), True, cotangents))(inputs)
    for name in inputs:
        assert_close(grads[name], want[name])


def test_bf16_statistics_are_of_the_sum_rounded_as_it_is_returned():
    """With a residual, the norm is of `s = x + residual` as returned (rounded to bf16, as
    plain JAX rounds it): mean and rstd match float32 statistics of that rounded sum to
    float32 accuracy, not only to bf16's, and the gradients match the reference."""
    inputs = _inputs(jnp.bfloat16, seed=8)
    rounded = dict(_float32(inputs), x=(inputs["x"] + inputs["residual"]).astype(jnp.float32),
                   residual=None)
    (y, s), (mean, rstd) = _call(_op(), inputs, True, return_residuals=True)
    with reference_precision():
        want_y, (want_mean, want_rstd) = _call(LayerNorm(), rounded, True,
                                               return_residuals=True)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(rounded["x"]))
    assert_close(y, want_y, jnp.bfloat16)
    assert_close(mean, want_mean, scale_rtol=1e-5)
    assert_close(rstd, want_rstd, scale_rtol=1e-5)

    cotangents = [random_normal(40, SHAPE), random_normal(41, SHAPE)]
    grads = jax.grad(functools.partial(_loss, _op(), True, cotangents))(inputs)
    with reference_precision():
        want = jax.grad(functools.partial(_loss, LayerNorm(), True, cotangents))(
            _float32(inputs))
    for name in inputs:
        assert_close(grads[name], want[name], jnp.bfloat16)


@pytest.mark.parametrize("subtract_mean", [True, False], ids=["ln", "rms"])
def test_a_large_epsilon_is_added_to_the_variance(subtract_mean):
    """`rstd = 1 / sqrt(var + epsilon)`: with epsilon 0.5 against a variance near 1, adding
    it to the standard deviation instead gives another output and gradients."""
    inputs = _inputs(jnp.float32, residual=False, seed=9)
    inputs["x"] = inputs["x"] / 3

    def call(implementation, inputs, **kwargs):
        return api.FAMILY(implementation, inputs["x"], inputs["scale"], inputs["offset"],
                          epsilon=0.5, subtract_mean=subtract_mean, **kwargs)

    def loss(implementation, cotangent, inputs):
        return jnp.sum(call(implementation, inputs) * cotangent)

    y, (_, rstd) = call(_op(), inputs, return_residuals=True)
    cotangent = random_normal(42, SHAPE)
    grads = jax.grad(functools.partial(loss, _op(), cotangent))(inputs)
    with reference_precision():
        want_y, (_, want_rstd) = call(LayerNorm(), inputs, return_residuals=True)
        want_grads = jax.grad(functools.partial(loss, LayerNorm(), cotangent))(inputs)
    assert_close(y, want_y)
    assert_close(rstd, want_rstd)
    for name in ("x", "scale", "offset"):
        assert_close(grads[name], want_grads[name])


def test_unsupported_inputs_and_bad_configs():
    inputs = _inputs(jnp.float32, residual=False)
    x, scale, offset = inputs["x"], inputs["scale"], inputs["offset"]
    with pytest.raises(NotImplementedError, match="last axis only, got axis=1"):
        api.layer_norm(x, None, None, axis=1, implementation=_op())
    with pytest.raises(NotImplementedError, match="bf16 and f32, not x of float16"):
        api.layer_norm(x.astype(jnp.float16), None, None, implementation=_op())
    got = api.layer_norm(x, None, None, axis=1, implementation=(_op(), "xla"))  # falls back
    assert_close(got, api.layer_norm(x, None, None, axis=1, implementation="xla"))
    with pytest.raises(NotImplementedError, match="tpu"):
        PallasMosaicTpuLayerNorm()(x, scale, offset)  # CPU, no interpret
    wide = jax.ShapeDtypeStruct((4096, 32768), jnp.float32)
    with core.targeting("TPU v4", "tpu"), pytest.raises(NotImplementedError, match="VMEM"):
        jax.eval_shape(lambda x: _op(Config(1024))(x, None, None), wide)
    for bad in (24, 0, -16, True, 16.0):
        with pytest.raises(ValueError, match="block_rows must be a positive multiple of 16"):
            Config(block_rows=bad)


def _bound(shape, dtype, residual=False):
    x = jax.ShapeDtypeStruct(shape, dtype)
    vector = jax.ShapeDtypeStruct(shape[-1:], dtype)
    forward = PallasMosaicTpuLayerNorm.bind(x, vector, vector, residual=x if residual else None)
    stats = jax.ShapeDtypeStruct(shape[:-1], jnp.float32)
    out = (x, x) if residual else x
    vjp = PallasMosaicTpuLayerNormVjp().bind((stats, stats), out, out, **forward.arguments)
    return forward, vjp


def test_heuristics_follow_the_tpu_generation():
    forward, vjp = _bound((16384, 4096), jnp.bfloat16)
    blocks = {}
    for kind in ("TPU v4", "TPU v5p", "TPU v5 lite", "TPU v6 lite"):
        with core.targeting(kind, "tpu"):
            blocks[kind] = (forward.heuristics_config.block_rows,
                            vjp.heuristics_config.block_rows)
            for ba in (forward, vjp):
                assert ba.heuristics_config in ba.autotuning_configs
                assert 2 <= len(ba.autotuning_configs) <= 7
                ba.op.replace(config=ba.heuristics_config).check_supported(ba, None)
    # Taller blocks where VMEM is larger (v4 16 MiB, v5p 64, v5e and v6e 128); the
    # backward keeps more rows per block in VMEM, so its blocks are not taller.
    assert blocks["TPU v4"][0] < blocks["TPU v5p"][0] < blocks["TPU v5 lite"][0]
    assert all(fwd >= bwd for fwd, bwd in blocks.values())
    # Fewer rows than the smallest block: one block covering them. The test shape's 38
    # rows: one step of all of them beats three (the smallest config giving it).
    small, _ = _bound((15, 200), jnp.float32)
    assert small.heuristics_config == Config(16) and small.autotuning_configs == {Config(16)}
    test_shape, _ = _bound(SHAPE, jnp.float32)
    assert test_shape.heuristics_config == Config(64)
    assert test_shape.autotuning_configs == {Config(16), Config(32), Config(64)}
    # 16 rows of 32768 float32 features with a residual exceed v4's VMEM budget.
    wide, wide_vjp = _bound((8192, 32768), jnp.float32, residual=True)
    with core.targeting("TPU v6 lite", "tpu"):
        assert wide.heuristics_config.block_rows >= 16
    with core.targeting("TPU v4", "tpu"):
        for ba in (wide, wide_vjp):
            with pytest.raises(NotImplementedError, match="whole rows in VMEM"):
                _ = ba.heuristics_config


def _export(implementation, dtype=jnp.bfloat16, *, gradient=True, kind="TPU v5 lite"):
    def forward(x, scale, offset, residual):
        return api.layer_norm(x, scale, offset, residual=residual, implementation=implementation)

    def f(x, scale, offset, residual):
        if not gradient:
            return forward(x, scale, offset, residual)

        def loss(*args):
            y, s = forward(*args)
            return jnp.sum(y.astype(jnp.float32)) + jnp.sum(s.astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, scale, offset, residual)

    with core.targeting(kind):
        return jax.export.export(jax.jit(f), platforms=["tpu"])(*_tpu_args(dtype)).mlir_module()


def _tpu_args(dtype=jnp.bfloat16):
    rows, vector = jax.ShapeDtypeStruct((4, 1000, 2048), dtype), jax.ShapeDtypeStruct((2048,),
                                                                                     dtype)
    return rows, vector, vector, rows


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_tpu_forward_and_gradients(dtype):
    text = _export("mosaic_tpu", dtype)
    assert text.count("tpu_custom_call") == 2  # forward, backward
    for name in ("tokamax_layer_norm_forward", "tokamax_layer_norm_backward",
                 "PallasMosaicTpuLayerNormVjp"):
        assert name in text


def test_mosaic_names_the_tpu_kernel_and_the_triton_kernel_refuses_a_tpu():
    assert _export("mosaic").count("tpu_custom_call") == 2
    with pytest.raises(NotImplementedError, match=r"\['cuda'\], not on tpu"):
        _export("triton")


def test_none_runs_the_tpu_kernel_only_where_measured_faster():
    assert "tpu_custom_call" not in _export(None)  # nothing measured: the XLA path
    assert "tpu_custom_call" not in _export(None, gradient=False)
    x, scale, offset, residual = _tpu_args()

    def timed(kernel_ms, kind="TPU v5 lite"):
        return measured(kind, {PallasMosaicTpuLayerNorm(): kernel_ms, LayerNorm(): 3.0},
                        x, scale, offset, residual=residual)

    with timed(1.0):
        assert "tpu_custom_call" in _export(None, gradient=False)
    with timed(2.0):  # faster, but not by the kernel margin: XLA fuses a norm in a model
        assert "tpu_custom_call" not in _export(None, gradient=False)
    with timed(1.0, kind="TPU v6 lite"):  # another generation's measurement is no evidence
        assert "tpu_custom_call" not in _export(None, gradient=False)


def test_exported_by_tokamax_pass():
    assert tokamax_pass.PallasMosaicTpuLayerNorm is PallasMosaicTpuLayerNorm
    assert tokamax_pass.PallasMosaicTpuLayerNormVjp is PallasMosaicTpuLayerNormVjp
    assert api.FAMILY.implementations["mosaic_tpu"] is PallasMosaicTpuLayerNorm
