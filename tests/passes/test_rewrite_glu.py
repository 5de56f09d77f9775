"""`optimize` rewrites gated linear units written in plain JAX, `act(x @ w_gate) *
(x @ w_up)` and the fused `x @ w` split in two (also over `jax.lax.ragged_dot`, MoE
experts: the grouped op), into the `gated_linear_unit` op where
`implementation=None` picks a kernel for it, and leaves near-misses as written.

On CPU the plain path is chosen, so `rewritten` keeps every candidate: values and
gradients of the rewritten program (the op's `xla` path and its VJP) are compared with
`jax.jit` of the user's function, in float32 at HIGHEST precision.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _rewriting import (
    HIGHEST,
    REWRITTEN,
    assert_gradients_match_jit,
    h200_plan,
    op_names,
    outcomes,
    weighted,
)
from conftest import assert_close, calibrate, random_normal

B, T, K, N = 2, 6, 16, 8


def dot(x, w):
    return jnp.matmul(x, w, precision=HIGHEST)


def separate(activation):
    def glu(x, w_gate, w_up):
        return activation(dot(x, w_gate)) * dot(x, w_up)

    glu.__name__ = f"glu_{getattr(activation, '__name__', 'none')}"
    return glu


def up_first(x, w_gate, w_up):
    return dot(x, w_up) * jax.nn.gelu(dot(x, w_gate), approximate=False)


def bilinear(x, w_gate, w_up):
    return dot(x, w_gate) * dot(x, w_up)


def fused_split(x, w):
    gate, up = jnp.split(dot(x, w), 2, axis=-1)
    return jax.nn.swish(gate) * up


def fused_slices_gate_second(x, w):
    h = dot(x, w)
    return h[..., :N] * jax.nn.relu(h[..., N:])


def silu_written_out(x, w_gate, w_up):
    gate = dot(x, w_gate)
    return gate * jax.nn.sigmoid(gate) * dot(x, w_up)


def fused_silu_written_out_sigmoid_first(x, w):
    gate, up = jnp.split(dot(x, w), 2, axis=-1)
    return up * (jax.nn.sigmoid(gate) * gate)


def gemma_gating_einsum(x, w):
    """Gemma's `FeedForward`: weights stacked first, `(2, N, K)` (its transposed
    `gating_einsum`), projected at once and indexed."""
    gate = jnp.einsum("...F,NHF->...NH", x, w, precision=HIGHEST)
    return jax.nn.gelu(gate[..., 0, :]) * gate[..., 1, :]


def stacked_second_up_first(x, w):
    """A `(K, 2, N)` kernel (MaxText's fused MLP), the gate at index 1."""
    h = jnp.einsum("btk,kan->btan", x, w, precision=HIGHEST)
    return h[:, :, 0, :] * jax.nn.silu(h[:, :, 1, :])


def silu_regrouped_with_up(x, w_gate, w_up):
    """`g * (jax.nn.sigmoid(g) * up)`: silu's factors regrouped with the up projection."""
    gate = dot(x, w_gate)
    return gate * (jax.nn.sigmoid(gate) * dot(x, w_up))


def stacked_last(x, w):
    """Gate and up weights stacked on the last axis, `(K, N, 2)`."""
    h = jnp.einsum("...k,knt->...nt", x, w, precision=HIGHEST)
    return jax.nn.silu(h[..., 0]) * h[..., 1]


def stacked_last_silu_written_out(x, w):
    """`h[..., 0] * sigmoid(h[..., 0]) * h[..., 1]`: silu written out on a `(K, N, 2)`
    product, the gate's row sliced once for each of its factors."""
    h = jnp.einsum("...k,knt->...nt", x, w, precision=HIGHEST)
    return h[..., 0] * jax.nn.sigmoid(h[..., 0]) * h[..., 1]


def interleaved_up_first(x, w):
    """`x @ w.reshape(K, 2 * N)` of `(K, N, 2)` weights reshaped back to `(..., N, 2)`:
    gate and up columns interleaved, the gate at index 1."""
    h = dot(x, w.reshape(K, 2 * N)).reshape(*x.shape[:-1], N, 2)
    return h[..., 0] * jax.nn.gelu(h[..., 1])


def activation_in_float32(x, w_gate, w_up):
    """The activation computed in float32 and cast back, `act(g.astype(f32)).astype(g.dtype)`,
    as bfloat16 models write it (a no-op in float32)."""
    gate = dot(x, w_gate)
    return jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * dot(x, w_up)


def activation_and_product_in_float32(x, w_gate, w_up):
    """The activation and the product in float32 (a float32 unit of bfloat16 inputs): the
    op's output is in the inputs' dtype."""
    x, w_gate, w_up = (a.astype(jnp.bfloat16) for a in (x, w_gate, w_up))
    gate, up = dot(x, w_gate).astype(jnp.float32), dot(x, w_up).astype(jnp.float32)
    return jax.nn.silu(gate) * up


SEPARATE = [separate(a) for a in (jax.nn.silu, jax.nn.swish, jax.nn.gelu, jax.nn.relu,
                                  jax.nn.sigmoid)] + [up_first, bilinear, silu_written_out,
                                                      silu_regrouped_with_up]
FUSED = [fused_split, fused_slices_gate_second, fused_silu_written_out_sigmoid_first]
STACKED = {gemma_gating_einsum: (2, N, K), stacked_second_up_first: (K, 2, N),
           stacked_last: (K, N, 2), stacked_last_silu_written_out: (K, N, 2),
           interleaved_up_first: (K, N, 2)}


def operands(f, seed=0):
    x = random_normal(seed, (B, T, K))
    if f in FUSED:
        return x, random_normal(seed + 1, (K, 2 * N))
    if f in STACKED:
        return x, random_normal(seed + 1, STACKED[f])
    return x, random_normal(seed + 1, (K, N)), random_normal(seed + 2, (K, N))


@pytest.mark.parametrize("f", SEPARATE + FUSED + list(STACKED), ids=lambda f: f.__name__)
def test_values_and_gradients_match_jit(rewritten, f):
    args = operands(f)
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, *args) == [REWRITTEN]
    check_the_unit(f, args, random_normal(9, (B, T, N)), tuple(range(len(args))))


