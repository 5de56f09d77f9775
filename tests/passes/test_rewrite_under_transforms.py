"""`optimize` rewrites the patterns of a function that `jax.grad`, `jax.value_and_grad`,
`jax.vjp`, `jax.jvp` or `jax.shard_map` transforms inside the optimized function (a
training step) before JAX transforms it: the op and its own VJP replace the norm, gated
linear unit, loss or attention written in `jnp`, whose plain backward reads values inside
the match.

On CPU the plain path is chosen, so `rewritten` keeps every candidate (the op's `xla`
path and its VJP); values and gradients are compared with `jax.jit` of the same step,
in float32 at HIGHEST precision.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _rewriting import HIGHEST, REWRITTEN, h200_plan, op_names, outcomes
from conftest import H200, assert_close, calibrate, random_normal
from tokamax_pass.passes import rewrite

B, T, D = 2, 6, 32


def dot(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6)
    return (normed * scale).astype(x.dtype)


def layer_norm(x, scale, offset):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + 1e-5) * scale + offset


def unbiased_layer_norm(x, scale, offset):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.var(x, axis=-1, keepdims=True, ddof=1)
    return (x - mean) * jax.lax.rsqrt(variance + 1e-5) * scale + offset


def swiglu(x, w_gate, w_up):
    return jax.nn.silu(dot(x, w_gate)) * dot(x, w_up)


def tanh_gate(x, w_gate, w_up):
    return jnp.tanh(dot(x, w_gate)) * dot(x, w_up)


def cross_entropy(x, w, labels):
    logits = dot(x, w).astype(jnp.float32)
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - label_logits


def attention(q, k, v):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * 0.25
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v,
                      precision=HIGHEST)


def _normal_operands(seed, *shapes):
    return tuple(random_normal(seed + i, shape) for i, shape in enumerate(shapes))


# pattern -> (function, its operands, the op the rewrite runs)
CASES = {
    "rms_norm": (rms_norm, _normal_operands(0, (B, T, D), (D,)), "LayerNorm"),
    "layer_norm": (layer_norm, _normal_operands(10, (B, T, D), (D,), (D,)), "LayerNorm"),
    "gated_linear_unit": (swiglu, _normal_operands(20, (B, T, D), (D, 8), (D, 8)),
                          "GatedLinearUnit"),
    "cross_entropy": (cross_entropy, (*_normal_operands(30, (B, T, D), (D, 24)),
                                      jax.random.randint(jax.random.key(32), (B, T), 0, 24)),
                      "LinearSoftmaxCrossEntropyLoss"),
    "attention": (attention, _normal_operands(40, (B, 8, 2, 16), (B, 10, 2, 16),
                                              (B, 10, 2, 16)), "DotProductAttention"),
}


def training_step(f, cotangent):
    """`optimize`'s usual input: a step taking the gradient of a loss of `f` inside."""
    differentiable = tuple(i for i in range(f.__code__.co_argcount) if f is not cross_entropy
                           or i < 2)

    def loss(*args):
        return (f(*args).astype(jnp.float32) * cotangent).sum()

    def step(*args):
        return jax.value_and_grad(loss, argnums=differentiable)(*args)

    return step


