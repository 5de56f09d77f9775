"""PallasMosaicTpuGatedLinearUnit on CPU: the forward in Pallas interpret mode and its
gradients (the family's XLA gradient) against the float32 HIGHEST XLA reference (fused and
pair weights, swish and gelu, bf16 and f32, a row count no row block divides), the kernel
alone in the TPU interpreter, the family's residual contract with another gradient, what
the kernel refuses, its heuristics per TPU generation, the forward lowered for TPUs
(`tpu_custom_call`) by `jax.export`, and `None` running it only where measured faster."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

import tokamax_pass
from conftest import assert_close, measured, random_normal, reference_precision
from tokamax_kernels.gated_linear_unit import (
    GatedLinearUnit,
    PallasMosaicTpuGatedLinearUnit,
    PallasTritonGatedLinearUnitVjp,
    api,
)
from tokamax_kernels.gated_linear_unit._mosaic_tpu_kernel import glu_forward
from tokamax_kernels.gated_linear_unit.pallas_mosaic_tpu import Config
from tokamax_pass import core

# 2 x 19 = 38 rows in 16-row blocks (the last block has 6 rows and reads past the end:
# NaN in the interpreter); K = 256 in two 128-deep steps; N = 384 in three column blocks
# (the up half of fused weights starts three blocks in).
LEAD, K, N = (2, 19), 256, 384
TILES = Config(block_m=16, block_n=128, block_k=128)


def exact_gelu(x):
    return jax.nn.gelu(x, approximate=False)


def _op(config: Config | None = TILES) -> PallasMosaicTpuGatedLinearUnit:
    return PallasMosaicTpuGatedLinearUnit(interpret=True, config=config)


def _inputs(dtype, fused: bool, seed: int = 0):
    x = (2 * random_normal(seed, (*LEAD, K)) + 0.5).astype(dtype)
    w = (random_normal(seed + 1, (K, 2, N)) / 16).astype(dtype)
    return x, w if fused else (w[:, 0], w[:, 1])


def _float32(weights):
    return jax.tree.map(lambda a: a.astype(jnp.float32), weights)


def _loss(implementation, activation, cotangent, x, weights):
    out = api.gated_linear_unit(x, weights, activation=activation,
                                implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * cotangent)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("activation", [jax.nn.swish, jax.nn.gelu], ids=["swish", "gelu"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pair"])
def test_forward_and_gradients_match_reference(fused, activation, dtype):
    x, weights = _inputs(dtype, fused)
    op = _op()  # one op named: it runs or raises, never falls back
    got = op(x, weights, activation=activation)
    with reference_precision():
        want = GatedLinearUnit()(x.astype(jnp.float32), _float32(weights),
                                 activation=activation)
    assert got.dtype == dtype and got.shape == (*LEAD, N)
    assert_close(got, want, dtype)

    cotangent = random_normal(5, (*LEAD, N))
    grads = jax.jit(jax.grad(functools.partial(_loss, op, activation, cotangent),
                             argnums=(0, 1)))(x, weights)
    with reference_precision():
        want_grads = jax.grad(functools.partial(_loss, "xla", activation, cotangent),
                              argnums=(0, 1))(x.astype(jnp.float32), _float32(weights))
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert g.dtype == dtype
        assert_close(g, w, dtype)


def test_heuristics_config_matches_reference():
    """`config=None`: the generation's heuristic tiles (one block of all 38 rows here)."""
    x, weights = _inputs(jnp.float32, True, seed=3)
    with reference_precision():
        want = GatedLinearUnit()(x, weights)
    assert_close(_op(None)(x, weights), want)


def test_kernel_in_the_tpu_interpreter():
    """The kernel alone under `pltpu.InterpretParams`, which models TPU block pipelining
    (an output block is written back when its index changes; unwritten VMEM is NaN)."""
    x, weights = _inputs(jnp.float32, True, seed=7)
    rows = x.reshape(-1, K)
    both = weights.reshape(K, 2 * N)
    got = glu_forward(rows, both, both, up_offset=N, activation=jax.nn.swish, block_m=16,
                      block_n=128, block_k=128, interpret=pltpu.InterpretParams())
    with reference_precision():
        want = GatedLinearUnit()(rows, weights)
    assert_close(got, want)


