"""`optimize` rewrites `jax.lax.ragged_dot` into the `ragged_dot` op where
`implementation=None` picks a kernel for it, and leaves it alone otherwise.

On CPU only the plain path runs, so `rewritten` keeps every candidate: the values and
gradients of the program the rewrite makes (the op's `xla` implementation and its VJP)
are compared with `jax.jit` of the user's function. Selection itself is checked on plans
for an H200, with a calibration predicting the kernels faster (or none).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _rewriting import REWRITTEN
from conftest import H200, assert_close, calibrate, random_normal
from tokamax_pass import core

HIGHEST = jax.lax.Precision.HIGHEST
M, K, N, G = 24, 16, 8, 3
SIZES = jnp.array([7, 0, 12], jnp.int32)  # an empty group, and rows past the sum
KERNELS_FASTER = {"PallasTritonRaggedDot": 0.5, "PallasMosaicGpuRaggedDot": 0.4,
                  "RaggedDot": 0.05}


def ragged(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes, precision=HIGHEST)


def operands(dtype, seed=0, batch=()):
    x = random_normal(seed, (*batch, M, K), dtype)
    w = random_normal(seed + 1, (*batch, G, K, N), dtype)
    sizes = jnp.broadcast_to(SIZES, (*batch, G))
    return x, w, sizes


def weighted(f, cotangent):
    """A scalar loss of `f`'s output: its sum weighted by a random cotangent."""
    return lambda *args: (f(*args).astype(jnp.float32) * cotangent).sum()


def outcomes(optimized, *args):
    return [m.outcome for m in optimized.plan(*args).matches]


def ragged_into(out_dtype):
    def f(x, w, sizes):
        return jax.lax.ragged_dot(x, w, sizes, precision=HIGHEST,
                                  preferred_element_type=out_dtype)

    return f


@pytest.mark.parametrize("dtype,out_dtype", [(jnp.float32, None), (jnp.bfloat16, None),
                                             (jnp.bfloat16, jnp.float32)])
def test_values_and_gradients_match_jit(rewritten, dtype, out_dtype):
    f = ragged_into(out_dtype)
    x, w, sizes = operands(dtype)
    loss = weighted(f, random_normal(2, (M, N)))
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, x, w, sizes) == [REWRITTEN]
    out = optimized(x, w, sizes)
    assert out.dtype == jax.jit(f)(x, w, sizes).dtype
    assert_close(out, jax.jit(f)(x32, w32, sizes), dtype)
    expected = jax.jit(jax.grad(loss, argnums=(0, 1)))(x32, w32, sizes)
    # Our op's own VJP (grad of the optimized function) and the plain backward's ragged
    # dots rewritten as the op's dlhs and drhs variants (optimize of the grad).
    grad_optimized = jax.grad(weighted(optimized, random_normal(2, (M, N))), argnums=(0, 1))
    optimized_grad = tokamax.optimize(jax.grad(loss, argnums=(0, 1)))
    assert outcomes(optimized_grad, x, w, sizes) == [REWRITTEN] * 3
    for actual in (grad_optimized(x, w, sizes), optimized_grad(x, w, sizes)):
        for a, e in zip(actual, expected, strict=True):
            assert_close(a, e, dtype)


def test_the_rewritten_program_runs_the_op(rewritten):
    x, w, sizes = operands(jnp.float32)
    text = tokamax.optimize(ragged).lower(x, w, sizes).as_text()
    assert [o.op for o in tokamax.inspect(text).ops] == ["RaggedDot"]


def test_vmap_inside_and_outside(rewritten):
    x, w, sizes = operands(jnp.float32, batch=(2,))
    cotangent = random_normal(3, (2, M, N))
    loss = weighted(jax.vmap(ragged), cotangent)
    expected = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w, sizes)
    inside = tokamax.optimize(jax.value_and_grad(loss, argnums=(0, 1)))
    assert outcomes(inside, x, w, sizes) == [REWRITTEN] * 3
    outside = jax.value_and_grad(weighted(jax.vmap(tokamax.optimize(ragged)), cotangent),
                                 argnums=(0, 1))
    for value, grads in (inside(x, w, sizes), outside(x, w, sizes)):
        assert_close(value, expected[0])
        for a, e in zip(grads, expected[1], strict=True):
            assert_close(a, e)