def assert_trees_close(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert_close(a, e)


@pytest.mark.parametrize("name", list(CASES))
def test_a_gradient_inside_optimize_runs_the_op_and_its_vjp(rewritten, name):
    f, args, op = CASES[name]
    step = training_step(f, random_normal(9, jax.eval_shape(f, *args).shape))
    optimized = tokamax.optimize(step)
    matches = optimized.plan(*args).matches
    assert [(m.path.split("/")[0], m.outcome) for m in matches] == [("vjp", REWRITTEN)]
    assert matches[0].source_line.endswith(f"({f.__name__})")
    ops = op_names(optimized, *args)
    assert ops[0] == op and len(ops) == 2  # the op, and its VJP op
    with jax.default_matmul_precision("highest"):
        expected = jax.jit(step)(*args)
    assert_trees_close(optimized(*args), expected)


@pytest.mark.parametrize("f,reason", [(unbiased_layer_norm, "n - 1"), (tanh_gate, None)],
                         ids=lambda p: getattr(p, "__name__", ""))
def test_near_misses_under_a_gradient_stay_as_written(rewritten, f, reason):
    args = CASES["layer_norm" if f is unbiased_layer_norm else "gated_linear_unit"][1]
    step = training_step(f, random_normal(9, jax.eval_shape(f, *args).shape))
    optimized = tokamax.optimize(step)
    matches = optimized.plan(*args).matches
    assert not any(m.rewritten for m in matches)
    assert [reason in m.reason for m in matches] == ([] if reason is None else [True])
    assert op_names(optimized, *args) == []
    assert_trees_close(optimized(*args), jax.jit(step)(*args))


def test_has_aux_argnums_and_nested_parameters(rewritten):
    x, scale = CASES["rms_norm"][1]
    params = {"norm": {"scale": scale}, "w": (random_normal(3, (D, D)),)}
    cotangent = random_normal(9, (B, T, D))

    def loss(x, params):
        y = rms_norm(dot(x, params["w"][0]), params["norm"]["scale"])
        return (y * cotangent).sum(), {"mean": y.mean()}

    def step(x, params):
        (value, aux), grads = jax.value_and_grad(loss, argnums=1, has_aux=True)(x, params)
        grad_x, _ = jax.grad(loss, argnums=(0,), has_aux=True)(x, params)
        return value, aux, grads, grad_x

    optimized = tokamax.optimize(step)
    assert [m.outcome for m in optimized.plan(x, params).matches] == [REWRITTEN] * 2
    assert_trees_close(optimized(x, params), jax.jit(step)(x, params))


def test_scan_and_remat_bodies_under_a_gradient(rewritten):
    x = random_normal(0, (B, T, D))
    scales = random_normal(1, (3, D))
    cotangent = random_normal(2, (B, T, D))

    def loss(x, scales):
        def layer(h, scale):
            return jnp.tanh(jax.checkpoint(rms_norm)(h, scale)), None

        return (jax.lax.scan(layer, x, scales)[0] * cotangent).sum()

    def step(x, scales):
        return jax.value_and_grad(loss, argnums=(0, 1))(x, scales)

    optimized = tokamax.optimize(step)
    assert [(m.path, m.outcome) for m in optimized.plan(x, scales).matches] == [
        ("vjp/scan/checkpoint/layer_norm", REWRITTEN)]
    assert_trees_close(optimized(x, scales), jax.jit(step)(x, scales))


def test_vjp_inside_optimize_and_forward_mode_as_written(rewritten):
    """An op has no forward-mode derivative: under `jax.jvp` the norm stays as written."""
    x, scale = CASES["rms_norm"][1]
    tangent, cotangent = random_normal(7, (B, T, D)), random_normal(8, (B, T, D))

    def step(x, scale):
        out, pullback = jax.vjp(rms_norm, x, scale)
        _, out_tangent = jax.jvp(lambda x: rms_norm(x, scale), (x,), (tangent,))
        return out, pullback(cotangent), out_tangent

    optimized = tokamax.optimize(step)
    assert [(m.path, m.rewritten) for m in optimized.plan(x, scale).matches] == [
        ("vjp/layer_norm", True)]
    with jax.default_matmul_precision("highest"):
        expected = jax.jit(step)(x, scale)
    assert_trees_close(optimized(x, scale), expected)


def test_second_order_gradients(rewritten):
    x, scale = CASES["rms_norm"][1]
    cotangent = random_normal(9, (B, T, D))

    def loss(x, scale):
        return (rms_norm(x, scale) * cotangent).sum()

    def step(x, scale):
        return jax.grad(lambda x: jnp.sum(jax.grad(loss)(x, scale) ** 2))(x)

    optimized = tokamax.optimize(step)
    assert outcomes(optimized, x, scale) == [REWRITTEN]
    with jax.default_matmul_precision("highest"):
        expected = jax.jit(step)(x, scale)
    assert_trees_close(optimized(x, scale), expected)


def test_a_gradient_made_before_optimize(rewritten):
    f, args, _ = CASES["rms_norm"]
    grad = jax.grad(lambda *a: (f(*a) * random_normal(9, (B, T, D))).sum(), argnums=(0, 1))
    optimized = tokamax.optimize(grad)
    assert outcomes(optimized, *args) == [REWRITTEN]
    assert_trees_close(optimized(*args), jax.jit(grad)(*args))


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_bodies(rewritten, check_vma):
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    x, scale = random_normal(0, (4, 3, D)), random_normal(1, (D,))
    cotangent = random_normal(2, (4, 3, D))

    def sharded(x, scale):
        body = jax.shard_map(rms_norm, mesh=mesh, in_specs=(jax.P("d"), jax.P()),
                             out_specs=jax.P("d"), check_vma=check_vma)
        return (body(x, scale) * cotangent).sum()

    def step(x, scale):
        return jax.value_and_grad(sharded, argnums=(0, 1))(x, scale)

    optimized = tokamax.optimize(step)
    plan = optimized.plan(x, scale)
    assert [(m.path, m.outcome) for m in plan.matches] == [("shard_map/layer_norm", REWRITTEN)]
    assert {row.path for row in plan} == {"shard_map/layer_norm", "shard_map/layer_norm_vjp"}
    assert {row.arguments.split("x=")[1] for row in plan if "x=" in row.arguments} == {
        "f32[1,3,32]"}  # per shard
    assert_trees_close(optimized(x, scale), jax.jit(step)(x, scale))


@pytest.mark.parametrize("differentiated", [False, True], ids=["forward", "gradient"])
@pytest.mark.parametrize("name", list(CASES))
def test_each_pattern_in_a_shard_map_body_checking_vma(rewritten, name, differentiated):
    """Under `check_vma` (`jax.shard_map`'s default), `jnp` marks the literals inside its
    jitted functions (`take_along_axis`, `log_softmax`) varying over the mesh axis with
    `pvary`: the bodies compare equal to the spellings' all the same, and the op's
    function (the labels' arithmetic of the loss) is traced with its constants varying
    where they meet varying values."""
    f, args, _ = CASES[name]
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    labels = (len(args) - 1,) if f is cross_entropy else ()
    per_example = {"attention": (0, 1, 2)}.get(name, (0, *labels))  # the others replicated
    in_specs = tuple(jax.P("d") if i in per_example else jax.P() for i in range(len(args)))
    sharded = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=jax.P("d"))
    cotangent = random_normal(9, jax.eval_shape(f, *args).shape)

    def step(*args):
        if not differentiated:
            return sharded(*args)
        return jax.value_and_grad(lambda *a: (sharded(*a) * cotangent).sum(),
                                  argnums=tuple(i for i in range(len(args))
                                                if i not in labels))(*args)

    optimized = tokamax.optimize(step)
    assert outcomes(optimized, *args) == [REWRITTEN]
    with jax.default_matmul_precision("highest"):
        expected = jax.jit(step)(*args)
    assert_trees_close(optimized(*args), expected)