def test_pairs_with_another_gradient_through_no_residuals():
    """Dense calls keep no residuals: this forward feeds any gradient of the family (the
    Triton one here, in its interpreter) and the XLA forward feeds the XLA gradient."""
    x, weights = _inputs(jnp.float32, False, seed=9)
    op = _op().replace(vjp=PallasTritonGatedLinearUnitVjp(interpret=True))
    cotangent = random_normal(10, (*LEAD, N))
    grads = jax.grad(functools.partial(_loss, op, jax.nn.swish, cotangent),
                     argnums=(0, 1))(x, weights)
    with reference_precision():
        want = jax.grad(functools.partial(_loss, "xla", jax.nn.swish, cotangent),
                        argnums=(0, 1))(x, weights)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        assert_close(g, w)


def test_unsupported_inputs_and_bad_configs():
    x, weights = _inputs(jnp.float32, True)
    rows = x.reshape(-1, K)
    sizes = jnp.array([20, 18], jnp.int32)
    grouped = jnp.stack([weights, weights])
    with pytest.raises(NotImplementedError, match="dense calls only"):
        api.gated_linear_unit(rows, grouped, group_sizes=sizes, implementation=_op())
    got = api.gated_linear_unit(rows, grouped, group_sizes=sizes,
                                implementation=(_op(), "xla"))  # falls back
    assert_close(got, api.gated_linear_unit(rows, grouped, group_sizes=sizes,
                                            implementation="xla"))
    with pytest.raises(NotImplementedError, match="bf16 or f32 x and weights of one dtype"):
        _op()(x.astype(jnp.float16), weights.astype(jnp.float16))
    with pytest.raises(NotImplementedError, match="of one dtype"):
        _op()(x, weights.astype(jnp.bfloat16))
    with pytest.raises(NotImplementedError, match=r"K \(200\) and N \(384\) multiples of 128"):
        _op()(x[..., :200], weights[:200])
    with pytest.raises(NotImplementedError, match=r"cannot lower \[.*'erfc'"):
        _op()(x, weights, activation=exact_gelu)
    with pytest.raises(NotImplementedError, match="jax.vmap"):
        jax.vmap(lambda x: _op()(x, weights))(x)
    with pytest.raises(NotImplementedError, match="tpu"):
        PallasMosaicTpuGatedLinearUnit()(x, weights)  # CPU, no interpret
    with pytest.raises(NotImplementedError, match="block_n must divide N"):
        _op(Config(16, 256, 128))(x, weights)  # 256 does not divide N = 384
    big = (jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
           jax.ShapeDtypeStruct((4096, 2, 4096), jnp.float32))
    with core.targeting("TPU v4", "tpu"), pytest.raises(NotImplementedError, match="VMEM"):
        jax.eval_shape(lambda x, w: _op(Config(512, 512, 512))(x, w), *big)
    with pytest.raises(ValueError, match="block_m must be a positive multiple of 16"):
        Config(24, 128, 128)
    with pytest.raises(ValueError, match="block_n must be a positive multiple of 128"):
        Config(16, 64, 128)
    with pytest.raises(ValueError, match="block_k must be a positive multiple of 128"):
        Config(16, 128, 0)
    with pytest.raises(ValueError, match="block_m must be a positive multiple of 16"):
        Config(True, 128, 128)


def _bound(m, k, n, dtype):
    return PallasMosaicTpuGatedLinearUnit.bind(jax.ShapeDtypeStruct((m, k), dtype),
                                               jax.ShapeDtypeStruct((k, 2, n), dtype))