def test_scan_and_remat_bodies(rewritten):
    layers = 2
    x = random_normal(0, (M, K))
    ws = random_normal(1, (layers, G, K, K))
    cotangent = random_normal(2, (M, K))

    def model(x, ws, sizes):
        def layer(h, w):
            return jnp.tanh(jax.checkpoint(ragged)(h, w, sizes)), None

        return (jax.lax.scan(layer, x, ws)[0] * cotangent).sum()

    expected = jax.jit(jax.value_and_grad(model, argnums=(0, 1)))(x, ws, SIZES)
    optimized = tokamax.optimize(jax.value_and_grad(model, argnums=(0, 1)))
    assert outcomes(optimized, x, ws, SIZES) and all(
        o == REWRITTEN for o in outcomes(optimized, x, ws, SIZES))
    value, grads = optimized(x, ws, SIZES)
    assert_close(value, expected[0])
    for a, e in zip(grads, expected[1], strict=True):
        assert_close(a, e)


def test_the_plan_names_the_pattern_and_its_source_line(rewritten):
    x, w, sizes = operands(jnp.float32)
    plan = tokamax.optimize(ragged).plan(x, w, sizes)
    (match,) = plan.matches
    assert match.pattern == "ragged_dot" and match.path == "ragged_dot"
    assert match.source_line.startswith(f"{__file__}:")
    assert match.source_line.endswith("(ragged)")
    assert "plain-JAX patterns:" in str(plan) and REWRITTEN in str(plan)


# --- selection: only where a kernel is chosen ------------------------------------------

LHS = jax.ShapeDtypeStruct((64 * 96, 2048), jnp.bfloat16)
RHS = jax.ShapeDtypeStruct((64, 2048, 1408), jnp.bfloat16)
GROUPS = jax.ShapeDtypeStruct((64,), jnp.int32)


def h200_plan(f, *args, **options):
    with core.targeting(H200):
        return tokamax.optimize(f, **options).plan(*args)


def test_a_kernel_predicted_faster_replaces_the_ragged_dot(calibration_dir):
    calibrate(calibration_dir, KERNELS_FASTER)
    plan = h200_plan(jax.grad(weighted(ragged, 1.0), argnums=(0, 1)), LHS, RHS, GROUPS)
    assert [row.op for row in plan] == ["PallasTritonRaggedDot"] * 3
    assert [m.outcome for m in plan.matches] == ["rewritten: cuda triton"] * 3


def test_without_a_calibration_the_ragged_dot_is_left_alone():
    plan = h200_plan(ragged, LHS, RHS, GROUPS)
    assert len(plan) == 0
    (match,) = plan.matches
    assert not match.rewritten and match.outcome == (
        "left alone: the plain path is chosen (cuda xla)")


def test_rewrite_false_or_other_patterns_leave_it_alone(calibration_dir):
    calibrate(calibration_dir, KERNELS_FASTER)
    for rewrite_option in (False, ()):
        plan = h200_plan(ragged, LHS, RHS, GROUPS, rewrite=rewrite_option)
        assert len(plan) == 0 and not plan.matches
    plan = h200_plan(ragged, LHS, RHS, GROUPS, rewrite=("ragged_dot",))
    assert [row.op for row in plan] == ["PallasTritonRaggedDot"]
    with pytest.raises(ValueError, match="unknown rewrite patterns"):
        tokamax.optimize(ragged, rewrite=("ragged",))


def test_near_misses_are_left_alone(calibration_dir):
    calibrate(calibration_dir, KERNELS_FASTER)
    numbers = jax.lax.RaggedDotDimensionNumbers(  # lhs is (K, M): rows ragged on axis 1
        (((0,), (1,)), ((), ())), lhs_ragged_dimensions=(1,), rhs_group_dimensions=(0,))

    def transposed(x, w, sizes):
        return jax.lax.ragged_dot_general(x.T, w, sizes, numbers)

    def integer(x, w, sizes):
        return jax.lax.ragged_dot(x.astype(jnp.int8), w.astype(jnp.int8), sizes,
                                  preferred_element_type=jnp.int32)

    for f, reason in ((transposed, "dimension numbers"), (integer, "not both floating")):
        plan = h200_plan(f, LHS, RHS, GROUPS)
        assert len(plan) == 0, f.__name__
        (match,) = plan.matches
        assert not match.rewritten and reason in match.reason


def test_a_near_miss_computes_what_jit_does(rewritten):
    x, w, sizes = operands(jnp.float32)

    def integer(x, w, sizes):
        return jax.lax.ragged_dot(x.astype(jnp.int8), w.astype(jnp.int8), sizes,
                                  preferred_element_type=jnp.int32)

    optimized = tokamax.optimize(integer)
    assert outcomes(optimized, x * 4, w * 4, sizes) == [
        "left alone: operands int8 and int8 are not both floating"]
    np.testing.assert_array_equal(optimized(x * 4, w * 4, sizes),
                                  jax.jit(integer)(x * 4, w * 4, sizes))


