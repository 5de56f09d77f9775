"""linear_softmax_cross_entropy_loss: xla and xla_chunked beyond the base suite
(`test_linear_softmax_cross_entropy_suite.py`): float16 logits past float16's range,
`jax_enable_x64`, the lse residual contract, `None`'s choice, exports, sharding, memory,
heuristics, specs and bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, measured, random_normal
from test_linear_softmax_cross_entropy_suite import reference
from tokamax_kernels.linear_softmax_cross_entropy_loss import (
    LinearSoftmaxCrossEntropyLoss,
    LinearSoftmaxCrossEntropyLossVjp,
    PallasMosaicGpuLinearSoftmaxCrossEntropyLoss,
    XlaChunkedLinearSoftmaxCrossEntropyLoss,
    XlaChunkedLinearSoftmaxCrossEntropyLossVjp,
    XlaChunkedLossConfig,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.xla_chunked import (
    heuristic_config,
    search_space,
)
from tokamax_pass.core import BoundArguments, selection
from tokamax_pass.core.bound_arguments import VmapLevel

B, S, H, V = 2, 13, 16, 37  # 26 tokens, a vocabulary no tile below divides
lce = tokamax.linear_softmax_cross_entropy_loss


def chunked(block_tokens: int = 5, block_vocab: int = 8) -> XlaChunkedLinearSoftmaxCrossEntropyLoss:
    """xla_chunked with small tiles, forward and backward: several token and vocabulary
    blocks, the last of each overlapping the one before it."""
    config = XlaChunkedLossConfig(block_tokens, block_vocab)
    return XlaChunkedLinearSoftmaxCrossEntropyLoss(
        config=config, vjp=XlaChunkedLinearSoftmaxCrossEntropyLossVjp(config=config))


IMPLEMENTATIONS = {"xla": "xla", "xla_chunked tiles": chunked(), "xla_chunked": "xla_chunked"}


def inputs(dtype, seed=0, shape=(B, S)):
    x = random_normal(seed, (*shape, H), dtype)
    weights = (random_normal(seed + 1, (H, V)) / np.sqrt(H) * 2).astype(dtype)
    labels = jax.random.randint(jax.random.key(seed + 2), shape, 0, V)
    ignored = jax.random.bernoulli(jax.random.key(seed + 3), 0.25, shape)
    labels = jnp.where(ignored, -1, labels)
    assert 0 < int(ignored.sum()) < ignored.size  # some tokens ignored, some counted
    return x, labels, weights


def check_against_reference(implementation, dtype, reduction, cap):
    x, labels, weights = inputs(dtype)
    kwargs = dict(reduction=reduction, logits_soft_cap=cap, precision="highest")
    out = lce(x, labels, weights, implementation=implementation, **kwargs)
    want = reference(x, labels, weights, reduction, cap)
    assert out.dtype == jnp.float32 and out.shape == want.shape
    assert_close(out, want, dtype)

    cotangent = random_normal(9, want.shape)

    def loss(x, weights):
        return jnp.sum(lce(x, labels, weights, implementation=implementation, **kwargs)
                       * cotangent)

    def reference_loss(x, weights):
        return jnp.sum(reference(x, labels, weights, reduction, cap) * cotangent)

    dx, dweights = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, weights)
    want_dx, want_dweights = jax.grad(reference_loss, argnums=(0, 1))(
        x.astype(jnp.float32), weights.astype(jnp.float32))
    assert dx.dtype == dtype and dweights.dtype == dtype
    assert_close(dx, want_dx, dtype)
    assert_close(dweights, want_dweights, dtype)
    # Ignored tokens get no gradient.
    assert not np.any(np.asarray(dx, np.float32)[np.asarray(labels) < 0])


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked tiles"])
def test_float16_logits_past_its_range(implementation):
    """float16 inputs whose logits pass 65504 (float16's largest): the loss and its
    gradients stay finite and match the float32 reference. Logits rounded to float16
    came out inf, the loss inf or NaN."""
    x, labels, weights = inputs(jnp.float16)
    x, weights = (x * 60).astype(jnp.float16), (weights * 300).astype(jnp.float16)
    logits = jnp.matmul(x.astype(jnp.float32), weights.astype(jnp.float32))
    assert float(jnp.abs(logits).max()) > 65504
    cotangent = random_normal(9, labels.shape)

    def loss(fn, x, weights):
        return jnp.sum(fn(x, weights) * cotangent)

    def ours(x, weights):
        return lce(x, labels, weights, reduction="none", implementation=IMPLEMENTATIONS[
            implementation])

    def want(x, weights):
        return reference(x, labels, weights, "none")

    assert_close(ours(x, weights), want(x, weights), jnp.float16)
    grads = jax.grad(functools.partial(loss, ours), argnums=(0, 1))(x, weights)
    want_grads = jax.grad(functools.partial(loss, want), argnums=(0, 1))(
        x.astype(jnp.float32), weights.astype(jnp.float32))
    for got, expected in zip(grads, want_grads, strict=True):
        assert got.dtype == jnp.float16
        assert_close(got, expected, jnp.float16)


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked tiles"])
def test_runs_under_enable_x64(implementation):
    """With `jax_enable_x64` on, float32 inputs still give the float32 reference (the
    chunked scan's carries once came out float64 there and failed to lower)."""
    with jax.enable_x64(True):
        check_against_reference(IMPLEMENTATIONS[implementation], jnp.float32, "mean", None)


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked tiles"])
def test_chunked_and_xla_pair_through_the_lse_residual(implementation):
    """Either forward's residuals feed either backward (the family's residual contract)."""
    x, labels, weights = inputs(jnp.float32, seed=4)
    other = chunked(3, 16) if implementation == "xla" else LinearSoftmaxCrossEntropyLoss()
    op = (LinearSoftmaxCrossEntropyLoss(vjp=other.vjp_op()) if implementation == "xla"
          else chunked().replace(vjp=other.vjp_op()))
    grads = jax.grad(lambda x, w: lce(x, labels, w, implementation=op, precision="highest"),
                     argnums=(0, 1))(x, weights)
    want = jax.grad(lambda x, w: reference(x, labels, w, "sum"), argnums=(0, 1))(x, weights)
    for got, expected in zip(grads, want, strict=True):
        assert_close(got, expected)


def test_none_runs_the_xla_reference_without_measurements():
    x, labels, weights = inputs(jnp.float32, seed=8)
    f = tokamax.optimize(lambda x, lab, w: lce(x, lab, w, reduction="mean"))
    assert "LinearSoftmaxCrossEntropyLoss" in str(f.plan(x, labels, weights))
    assert "XlaChunked" not in str(f.plan(x, labels, weights))
    assert_close(f(x, labels, weights), reference(x, labels, weights, "mean"))


def test_none_runs_xla_chunked_where_measured_faster():
    x, labels, weights = inputs(jnp.float32, seed=8)
    evidence = measured("cpu", {XlaChunkedLinearSoftmaxCrossEntropyLoss(): 0.9,
                                LinearSoftmaxCrossEntropyLoss(): 2.0},
                        x, labels, weights, reduction="mean")
    with evidence:
        f = tokamax.optimize(lambda x, lab, w: lce(x, lab, w, reduction="mean"))
        assert "XlaChunkedLinearSoftmaxCrossEntropyLoss" in str(f.plan(x, labels, weights))
        assert_close(f(x, labels, weights), reference(x, labels, weights, "mean"))


def test_gradient_exports_for_cpu_and_cuda():
    """Plain XLA loops: the forward and backward lower for a GPU that is not here too."""
    x = jax.ShapeDtypeStruct((B, S, H), jnp.bfloat16)
    weights = jax.ShapeDtypeStruct((H, V), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((B, S), jnp.int32)

    def loss(x, labels, weights):
        return lce(x, labels, weights, reduction="mean", implementation="xla_chunked")

    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 2))),
                                 platforms=("cpu", "cuda"))(x, labels, weights)
    text = exported.mlir_module()
    assert "XlaChunkedLinearSoftmaxCrossEntropyLossVjp" in text
    assert exported.platforms == ("cpu", "cuda")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_token_sharded_inputs_partition_without_gathering(reduction):
    """x and labels split over 8 fake devices (batch over "data", sequence over "model"):
    the chunked op runs per device on its tokens, no all-gather, equal to the unsharded
    reference forward and backward ("mean" divides by the global count of labels)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x, labels, weights = inputs(jnp.float32, seed=10, shape=(8, 6))
    impl = chunked(2, 16)
    cotangent = 1.0 if reduction != "none" else random_normal(11, labels.shape)

    def loss(x, labels, weights):
        return lce(x, labels, weights, reduction=reduction, precision="highest",
                   implementation=impl)

    def grads(fn):
        return jax.grad(lambda x, lab, w: jnp.sum(fn(x, lab, w) * cotangent), argnums=(0, 2))

    def reference_loss(x, labels, weights):
        return reference(x, labels, weights, reduction)

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x_sharded = jax.device_put(x, NamedSharding(mesh, P("data", "model", None)))
    labels_sharded = jax.device_put(labels, NamedSharding(mesh, P("data", "model")))
    with jax.set_mesh(mesh):
        out = jax.jit(loss)(x_sharded, labels_sharded, weights)
        compiled = jax.jit(grads(loss)).lower(x_sharded, labels_sharded, weights).compile()
        dx, dweights = compiled(x_sharded, labels_sharded, weights)
    assert "all-gather" not in compiled.as_text()
    assert dx.sharding.spec[:2] == ("data", "model")
    assert_close(out, reference_loss(x, labels, weights))
    want_dx, want_dweights = grads(reference_loss)(x, labels, weights)
    assert_close(dx, want_dx)
    assert_close(dweights, want_dweights)


def _temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_temporary_memory_is_bounded_by_the_tile():
    """Compiled fwd+bwd at 2048 tokens, H 256, V 8192 (f32 logits: 64 MiB): the chunked
    op's temporaries (a few 256 x 1024 tiles and the dx accumulator) stay under a tenth
    of the reference's, which holds the logits and their gradient."""
    x = jax.ShapeDtypeStruct((2, 1024, 256), jnp.float32)
    weights = jax.ShapeDtypeStruct((256, 8192), jnp.float32)
    labels = jax.ShapeDtypeStruct((2, 1024), jnp.int32)
    temps = {}
    for name, impl in (("xla", "xla"), ("xla_chunked", chunked(256, 1024))):
        def step(x, w, lab, impl=impl):
            return jax.value_and_grad(lambda x, w: lce(x, lab, w, reduction="mean",
                                                       implementation=impl), (0, 1))(x, w)
        temps[name] = _temp_bytes(step, x, weights, labels)
    logits_bytes = 2 * 1024 * 8192 * 4
    assert temps["xla"] >= logits_bytes, temps
    assert temps["xla_chunked"] * 10 <= temps["xla"], temps