@pytest.mark.parametrize("f", [silu_regrouped_with_up, stacked_last, interleaved_up_first,
                               activation_in_float32], ids=lambda f: f.__name__)
def test_bfloat16_values_and_gradients_match_jit(rewritten, f):
    args = tuple(a.astype(jnp.bfloat16) for a in operands(f, seed=3))
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, *args) == [REWRITTEN]
    assert_close(optimized(*args), jax.jit(f)(*args), jnp.bfloat16)
    assert_gradients_match_jit(f, optimized, random_normal(9, (B, T, N)),
                               tuple(range(len(args))), args, dtype=jnp.bfloat16)


def normed_twice(x, scale, w_gate, w_up):
    """The input of each projection normed again (an RMSNorm with float32 statistics cast
    back to the input's dtype), as a model that calls its norm inside each projection
    computes it."""
    def rms(x):
        wide = x.astype(jnp.float32)
        normed = wide * jax.lax.rsqrt(jnp.mean(wide ** 2, -1, keepdims=True) + 1e-6)
        return (normed * scale).astype(x.dtype)
    return jax.nn.gelu(dot(rms(x), w_gate)) * dot(rms(x), w_up)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_projections_of_one_input_computed_twice_are_one_unit(rewritten, dtype):
    x, w_gate, w_up = (a.astype(dtype) for a in operands(separate(jax.nn.gelu), seed=5))
    args = (x, random_normal(6, (K,)), w_gate, w_up)
    optimized = tokamax.optimize(normed_twice)
    assert "GatedLinearUnit" in op_names(optimized, *args)
    assert_close(optimized(*args), jax.jit(normed_twice)(*args), dtype)
    assert_gradients_match_jit(normed_twice, optimized, random_normal(9, (B, T, N)),
                               (0, 1, 2, 3), args, dtype=dtype)