def test_export_records_the_rewrites_and_its_cpu_program_computes_the_same(calibration_dir):
    """Kept for the H200's kernel, the rewrite runs the op's `xla` path on CPU."""
    calibrate(calibration_dir, KERNELS_FASTER)
    f = ragged_into(jnp.float32)
    x = random_normal(0, (256, 128), jnp.bfloat16)
    w = random_normal(1, (4, 128, 128), jnp.bfloat16)
    sizes = jnp.array([60, 70, 0, 100], jnp.int32)
    artifact = tokamax.optimize(f).export(x, w, sizes, platforms=["cpu", "cuda"],
                                          device_kind=H200)
    (entry,) = artifact.manifest["rewrites"]
    assert entry["pattern"] == "ragged_dot" and entry["rewritten"]
    assert entry["implementation"] == {"cpu": "xla", "cuda": "triton"}
    assert entry["source_line"].startswith(f"{__file__}:")
    assert [o["op"] for o in artifact.manifest["ops"]] == ["RaggedDot", "PallasTritonRaggedDot"]
    expected = jax.jit(f)(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    assert_close(artifact.exported.call(x, w, sizes), expected, jnp.bfloat16)


def test_autotune_always_measures_a_ragged_dot_left_on_the_plain_path():
    x, w, sizes = operands(jnp.float32)
    optimized = tokamax.optimize(ragged, autotune="always")
    assert_close(optimized(x, w, sizes), jax.jit(ragged)(x, w, sizes))
    (tuned,) = optimized._tuned
    assert {type(ba.op).__name__ for ba, _ in tuned} == {"RaggedDot"}
    assert outcomes(optimized, x, w, sizes) == ["left alone: the plain path is chosen (cpu xla)"]


def test_cond_while_and_custom_vjp_bodies(rewritten):
    x, w, sizes = operands(jnp.float32)
    cotangent = random_normal(2, (M, N))

    @jax.custom_vjp
    def custom(x, w, sizes):
        return ragged(x, w, sizes)

    def custom_fwd(x, w, sizes):
        return ragged(x, w, sizes), (x, w, sizes)

    def custom_bwd(saved, g):
        x, w, sizes = saved
        _, pullback = jax.vjp(lambda x, w: ragged(x, w, sizes), x, w)
        return (*pullback(g), None)

    custom.defvjp(custom_fwd, custom_bwd)

    def model(x, w, sizes):
        branch = jax.lax.cond(x[0, 0] > 0, ragged, lambda *a: 2.0 * ragged(*a), x, w, sizes)
        looped = jax.lax.fori_loop(0, 2, lambda i, h: h + ragged(x, w, sizes), branch)
        return ((looped + custom(x, w, sizes)) * cotangent).sum()

    expected = jax.jit(jax.value_and_grad(model, argnums=(0, 1)))(x, w, sizes)
    forward = tokamax.optimize(model)
    matches = forward.plan(x, w, sizes).matches
    assert [m.path for m in matches] == ["cond/branches0/ragged_dot", "cond/branches1/ragged_dot",
                                         "scan/ragged_dot", "custom_vjp/ragged_dot"]
    assert all(m.rewritten for m in matches)
    optimized = tokamax.optimize(jax.value_and_grad(model, argnums=(0, 1)))
    matches = optimized.plan(x, w, sizes).matches
    assert {"cond/branches0/ragged_dot", "cond/branches1/ragged_dot", "scan/ragged_dot"} <= {
        m.path for m in matches} and all(m.rewritten for m in matches)
    for value, grads in (optimized(x, w, sizes),
                         jax.value_and_grad(forward, argnums=(0, 1))(x, w, sizes)):
        assert_close(value, expected[0])
        for a, e in zip(grads, expected[1], strict=True):
            assert_close(a, e)


def test_a_replicated_out_sharding_is_rewritten_a_split_one_left_alone(calibration_dir):
    """JAX's transposes carry a replicated `out_sharding` under an abstract mesh (the
    gradient of a model planned for the H200 here); one that splits the output is not the
    op's default and stays as written."""
    from jax.sharding import PartitionSpec as P

    from tokamax_pass.passes import patterns

    calibrate(calibration_dir, KERNELS_FASTER)

    def with_spec(spec):
        def f(x, w, sizes):
            return jax.lax.ragged_dot(x, w, sizes, out_sharding=spec)
        return f

    plan = h200_plan(with_spec(P(None, None)), LHS, RHS, GROUPS)
    assert [m.outcome for m in plan.matches] == ["rewritten: cuda triton"]
    split = jax.sharding.NamedSharding(jax.sharding.AbstractMesh((2,), ("x",)), P("x", None))
    assert not patterns._replicated(split) and patterns._replicated(None)