def test_heuristics_and_search_space():
    x, labels, weights = inputs(jnp.bfloat16)
    ba = XlaChunkedLinearSoftmaxCrossEntropyLoss.bind(x, labels, weights)
    assert ba.heuristics_config == XlaChunkedLossConfig(B * S, V)  # clamped to the shape
    configs = search_space(16384, 128256)
    assert XlaChunkedLossConfig(16384, 4096) in configs and len(configs) == 6  # 32768 clamps
    assert all(c.block_tokens * c.block_vocab <= 1 << 26 for c in configs)
    # The heuristic: vocabulary blocks of 2048, up to 16384 tokens (the H200 sweep's best).
    assert heuristic_config(16384, 128256) == XlaChunkedLossConfig(16384, 2048)
    assert heuristic_config(4096, 1000) == XlaChunkedLossConfig(4096, 1000)
    assert heuristic_config(65536, 32000) in configs
    vjp = XlaChunkedLinearSoftmaxCrossEntropyLossVjp()
    vjp_ba = vjp.bind((jnp.zeros((B, S)),), jnp.zeros(()), jnp.ones(()), x=x, labels=labels,
                      weights=weights, reduction="sum", logits_soft_cap=None, precision=None)
    assert vjp_ba.heuristics_config in vjp_ba.autotuning_configs
    with pytest.raises(ValueError, match="block_vocab must be a positive int"):
        XlaChunkedLossConfig(8, 0)