def relu_twice(x, w_gate, w_up):
    """The input of each projection made again by one function (`jax.nn.relu`, a
    `custom_jvp` of a jitted body)."""
    return jax.nn.gelu(dot(jax.nn.relu(x), w_gate)) * dot(jax.nn.relu(x), w_up)


def test_projections_of_one_function_called_twice_are_one_unit(rewritten):
    args = operands(relu_twice, seed=5)
    optimized = tokamax.optimize(relu_twice)
    assert "GatedLinearUnit" in op_names(optimized, *args)
    assert_gradients_match_jit(relu_twice, optimized, random_normal(9, (B, T, N)),
                               (0, 1, 2), args)


def check_the_unit(f, args, cotangent, argnums):
    """`optimize(f)` runs one `GatedLinearUnit` and matches `jax.jit(f)`'s values and its
    gradients in `argnums` under `cotangent`."""
    optimized = tokamax.optimize(f)
    assert op_names(optimized, *args) == ["GatedLinearUnit"]
    assert_close(optimized(*args), jax.jit(f)(*args))
    assert_gradients_match_jit(f, optimized, cotangent, argnums, args)


def test_vmap_scan_and_remat_bodies(rewritten):
    x = random_normal(0, (B, T, K))
    gates, ups = random_normal(1, (3, K, K)), random_normal(2, (3, K, K))
    cotangent = random_normal(3, (B, T, K))
    glu = separate(jax.nn.silu)

    def model(x, gates, ups):
        def layer(h, ws):
            return jax.checkpoint(jax.vmap(glu, (0, None, None)))(h, *ws), None

        return (jax.lax.scan(layer, x, (gates, ups))[0] * cotangent).sum()

    optimized = tokamax.optimize(model)
    matches = optimized.plan(x, gates, ups).matches
    assert [m.path for m in matches] == ["scan/checkpoint/gated_linear_unit"]
    assert all(m.rewritten for m in matches)
    expected = jax.jit(jax.value_and_grad(model, argnums=(0, 1, 2)))(x, gates, ups)
    value, grads = jax.value_and_grad(optimized, argnums=(0, 1, 2))(x, gates, ups)
    assert_close(value, expected[0])
    for actual, wanted in zip(grads, expected[1], strict=True):
        assert_close(actual, wanted)


def test_a_gradient_traced_inside_optimize_runs_the_op_and_its_vjp(rewritten):
    """The plain backward reads the matmuls' values (and JAX splits the activation in a
    forward and a backward part): the unit is rewritten before JAX differentiates it."""
    glu = separate(jax.nn.silu)
    args = operands(glu)
    loss = weighted(glu, random_normal(9, (B, T, N)))
    optimized = tokamax.optimize(jax.grad(loss, argnums=(0, 1, 2)))
    assert outcomes(optimized, *args) == [REWRITTEN]
    assert op_names(optimized, *args)[0] == "GatedLinearUnit"
    for actual, wanted in zip(optimized(*args), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args),
                              strict=True):
        assert_close(actual, wanted)


def tanh_gate(x, w_gate, w_up):
    return jnp.tanh(dot(x, w_gate)) * dot(x, w_up)


def _straight_through_relu():
    """`jax.nn.relu`'s equations (a `custom_jvp` of a jitted `relu`) with another JVP:
    the tangent passed straight through."""
    @jax.custom_jvp
    @jax.jit
    def relu(x):
        return jnp.maximum(x, 0)

    relu.defjvps(lambda tangent, out, x: tangent)
    return relu


STRAIGHT_THROUGH_RELU = _straight_through_relu()