def test_heuristics_follow_the_tpu_generation():
    configs = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        ba = _bound(16384, 2048, 5632, dtype)  # the Llama MLP
        for kind in ("TPU v4", "TPU v5p", "TPU v5 lite", "TPU v6 lite"):
            with core.targeting(kind, "tpu"):
                configs[dtype, kind] = ba.heuristics_config
                assert ba.heuristics_config in ba.autotuning_configs
                assert 10 <= len(ba.autotuning_configs) <= 27
                ba.op.replace(config=ba.heuristics_config).check_supported(ba, None)
    assert configs[jnp.bfloat16, "TPU v6 lite"] == Config(512, 512, 512)
    # float32 tiles take twice the VMEM: v4's 16 MiB holds narrower ones than v6e's 128.
    assert configs[jnp.float32, "TPU v4"].block_n < configs[jnp.float32, "TPU v6 lite"].block_n
    # Fewer rows than a block: one block of all of them; K = 2304 is not a multiple of
    # 512, so the deepest step that divides it is 256.
    decode = _bound(8, 2304, 9216, jnp.bfloat16)
    with core.targeting("TPU v5 lite", "tpu"):
        assert decode.heuristics_config.block_k == 256
        assert {c.block_m for c in decode.autotuning_configs} == {128}  # one row tiling


def _export(implementation, *, fused=True, dtype=jnp.bfloat16, gradient=True,
            kind="TPU v5 lite"):
    def forward(x, weights):
        return api.gated_linear_unit(x, weights, implementation=implementation)

    def f(x, weights):
        if not gradient:
            return forward(x, weights)
        return jax.value_and_grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)),
                                  argnums=(0, 1))(x, weights)

    with core.targeting(kind):
        return jax.export.export(jax.jit(f), platforms=["tpu"])(
            *_tpu_args(fused, dtype)).mlir_module()


def _tpu_args(fused=True, dtype=jnp.bfloat16):
    x = jax.ShapeDtypeStruct((4, 1000, 2048), dtype)
    if fused:
        return x, jax.ShapeDtypeStruct((2048, 2, 5632), dtype)
    return x, (jax.ShapeDtypeStruct((2048, 5632), dtype),) * 2


@pytest.mark.parametrize("fused, dtype", [(True, jnp.bfloat16), (False, jnp.float32)])
def test_lowers_for_tpu_forward_and_gradients(fused, dtype):
    text = _export("mosaic_tpu", fused=fused, dtype=dtype)
    assert text.count("tpu_custom_call") == 1  # the forward; the gradient is XLA's
    for name in ("tokamax_glu_forward", "PallasMosaicTpuGatedLinearUnit",
                 "GatedLinearUnitVjp"):
        assert name in text


def test_mosaic_names_the_tpu_kernel_and_the_gpu_kernels_refuse_a_tpu():
    assert _export("mosaic", gradient=False).count("tpu_custom_call") == 1
    with pytest.raises(NotImplementedError, match=r"\['cuda'\], not on tpu"):
        _export("triton")


def test_none_runs_the_tpu_kernel_only_where_measured_faster():
    assert "tpu_custom_call" not in _export(None)  # nothing measured: the XLA path
    assert "tpu_custom_call" not in _export(None, gradient=False)

    def timed(kernel_ms, kind="TPU v5 lite"):
        return measured(kind, {PallasMosaicTpuGatedLinearUnit(): kernel_ms,
                               GatedLinearUnit(): 3.0}, *_tpu_args())

    with timed(1.0):  # faster by more than the dense GLU's margin of half
        assert "tpu_custom_call" in _export(None, gradient=False)
        assert _export(None).count("tpu_custom_call") == 1  # the forward; XLA's gradient
    with timed(2.0):  # faster, but XLA merges its gradient's products with its forward's
        assert "tpu_custom_call" not in _export(None, gradient=False)
    with timed(1.0, kind="TPU v6 lite"):  # another generation's measurement is no evidence
        assert "tpu_custom_call" not in _export(None, gradient=False)


def test_exported_by_tokamax_pass():
    assert tokamax_pass.PallasMosaicTpuGatedLinearUnit is PallasMosaicTpuGatedLinearUnit
    assert api.FAMILY.implementations["mosaic_tpu"] is PallasMosaicTpuGatedLinearUnit
    assert api.FAMILY.aliases["mosaic"] == ("mosaic_gpu", "mosaic_tpu")