def test_spec_round_trip_and_random_arguments():
    x, labels, weights = inputs(jnp.bfloat16)
    ba = chunked().bind(x, labels, weights, reduction="mean", logits_soft_cap=30)
    again = BoundArguments.from_json(ba.to_json())
    assert again.cache_key == ba.cache_key and again.op == ba.op
    # Under a vmap of x and labels (array leaves in key order: labels, weights, x).
    vmapped = ba.replace(vmap=(VmapLevel((0, None, 0), 3),))
    args = ba.op.random_arguments(vmapped, seed=1)
    assert args["x"].shape == (3, B, S, H) and args["weights"].shape == (H, V)
    got = np.asarray(args["labels"])
    assert got.shape == (3, B, S) and got.min() == -1 and got.max() < V
    vjp_args = LinearSoftmaxCrossEntropyLossVjp().random_arguments(
        LinearSoftmaxCrossEntropyLossVjp().bind(
            (jax.ShapeDtypeStruct((B, S), jnp.float32),), jax.ShapeDtypeStruct((), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.float32), **ba.arguments), seed=2)
    assert vjp_args["residuals"][0].shape == (B, S) and np.isfinite(vjp_args["out"])


@pytest.mark.parametrize("args, kwargs, match", [
    (((B, S, H), (B, S), (H, V)), dict(labels_value=V), "labels must be < V = 37"),
    (((B, S, H), (B, S), (H, V)), dict(float_labels=True), "labels must be an integer array"),
    (((B, S, H), (B, S + 1), (H, V)), {}, r"labels must have shape \(2, 13\)"),
    (((B, S, H), (B, S), (H + 1, V)), {}, "H mismatch"),
    (((B, S, H), (B, S), (H, V)), dict(reduction="avg"), "reduction must be one of"),
    (((B, S, H), (B, S), (H, V)), dict(logits_soft_cap=-1.0), "logits_soft_cap must be"),
    (((B, S, H), (B, S), (H, V)), dict(weights_dtype=jnp.bfloat16), "same dtype"),
    (((B, S, H), (B, S), (H, V, 1)), {}, "weights must have rank 2"),
])
def test_bad_input_is_a_clear_error(args, kwargs, match):
    x_shape, labels_shape, w_shape = args
    x = random_normal(0, x_shape)
    weights = random_normal(1, w_shape, kwargs.pop("weights_dtype", jnp.float32))
    labels = jnp.full(labels_shape, kwargs.pop("labels_value", 1), jnp.int32)
    if kwargs.pop("float_labels", False):
        labels = labels.astype(jnp.float32)
    for implementation in ("xla", "xla_chunked"):
        with pytest.raises(ValueError, match=match):
            lce(x, labels, weights, implementation=implementation, **kwargs)