def straight_through_relu_gate(x, w_gate, w_up):
    return STRAIGHT_THROUGH_RELU(dot(x, w_gate)) * dot(x, w_up)


def relu_and_straight_through_relu_inputs(x, w_gate, w_up):
    """The projections' inputs one value computed by two functions that differentiate it
    differently (`jax.nn.relu` and a straight-through relu of the same equations)."""
    return jax.nn.silu(dot(jax.nn.relu(x), w_gate)) * dot(STRAIGHT_THROUGH_RELU(x), w_up)


def _scaled_by(constant):
    """A jitted function closing over `constant`: its equation prints as any other's."""
    return jax.jit(lambda x: x * constant)


SCALED_BY_ONES = _scaled_by(np.ones(K, np.float32))
SCALED_BY_TWOS = _scaled_by(np.full(K, 2.0, np.float32))


def inputs_scaled_by_two_closed_over_constants(x, w_gate, w_up):
    """The projections' inputs scaled by two jitted functions of other constants."""
    return jax.nn.silu(dot(SCALED_BY_ONES(x), w_gate)) * dot(SCALED_BY_TWOS(x), w_up)


def gate_and_up_at_different_precisions(x, w_gate, w_up):
    """The op takes one precision for both products."""
    return jax.nn.silu(dot(x, w_gate)) * jnp.matmul(x, w_up, precision="default")


def two_inputs(x, w_gate, w_up):
    return jax.nn.silu(dot(x, w_gate)) * dot(jnp.flip(x, 0), w_up)


def uneven_halves(x, w):
    h = dot(x, w)
    return jax.nn.silu(h[..., :N - 1]) * h[..., N + 1:]


def every_other_column_of_the_halves(x, w):
    """Slices with the halves' bounds but a stride of 2: half of each half's columns."""
    h = dot(x, w)
    return jax.nn.silu(h[..., :N:2]) * h[..., N::2]


def one_half_times_its_own_sigmoid(x, w):
    """`sigmoid(a) * a` of the first half, the second half unused: no gate and up."""
    a, _ = jnp.split(dot(x, w), 2, axis=-1)
    return jax.nn.sigmoid(a) * a + 1.0


def float32_from_bfloat16(x, w_gate, w_up):
    x, w_gate, w_up = (a.astype(jnp.bfloat16) for a in (x, w_gate, w_up))
    gate = jnp.matmul(x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.matmul(x, w_up, preferred_element_type=jnp.float32)
    return jax.nn.silu(gate) * up


def one_stacked_row_twice(x, w):
    """`act(h[..., 0, :]) * h[..., 0, :]`: the gate's row again, no up projection."""
    h = jnp.einsum("btk,kan->btan", x, w, precision=HIGHEST)
    return jax.nn.silu(h[:, :, 0, :]) * h[:, :, 0, :]


def quick_gelu_regrouped_with_up(x, w_gate, w_up):
    """`g * (jax.nn.sigmoid(1.702 * g) * up)`: Hugging Face's `quick_gelu` regrouped, no
    silu."""
    gate = dot(x, w_gate)
    return gate * (jax.nn.sigmoid(1.702 * gate) * dot(x, w_up))


def three_stacked_last(x, w):
    """`(K, N, 3)` weights stacked last, two of the three outputs used."""
    h = jnp.einsum("...k,knt->...nt", x, w, precision=HIGHEST)
    return jax.nn.silu(h[..., 0]) * h[..., 2]


def silu_written_out_of_two_stacked_rows(x, w):
    """`h[..., 0] * sigmoid(h[..., 2]) * h[..., 1]`: the sigmoid of another row than the
    one it multiplies, no silu."""
    h = jnp.einsum("...k,knt->...nt", x, w, precision=HIGHEST)
    return h[..., 0] * jax.nn.sigmoid(h[..., 2]) * h[..., 1]


@pytest.mark.parametrize("f,reason", [
    (tanh_gate, None), (quick_gelu_regrouped_with_up, None), (three_stacked_last, None),
    (silu_written_out_of_two_stacked_rows, None),
    (straight_through_relu_gate, None), (relu_and_straight_through_relu_inputs, None),
    (inputs_scaled_by_two_closed_over_constants, None), (two_inputs, None),
    (gate_and_up_at_different_precisions, None),
    (uneven_halves, None),
    (every_other_column_of_the_halves, None),
    (one_half_times_its_own_sigmoid, None), (one_stacked_row_twice, None),
    (float32_from_bfloat16, "the op's output shapes or dtypes differ"),
    (activation_and_product_in_float32, None),
], ids=lambda p: getattr(p, "__name__", ""))
def test_near_misses_are_left_as_written(rewritten, f, reason):
    args = operands(fused_split if f in (uneven_halves, every_other_column_of_the_halves,
                                         one_half_times_its_own_sigmoid) else
                    stacked_second_up_first if f is one_stacked_row_twice else f)
    if f in (three_stacked_last, silu_written_out_of_two_stacked_rows):
        args = (args[0], random_normal(1, (K, N, 3)))
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, *args) == ([] if reason is None else [f"left alone: {reason}"])
    assert op_names(optimized, *args) == []
    assert_close(optimized(*args), jax.jit(f)(*args))