@pytest.mark.parametrize("differentiated", [False, True])
def test_a_shard_map_made_before_optimize(rewritten, differentiated):
    """A `shard_map` function built before `optimize` (a model's module-level sharded
    layer) is not handed to `optimize`'s intercepted `jax.shard_map`: its body is matched
    where the pass meets the map, per shard, alone and under a gradient, and a collective
    in the body still runs over the mesh axis."""
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])

    def body(x, scale):  # the norm of each shard's rows, scaled by a mesh-wide sum
        return rms_norm(x, scale) * jax.lax.psum(jnp.sum(x), "d")

    premade = jax.shard_map(body, mesh=mesh, in_specs=(jax.P("d"), jax.P()),
                            out_specs=jax.P("d"))
    x, scale = random_normal(0, (4, 3, D)), random_normal(1, (D,))
    cotangent = random_normal(2, (4, 3, D))

    def step(x, scale):
        if not differentiated:
            return premade(x, scale)
        return jax.value_and_grad(lambda x, scale: (premade(x, scale) * cotangent).sum(),
                                  argnums=(0, 1))(x, scale)

    optimized = tokamax.optimize(step)
    plan = optimized.plan(x, scale)
    prefix = "vjp/" if differentiated else ""
    assert [(m.path, m.outcome) for m in plan.matches] == [
        (f"{prefix}shard_map/layer_norm", REWRITTEN)]
    assert {row.path for row in plan} == {"shard_map/layer_norm"} | (
        {"shard_map/layer_norm_vjp"} if differentiated else set())
    assert {row.arguments.split("x=")[1] for row in plan if "x=" in row.arguments} == {
        "f32[1,3,32]"}  # per shard
    assert_trees_close(optimized(x, scale), jax.jit(step)(x, scale))


@pytest.mark.parametrize("name", ["gated_linear_unit", "cross_entropy", "attention"])
def test_a_match_does_not_depend_on_the_targets_planned_before(name):
    """The patterns compare a user's equations with their reference spellings, traced once
    and kept: a reference traced under one target's mesh does not compare equal under
    another's, so the same function planned for CPU, the H200 and CPU again matches each
    time."""
    f, args, _ = CASES[name]
    for target in ("cpu", "h200", "cpu"):
        plan = h200_plan(f, *args) if target == "h200" else tokamax.optimize(f).plan(*args)
        assert len(plan.matches) == 1, target


