"""Every op exports with `jax.export` when its batch and sequence dimensions are symbolic
(`jax.export.symbolic_shape`), as upstream Tokamax's XLA implementations do, and the
deserialized program reproduces the op's value and gradient at concrete shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from compat._upstream import assert_trees_all_close, random_arrays

B, S, H, D, V = 2, 16, 4, 32, 40


def _attention(q, k, v, bias):
    return tokamax.dot_product_attention(q, k, v, bias=bias, implementation="xla")


def _layer_norm(x, scale, offset):
    return tokamax.layer_norm(x, scale, offset, scale_offset=1.0, implementation="xla")


def _glu(x, weights):
    return tokamax.gated_linear_unit(x, weights, activation=jax.nn.swish, implementation="xla")


def _cross_entropy(x, weights, labels):
    return tokamax.linear_softmax_cross_entropy_loss(x, labels, weights, implementation="xla")


def _ragged_dot(lhs, rhs, group_sizes):
    return tokamax.ragged_dot(lhs, rhs, group_sizes, implementation="xla")


# name -> (function, [(shape with "b"/"s" for the symbolic dims, dtype)], differentiated
# argument count)
CASES = {
    "dot_product_attention": (_attention, [
        (("b", "s", H, D), jnp.bfloat16), (("b", "s", H, D), jnp.bfloat16),
        (("b", "s", H, D), jnp.bfloat16), (("b", H, 1, "s"), jnp.bfloat16)], 3),
    "layer_norm": (_layer_norm, [
        (("b", "s", D), jnp.float32), ((D,), jnp.float32), ((D,), jnp.float32)], 3),
    "gated_linear_unit": (_glu, [(("b", "s", D), jnp.float32), ((D, 2, D), jnp.float32)], 2),
    "linear_softmax_cross_entropy_loss": (_cross_entropy, [
        (("b", "s", D), jnp.float32), ((D, V), jnp.float32), (("b", "s"), jnp.int32)], 2),
    "ragged_dot": (_ragged_dot, [
        (("s", D), jnp.float32), ((3, D, D), jnp.float32), ((3,), jnp.int32)], 2),
}


def _concrete(shape):
    return tuple({"b": B, "s": S}.get(d, d) for d in shape)


def _inputs(specs):
    inputs = []
    for seed, (shape, dtype) in enumerate(specs):
        shape = _concrete(shape)
        if shape == (3,):  # ragged_dot's group sizes, summing to the row count
            inputs.append(jnp.array([5, 0, S - 5], jnp.int32))
        elif jnp.issubdtype(dtype, jnp.integer):
            inputs.append(jax.random.randint(jax.random.key(seed), shape, 0, V))
        else:
            inputs.append(*random_arrays(seed, (shape, dtype)))
    return inputs


@pytest.mark.parametrize("name", sorted(CASES))
def test_export_with_symbolic_batch_and_sequence(name):
    fn, specs, n_diff = CASES[name]

    def value_and_grads(*args):
        out, pullback = jax.vjp(lambda *d: fn(*d, *args[n_diff:]), *args[:n_diff])
        cotangent = jax.random.normal(jax.random.key(7), out.shape, jnp.float32)
        return out, pullback(cotangent.astype(out.dtype))

    inputs = _inputs(specs)
    expected = jax.jit(value_and_grads)(*inputs)
    b, s = jax.export.symbolic_shape("b, s")
    symbolic = [jax.ShapeDtypeStruct(tuple({"b": b, "s": s}.get(d, d) for d in shape), dtype)
                for shape, dtype in specs]
    exported = jax.export.export(jax.jit(value_and_grads))(*symbolic)
    rehydrated = jax.export.deserialize(exported.serialize())
    tolerance = 2e-2 if specs[0][1] == jnp.bfloat16 else 1e-5
    assert_trees_all_close(jax.jit(rehydrated.call)(*inputs), expected,
                           atol=tolerance, rtol=tolerance)


def test_an_implementation_needing_known_shapes_moves_on():
    """Kernels and chunked implementations need every dimension known: named alone, one
    raises `NotImplementedError` (upstream: 'all implementations failed'); in a sequence,
    the XLA reference after it runs."""
    b, s = jax.export.symbolic_shape("b, s")
    x = jax.ShapeDtypeStruct((b, s, H, D), jnp.float32)

    def export(implementation):
        return jax.export.export(jax.jit(lambda q: tokamax.dot_product_attention(
            q, q, q, implementation=implementation)))(x)

    with pytest.raises(NotImplementedError, match="symbolic"):
        export("xla_chunked")
    assert export(("xla_chunked", "xla")).out_avals[0].shape[:2] == (b, s)


@pytest.mark.parametrize("op", ["ragged_dot", "grouped_gated_linear_unit"])
def test_concrete_group_sizes_with_a_symbolic_row_count(op):
    """Group sizes known at trace time (a constant the function closes over) with a
    symbolic row count: their total cannot be compared with the rows, so it is left to
    run time as for traced sizes; the exported program gives the op's value."""
    group_sizes = jnp.array([8, 0, 10], jnp.int32)
    rows = int(group_sizes.sum())
    if op == "ragged_dot":
        weights = random_arrays(1, ((3, 64, 128), jnp.float32))[0]

        def fn(lhs):
            return tokamax.ragged_dot(lhs, weights, group_sizes)
    else:
        weights = random_arrays(1, ((3, 64, 2, 32), jnp.float32))[0]

        def fn(lhs):
            return tokamax.gated_linear_unit(lhs, weights, group_sizes=group_sizes,
                                             activation=jax.nn.swish)
    (m,) = jax.export.symbolic_shape("m")
    exported = jax.export.export(
        jax.jit(lambda lhs: fn(lhs).sum()),
        disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS,
    )(jax.ShapeDtypeStruct((m, 64), jnp.float32))
    lhs = random_arrays(2, ((rows, 64), jnp.float32))[0]
    assert_trees_all_close(exported.call(lhs), jax.jit(lambda x: fn(x).sum())(lhs),
                           atol=1e-3, rtol=1e-5)