# --- MoE experts: units over ragged dots ----------------------------------------------

M, G = 12, 3
GROUP_SIZES = (3, 4, 3)  # two rows past the groups: zeros in both


def ragged(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes, precision=HIGHEST)


def moe_swiglu(x, w_gate, w_up, sizes):
    return jax.nn.silu(ragged(x, w_gate, sizes)) * ragged(x, w_up, sizes)


def moe_fused_gelu(x, w, sizes):
    gate, up = jnp.split(ragged(x, w, sizes), 2, axis=-1)
    return jax.nn.gelu(gate) * up


def moe_fused_up_first(x, w, sizes):
    h = ragged(x, w, sizes)
    return h[:, :N] * jax.nn.silu(h[:, N:])


def moe_operands(f, dtype=jnp.float32, seed=0):
    x = random_normal(seed, (M, K), dtype)
    sizes = jnp.array(GROUP_SIZES, jnp.int32)
    if f is moe_swiglu or f is moe_float32_products or f is moe_two_group_sizes:
        return (x, random_normal(seed + 1, (G, K, N), dtype),
                random_normal(seed + 2, (G, K, N), dtype), sizes)
    return x, random_normal(seed + 1, (G, K, 2 * N), dtype), sizes


def moe_float32_products(x, w_gate, w_up, sizes):
    """Products kept in float32 from bfloat16 operands: the op rounds them to bfloat16."""
    gate = jax.lax.ragged_dot(x, w_gate, sizes, preferred_element_type=jnp.float32)
    up = jax.lax.ragged_dot(x, w_up, sizes, preferred_element_type=jnp.float32)
    return jax.nn.silu(gate) * up


def moe_two_group_sizes(x, w_gate, w_up, sizes):
    return jax.nn.silu(ragged(x, w_gate, sizes)) * ragged(x, w_up, sizes[::-1])


def patterns_matched(optimized, *args):
    return [(m.pattern, m.rewritten) for m in optimized.plan(*args).matches]


@pytest.mark.parametrize("f", [moe_swiglu, moe_fused_gelu, moe_fused_up_first],
                         ids=lambda f: f.__name__)
def test_a_moe_unit_over_ragged_dots_is_one_grouped_unit(rewritten, f):
    """The unit's ragged dots are the grouped unit's, not the `ragged_dot` pattern's."""
    args = moe_operands(f)
    assert patterns_matched(tokamax.optimize(f), *args) == [("gated_linear_unit", True)]
    check_the_unit(f, args, random_normal(9, (M, N)), tuple(range(len(args) - 1)))