def test_a_kernel_lm_head_forward_must_beat_xla_by_half():
    """XLA merges the logits product of its forward with its gradient's recompute, so a
    kernel forward measured 1.12x faster alone made the Llama step slower (H200)."""
    x = jax.ShapeDtypeStruct((16384, 2048), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((16384,), jnp.int32)
    w = jax.ShapeDtypeStruct((2048, 32000), jnp.bfloat16)
    candidates = [op.bind(x, labels, w) for op in (
        PallasMosaicGpuLinearSoftmaxCrossEntropyLoss(), LinearSoftmaxCrossEntropyLoss())]
    assert selection.rank_with_evidence(candidates, [2.96, 3.32]) == [1]
    assert selection.rank_with_evidence(candidates, [1.5, 3.32]) == [0, 1]


def test_random_arguments_hooks_compile_ahead_to_the_same_arguments():
    """The autotuner compiles an op's `random_arguments` hook as one program (the LM
    head's VJP with its forward residuals, the ragged dot's group sizes); what the
    program makes equals the hook run op by op."""
    from tokamax_pass.autotuning import timing_inputs

    x, labels, weights = inputs(jnp.bfloat16)
    forward = chunked().bind(x, labels, weights, reduction="mean")
    vjp = LinearSoftmaxCrossEntropyLossVjp().bind(
        (jax.ShapeDtypeStruct((B, S), jnp.float32),), jax.ShapeDtypeStruct((), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.float32), **forward.arguments)
    ragged = tokamax.RaggedDot().bind(
        jax.ShapeDtypeStruct((100, 8), jnp.bfloat16),
        jax.ShapeDtypeStruct((3, 8, 16), jnp.bfloat16), jax.ShapeDtypeStruct((3,), jnp.int32))
    for ba in (forward, vjp, ragged):
        compiled = timing_inputs.compiled_hook(ba, seed=5)
        assert compiled is not None, type(ba.op).__name__
        assert timing_inputs.compile_untimed(ba, False, 5).random is not None
        want, got = ba.op.random_arguments(ba, 5), compiled(5)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            if isinstance(b, jax.Array):
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                           rtol=1e-6, atol=1e-6)
            else:
                assert a == b
    assert int(np.asarray(compiled(5)["group_sizes"]).sum()) == 100
