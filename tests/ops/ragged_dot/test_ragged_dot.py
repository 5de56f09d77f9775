"""ragged_dot: the XLA reference against a per-group float64 loop: preferred element types,
gradient variants and their specs, vmap, nested vmap, argument checks, the cuda export; the
cases every implementation shares are in `test_ragged_dot_suite.py`."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import H200, assert_close, random_normal
from tokamax_kernels.ragged_dot.base import RaggedDot, RaggedDotVjp
from tokamax_pass.core import AutodiffVjp

M, K, N = 12, 6, 5
# Uneven groups; empty groups (also first and last) with rows past the sum.
GROUP_SIZES = {
    "uneven": [3, 7, 2],
    "empty_groups_sum_below_m": [0, 4, 0, 3, 0],
}


def _groups(sizes):
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    pairs = zip(starts, sizes, strict=True)
    return [(g, int(s), int(s) + int(n)) for g, (s, n) in enumerate(pairs)]


def ref_forward(lhs, rhs, sizes):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    for g, s, e in _groups(sizes):
        out[s:e] = lhs[s:e] @ rhs[g]
    return out


def ref_dlhs(dout, rhs, sizes):
    dout, rhs = np.asarray(dout, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((dout.shape[0], rhs.shape[1]))
    for g, s, e in _groups(sizes):
        out[s:e] = dout[s:e] @ rhs[g].T
    return out


def ref_drhs(lhs, dout, sizes):
    lhs, dout = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
    out = np.zeros((len(sizes), lhs.shape[1], dout.shape[1]))
    for g, s, e in _groups(sizes):
        out[g] = lhs[s:e].T @ dout[s:e]
    return out


def _inputs(sizes, dtype=jnp.float32):
    lhs = random_normal(0, (M, K), dtype)
    rhs = random_normal(1, (len(sizes), K, N), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _specs(text):
    """Every op spec stamped in lowered StableHLO text, parsed back."""
    payloads = set(re.findall(r'tokamax_pass_spec = "((?:[^"\\]|\\.)*)"', text))
    unescape = lambda s: re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), s)
    return [tokamax.BoundArguments.from_json(unescape(p)) for p in payloads]


def test_preferred_element_type_gives_f32_out_and_input_dtype_grads():
    sizes = GROUP_SIZES["uneven"]
    lhs, rhs, group_sizes = _inputs(sizes, jnp.bfloat16)
    out = tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    assert_close(out, ref_forward(lhs, rhs, sizes), jnp.bfloat16)
    dout = random_normal(2, (M, N))
    dlhs, drhs = jax.grad(
        lambda a, b: jnp.sum(tokamax.ragged_dot(
            a, b, group_sizes, preferred_element_type=jnp.float32) * dout), argnums=(0, 1))(
                lhs, rhs)
    assert dlhs.dtype == jnp.bfloat16 and drhs.dtype == jnp.bfloat16
    assert_close(dlhs, ref_dlhs(dout, rhs, sizes), jnp.bfloat16)
    assert_close(drhs, ref_drhs(lhs, dout, sizes), jnp.bfloat16)


def test_gradients_are_separate_ragged_dot_calls_with_their_own_specs():
    sizes = GROUP_SIZES["empty_groups_sum_below_m"]
    lhs, rhs, group_sizes = _inputs(sizes)
    grad = jax.grad(lambda a, b: tokamax.ragged_dot(a, b, group_sizes).sum(), argnums=(0, 1))
    specs = _specs(jax.jit(grad).lower(lhs, rhs).as_text())
    by_variant = {
        ba.arguments["variant"]: ba for ba in specs
        if isinstance(ba.op, RaggedDot) and "variant" in ba.arguments
    }
    assert set(by_variant) == {"forward", "dlhs", "drhs"}
    g = len(sizes)
    expected = {
        "forward": ((M, K), (g, K, N)),
        "dlhs": ((M, N), (g, K, N)),
        "drhs": ((M, K), (M, N)),
    }
    for variant, (lhs_shape, rhs_shape) in expected.items():
        ba = by_variant[variant]
        assert type(ba.op) is RaggedDot
        assert ba.arguments["lhs"].shape == lhs_shape
        assert ba.arguments["rhs"].shape == rhs_shape
        assert ba.arguments["group_sizes"] == jax.ShapeDtypeStruct((g,), jnp.int32)


def test_forward_spec_parses_back_with_precision_and_dtype():
    lhs, rhs, group_sizes = _inputs(GROUP_SIZES["uneven"])
    text = jax.jit(lambda a, b, gs: tokamax.ragged_dot(
        a, b, gs, precision=jax.lax.Precision.HIGHEST, preferred_element_type="float32",
    )).lower(lhs, rhs, group_sizes).as_text()
    (ba,) = _specs(text)
    assert type(ba.op) is RaggedDot
    assert ba.arguments["precision"] is jax.lax.Precision.HIGHEST
    assert ba.arguments["preferred_element_type"] == np.dtype(np.float32)
    assert ba.arguments["lhs"] == jax.ShapeDtypeStruct((M, K), jnp.float32)
    # The parsed arguments bind again (ShapeDtypeStructs) to the same spec: tunable offline.
    assert RaggedDot().bind(**ba.arguments).to_json() == ba.replace(op=RaggedDot()).to_json()


@pytest.mark.parametrize("variant", ["dlhs", "drhs"])
def test_gradient_variants_called_directly_and_differentiated(variant):
    sizes = GROUP_SIZES["empty_groups_sum_below_m"]
    lhs, w, group_sizes = _inputs(sizes)
    dy = random_normal(3, (M, N))
    if variant == "dlhs":
        a, b, ref = dy, w, ref_dlhs(dy, w, sizes)
    else:
        a, b, ref = lhs, dy, ref_drhs(lhs, dy, sizes)
    op = RaggedDot()
    out = op(a, b, group_sizes, precision="highest", variant=variant)
    assert_close(out, ref)
    # The gradient of each variant is again ragged dots (jax.lax cannot differentiate drhs).
    ct = random_normal(4, out.shape)
    f = lambda a, b: jnp.sum(op(a, b, group_sizes, precision="highest", variant=variant) * ct)
    da, db = jax.grad(f, (0, 1))(a, b)
    if variant == "dlhs":
        want_a, want_b = ref_forward(ct, w, sizes), ref_drhs(ct, dy, sizes)
    else:
        want_a, want_b = ref_dlhs(dy, ct, sizes), ref_forward(lhs, ct, sizes)
    assert_close(da, want_a)
    assert_close(db, want_b)


@pytest.mark.parametrize("in_axes", [(0, None, None), (None, 0, 0)])
def test_vmap_and_vmap_of_grad(in_axes):
    # JAX batches ragged dots only with every operand batched; the reference folds the batch.
    b, g = 3, 3
    lhs = random_normal(0, (b, M, K))
    rhs = random_normal(1, (b, g, K, N))
    group_sizes = jnp.asarray([[3, 7, 2], [0, 12, 0], [5, 0, 1]], jnp.int32)
    args = [x if axis == 0 else x[1] for x, axis in zip((lhs, rhs, group_sizes), in_axes,
                                                        strict=True)]
    dout = random_normal(2, (b, M, N))  # a random cotangent per batch element
    with jax.default_matmul_precision("highest"):
        out = jax.vmap(tokamax.ragged_dot, in_axes)(*args)
        grads = jax.vmap(jax.grad(
            lambda a, b, gs, ct: jnp.sum(tokamax.ragged_dot(a, b, gs) * ct), argnums=(0, 1)),
            (*in_axes, 0))(*args, dout)
    for i in range(b):
        a, w, gs = (x[i] if axis == 0 else x for x, axis in zip(args, in_axes, strict=True))
        gs = np.asarray(gs)
        assert_close(out[i], ref_forward(a, w, gs))
        assert_close(grads[0][i], ref_dlhs(dout[i], w, gs))
        assert_close(grads[1][i], ref_drhs(a, dout[i], gs))


def test_nested_vmap_and_grad_of_vmap():
    lhs = random_normal(0, (2, 2, M, K))
    rhs = random_normal(1, (2, 3, K, N))
    group_sizes = jnp.asarray([[2, 2, 8], [1, 0, 4]], jnp.int32)
    inner = jax.vmap(tokamax.ragged_dot, in_axes=(0, None, None))
    f = jax.vmap(inner, in_axes=(None, 0, 0))
    dout = random_normal(2, (2, 2, M, N))  # random cotangent of out[i, j]
    with jax.default_matmul_precision("highest"):
        out = f(lhs[0], rhs, group_sizes)
        dlhs, drhs = jax.grad(lambda a, b: jnp.sum(f(a, b, group_sizes) * dout),
                              argnums=(0, 1))(lhs[0], rhs)
    for i in range(2):
        gs = np.asarray(group_sizes[i])
        for j in range(2):
            assert_close(out[i, j], ref_forward(lhs[0, j], rhs[i], gs))
        want_drhs = sum(ref_drhs(lhs[0, j], dout[i, j], gs) for j in range(2))
        assert_close(drhs[i], want_drhs)
    for j in range(2):
        want = sum(ref_dlhs(dout[i, j], rhs[i], np.asarray(group_sizes[i])) for i in range(2))
        assert_close(dlhs[j], want)


def test_reference_is_differentiable_by_autodiff_vjp():
    sizes = GROUP_SIZES["empty_groups_sum_below_m"]
    lhs, rhs, group_sizes = _inputs(sizes)
    op = RaggedDot(vjp=AutodiffVjp(forward=RaggedDot()))
    dout = random_normal(2, (M, N))
    dlhs, drhs = jax.grad(lambda a, b: jnp.sum(op(a, b, group_sizes, precision="highest") * dout),
                          argnums=(0, 1))(lhs, rhs)
    assert_close(dlhs, ref_dlhs(dout, rhs, sizes))
    assert_close(drhs, ref_drhs(lhs, dout, sizes))


def test_explicit_implementation_and_custom_vjp_inner():
    sizes = GROUP_SIZES["uneven"]
    lhs, rhs, group_sizes = _inputs(sizes)
    op = RaggedDot(vjp=RaggedDotVjp(inner=RaggedDot()))
    assert RaggedDot().vjp_op() == RaggedDotVjp(inner=RaggedDot())
    out = tokamax.ragged_dot(lhs, rhs, group_sizes, precision="highest", implementation=op)
    assert_close(out, ref_forward(lhs, rhs, sizes))
    dout = random_normal(2, (M, N))
    dlhs = jax.grad(lambda a: jnp.sum(tokamax.ragged_dot(
        a, rhs, group_sizes, precision="highest", implementation=op) * dout))(lhs)
    assert_close(dlhs, ref_dlhs(dout, rhs, sizes))
    with pytest.raises(ValueError, match="unknown implementation"):
        tokamax.ragged_dot(lhs, rhs, group_sizes, implementation="nope")


def test_traced_group_sizes_are_not_checked_at_trace_time():
    lhs, rhs, _ = _inputs([4, 4])
    out = jax.jit(tokamax.ragged_dot)(lhs, rhs, jnp.asarray([6, 6], jnp.int32))
    assert_close(out, ref_forward(lhs, rhs, [6, 6]))


_LHS, _RHS, _GS = (jax.ShapeDtypeStruct((M, K), jnp.float32),
                   jax.ShapeDtypeStruct((3, K, N), jnp.float32),
                   jax.ShapeDtypeStruct((3,), jnp.int32))


@pytest.mark.parametrize("args, kwargs, match", [
    ((jnp.ones((M, K, 1)), _RHS, _GS), {}, "lhs must have rank 2"),
    ((_LHS, jnp.ones((K, N)), _GS), {}, "rhs must have rank 3"),
    ((_LHS, jnp.ones((3, K + 1, N)), _GS), {}, "K mismatch"),
    ((_LHS, _RHS, jnp.ones((4,), jnp.int32)), {}, r"group_sizes must have shape \(3,\)"),
    ((_LHS, _RHS, jnp.ones((3, 1), jnp.int32)), {}, "group_sizes must have rank 1"),
    ((_LHS, _RHS, jnp.ones((3,), jnp.float32)), {}, "group_sizes must be an integer"),
    ((jnp.ones((M, K), bool), _RHS, _GS), {}, "lhs must be a floating-point or integer"),
    ((jnp.ones((M, K), jnp.complex64), _RHS, _GS), {}, "lhs must be a floating-point or"),
    ((_LHS, _RHS, jnp.asarray([2, -1, 3], jnp.int32)), {}, "group_sizes must be >= 0"),
    ((_LHS, _RHS, jnp.asarray([5, 5, 5], jnp.int32)), {}, "sum to 15, more than the 12 rows"),
    ((_LHS, _RHS, _GS), {"preferred_element_type": "notadtype"}, "preferred_element_type must"),
    ((_LHS, _RHS, _GS), {"precision": "ultra"}, "precision must be"),
    ((_LHS, _RHS, _GS), {"precision": ("highest",) * 3}, "precision must be"),
    ((_LHS, _RHS, _GS), {"variant": "dx"}, "variant must be one of"),
    ((jnp.ones((M, N + 1)), _RHS, _GS), {"variant": "dlhs"}, "N mismatch"),
    ((_LHS, jnp.ones((M + 1, N)), _GS), {"variant": "drhs"}, "M mismatch"),
])
def test_bad_arguments_raise_value_errors_naming_them(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        RaggedDot().bind(*args, **kwargs)


def test_public_function_raises_for_bad_input():
    with pytest.raises(ValueError, match="K mismatch"):
        tokamax.ragged_dot(jnp.ones((M, K)), jnp.ones((3, K + 1, N)), jnp.ones((3,), jnp.int32))


@pytest.mark.parametrize("batched", [False, True])
def test_export_for_cuda_lowers_each_gradient_with_a_kernel_that_runs_there(batched):
    # The VJP checks its inner op on both gradients (and their vmaps) before it is chosen.
    # An Auto-axis mesh: under an Explicit one jax.lax.ragged_dot cannot infer shardings.
    mesh = jax.sharding.AbstractMesh(
        (1,), ("_target",), axis_types=(jax.sharding.AxisType.Auto,),
        abstract_device=jax.sharding.AbstractDevice(H200, None, "cuda"))
    grad = jax.grad(lambda a, b, gs: tokamax.ragged_dot(
        a, b, gs, implementation=("mosaic", "triton", "xla")).astype(jnp.float32).sum(),
        argnums=(0, 1))
    lhs = jax.ShapeDtypeStruct((2, 64, 32) if batched else (64, 32), jnp.bfloat16)
    args = (lhs, jax.ShapeDtypeStruct((4, 32, 16), jnp.bfloat16),
            jax.ShapeDtypeStruct((4,), jnp.int32))
    f = jax.vmap(grad, in_axes=(0, None, None)) if batched else grad
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(
            jax.jit(f), platforms=["cuda"], disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS,
        )(*args)
    variants = {ba.arguments.get("variant") for ba in _specs(exported.mlir_module())}
    assert {"forward", "dlhs", "drhs"} <= variants


def test_autotuning_inputs_fill_every_row_unevenly():
    from tokamax_pass.autotuning import timing_inputs

    ba = tokamax.RaggedDot().bind(
        jax.ShapeDtypeStruct((1000, 8), jnp.bfloat16),
        jax.ShapeDtypeStruct((6, 8, 16), jnp.bfloat16),
        jax.ShapeDtypeStruct((6,), jnp.int32))
    arguments = timing_inputs.timing_arguments(ba, seed=3)
    sizes = np.asarray(arguments["group_sizes"])
    assert sizes.sum() == 1000 and (sizes > 0).all() and len(set(sizes.tolist())) > 1
    assert arguments["lhs"].dtype == jnp.bfloat16 and float(jnp.abs(arguments["lhs"]).sum()) > 0