def test_a_moe_unit_in_bfloat16_and_inside_value_and_grad(rewritten):
    """Both products rounded to bfloat16, as the plain code rounds them; the gradient
    traced inside `optimize` runs the op's VJP, and the ragged dots JAX leaves dead in
    the differentiated program are no matches."""
    args = moe_operands(moe_swiglu, jnp.bfloat16, seed=4)
    step = jax.value_and_grad(weighted(moe_swiglu, random_normal(9, (M, N))),
                              argnums=(0, 1, 2))
    optimized = tokamax.optimize(step)
    assert [(m.path, m.rewritten) for m in optimized.plan(*args).matches] == [
        ("vjp/gated_linear_unit", True)]
    expected, actual = jax.jit(step)(*args), optimized(*args)
    assert_close(actual[0], expected[0], jnp.bfloat16)
    for got, wanted in zip(actual[1], expected[1], strict=True):
        assert_close(got, wanted, jnp.bfloat16)


@pytest.mark.parametrize("f", [moe_float32_products, moe_two_group_sizes],
                         ids=lambda f: f.__name__)
def test_moe_near_misses_leave_the_ragged_dots_to_their_pattern(rewritten, f):
    args = moe_operands(f, jnp.bfloat16)
    optimized = tokamax.optimize(f)
    assert patterns_matched(optimized, *args) == [("ragged_dot", True)] * 2
    assert_close(optimized(*args), jax.jit(f)(*args), jnp.bfloat16)


def test_a_moe_unit_left_as_written_leaves_its_ragged_dots_to_their_pattern(monkeypatch):
    """Where the rule keeps the plain unit, each ragged dot is decided on its own."""
    from tokamax_pass.passes import rewrite

    monkeypatch.setattr(rewrite, "rewrite_wins", lambda chosen: all(
        type(ba.op).__name__ != "GatedLinearUnit" for ba in chosen))
    args = moe_operands(moe_swiglu)
    optimized = tokamax.optimize(moe_swiglu)
    assert patterns_matched(optimized, *args) == [
        ("gated_linear_unit", False), ("ragged_dot", True), ("ragged_dot", True)]
    assert_close(optimized(*args), jax.jit(moe_swiglu)(*args))


# --- selection: only where a kernel is chosen ------------------------------------------

X = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16)
W = jax.ShapeDtypeStruct((4096, 14336), jnp.bfloat16)
KERNELS_FASTER = {"PallasTritonGatedLinearUnit": 0.8, "PallasMosaicGpuGatedLinearUnit": 0.7,
                  "GatedLinearUnit": 0.05}


def swiglu(x, w_gate, w_up):
    return jax.nn.silu(x @ w_gate) * (x @ w_up)


def test_a_kernel_predicted_faster_replaces_the_unit(calibration_dir):
    calibrate(calibration_dir, KERNELS_FASTER)
    plan = h200_plan(swiglu, X, W, W)
    assert len(plan) == 1 and plan[0].op != "GatedLinearUnit"
    (match,) = plan.matches
    assert match.rewritten and match.implementation["cuda"] != "xla"
    assert match.source_line.endswith("(swiglu)")


def test_without_evidence_for_a_kernel_the_unit_stays(calibration_dir):
    calibrate(calibration_dir, {name: 0.05 for name in KERNELS_FASTER} | {
        "GatedLinearUnit": 0.8})
    plan = h200_plan(swiglu, X, W, W)
    assert len(plan) == 0
    assert [m.outcome for m in plan.matches] == [
        "left alone: the plain path is chosen (cuda xla)"]


def test_rewrite_option_selects_the_pattern(calibration_dir):
    calibrate(calibration_dir, KERNELS_FASTER)
    for option in (False, ("layer_norm",)):
        plan = h200_plan(swiglu, X, W, W, rewrite=option)
        assert len(plan) == 0 and not plan.matches
    assert len(h200_plan(swiglu, X, W, W, rewrite=("gated_linear_unit",))) == 1