def test_left_alone_under_a_gradient_is_listed_once_and_unchanged():
    f, args, _ = CASES["rms_norm"]
    step = training_step(f, random_normal(9, (B, T, D)))
    for option, listed in ((True, ["left alone: the plain path is chosen (cpu xla)"]),
                           (False, []), (("ragged_dot",), [])):
        optimized = tokamax.optimize(step, rewrite=option)
        assert outcomes(optimized, *args) == listed
        assert optimized.lower(*args).as_text() == jax.jit(step).lower(*args).as_text()


X = jax.ShapeDtypeStruct((20000, 768), jnp.float32)
SCALE = jax.ShapeDtypeStruct((768,), jnp.float32)


FAST, SLOW = 0.8, 0.05


def test_the_rule_keeps_a_norm_whose_kernel_wins_under_a_gradient(calibration_dir):
    calibrate(calibration_dir, {"PallasTritonLayerNorm": FAST, "LayerNorm": SLOW,
                                "PallasTritonLayerNormVjp": SLOW, "AutodiffVjp": FAST})
    step = training_step(rms_norm, np.float32(1.0))
    plan = h200_plan(step, X, SCALE)
    assert [m.outcome for m in plan.matches] == [
        "rewritten: cuda layer_norm triton, layer_norm_vjp xla"]
    assert [(row.path, row.op) for row in plan] == [("layer_norm", "PallasTritonLayerNorm"),
                                                    ("layer_norm_vjp", "AutodiffVjp(LayerNorm)")]
    artifact = tokamax.optimize(step).export(X, SCALE, platforms=["cpu", "cuda"],
                                             device_kind=H200)
    (entry,) = artifact.manifest["rewrites"]
    assert entry["path"] == "vjp/layer_norm" and entry["rewritten"]
    assert entry["implementation"] == {
        "cpu": "xla", "cuda": "layer_norm triton, layer_norm_vjp xla"}


def test_the_rule_decides_for_the_ops_gradient_too(monkeypatch):
    """Under a gradient the op's VJP call is chosen for as well: a kernel for the
    gradient alone (the forward on XLA) keeps the match, as the library cache makes the
    encoder's norms run XLA forward and the Triton gradient on the H200."""
    monkeypatch.setattr(rewrite, "rewrite_wins", lambda chosen: any(
        rewrite.op_label(ba.op).endswith("_vjp") for ba in chosen))
    f, args, _ = CASES["rms_norm"]
    assert outcomes(tokamax.optimize(f), *args) == [
        "left alone: the plain path is chosen (cpu xla)"]
    assert outcomes(tokamax.optimize(training_step(f, np.float32(1.0))), *args) == [REWRITTEN]
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])

    def sharded(x, scale):
        return jax.shard_map(f, mesh=mesh, in_specs=(jax.P("d"), jax.P()),
                             out_specs=jax.P("d"))(x, scale)

    assert outcomes(tokamax.optimize(sharded), *args) == [
        "left alone: the plain path is chosen (cpu xla)"]
    assert outcomes(tokamax.optimize(training_step(sharded, np.float32(1.0))), *args) == [
        REWRITTEN]


def test_the_rule_leaves_a_norm_without_evidence_for_a_kernel(calibration_dir):
    calibrate(calibration_dir, {"PallasTritonLayerNorm": SLOW, "LayerNorm": FAST,
                                "PallasTritonLayerNormVjp": SLOW, "AutodiffVjp": FAST})
    plan = h200_plan(training_step(rms_norm, np.float32(1.0)), X, SCALE)
    assert [m.outcome for m in plan.matches] == [
        "left alone: the plain path is chosen (cuda xla)"]
    assert len(plan) == 0


def test_the_librarys_own_autodiff_is_left_to_jax(rewritten):
    """An op's autodiff differentiates its reference with `jax.vjp`: not rewritten into
    the op itself."""
    namespace = {"__name__": "tokamax_kernels.reference", "jax": jax, "rms_norm": rms_norm}
    exec("def pullback(x, scale, cotangent):\n"
         "    return jax.vjp(rms_norm, x, scale)[1](cotangent)\n", namespace)
    x, scale = CASES["rms_norm"][1]
    cotangent = random_normal(9, (B, T, D))
    optimized = tokamax.optimize(namespace["pullback"])
    matches = optimized.plan(x, scale, cotangent).matches
    assert [(m.path, m.rewritten) for m in matches] == [("layer_norm", False)]
    assert_trees_close(optimized(x, scale, cotangent),
                       jax.jit(namespace["pullback"])(x, scale, cotangent))
