"""Upstream Tokamax's ragged-dot cases that run on CPU (`RaggedDotTestBase` for the XLA op,
without the quantized grid; the api test's `xla` case; `generate_group_sizes`) run
through `tokamax_pass.ragged_dot`, with upstream's shapes and tolerances. The reference
is `jax.lax.ragged_dot` in float32 at `Precision.HIGHEST`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tokamax_pass as tokamax
from compat._upstream import assert_trees_all_close

HIGHEST = jax.lax.Precision.HIGHEST


def relu(x):
    return jnp.maximum(x, 0)


def _inputs(seed, num_groups, m, k, n, dtype, random_groups=False, std=0.1):
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.normal(0.0, std, (m, k)).astype(np.float32), dtype)
    b = jnp.asarray(rng.normal(0.0, std, (num_groups, k, n)).astype(np.float32), dtype)
    if random_groups:
        group_sizes = jnp.asarray(rng.integers(0, m // num_groups, (num_groups,), np.int32))
    else:
        group_sizes = jnp.array([m // num_groups] * num_groups, jnp.uint32)
    return a, b, group_sizes


def _reference(a, b, group_sizes, activation=None):
    out = jax.lax.ragged_dot(a.astype(jnp.float32), b.astype(jnp.float32),
                             jnp.asarray(group_sizes), precision=HIGHEST,
                             preferred_element_type=jnp.float32)
    return out if activation is None else activation(out)


def _ragged_dot_f32(a, b, group_sizes, **keywords):
    """Upstream's `_dot_fn_f32`: float32 output, HIGHEST for float32 operands."""
    if jnp.result_type(a, b) == jnp.float32:
        keywords.setdefault("precision", HIGHEST)
    return tokamax.ragged_dot(a, b, group_sizes, preferred_element_type=jnp.float32,
                              implementation="xla", **keywords)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_simple(dtype):
    a, b, group_sizes = _inputs(1, 8, 1024, 128, 256, dtype)
    assert_trees_all_close(_ragged_dot_f32(a, b, group_sizes), _reference(a, b, group_sizes))


def test_padded():
    a, b, group_sizes = _inputs(2, 8, 1024, 128, 256, jnp.bfloat16, random_groups=True)
    count = int(group_sizes.sum())
    assert_trees_all_close(_ragged_dot_f32(a, b, group_sizes)[:count],
                           _reference(a, b, group_sizes)[:count])


# Every pattern of empty groups over 8 groups (upstream's subtests) runs with the slow
# set; the default run samples 16 of them: none, all, and every 17th pattern between.
ZERO_GROUP_PATTERNS = {
    "sampled": [0, 255, *range(17, 255, 17)],
    "all": pytest.param(range(2**8), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("patterns", ZERO_GROUP_PATTERNS.values(), ids=ZERO_GROUP_PATTERNS)
def test_zero_group_sizes(patterns):
    a, b, group_sizes = _inputs(3, 8, 1024, 128, 256, jnp.bfloat16, random_groups=True)
    f = jax.jit(_ragged_dot_f32)
    g = jax.jit(_reference)
    for i in patterns:
        sizes = jnp.where(jnp.unpackbits(jnp.uint8(i)), group_sizes, 0)
        count = int(sizes.sum())
        assert_trees_all_close(f(a, b, sizes)[:count], g(a, b, sizes)[:count])


@pytest.mark.parametrize("out_type", [None, jnp.bfloat16, jnp.float32])
def test_preferred_element_type(out_type):
    a, b, group_sizes = _inputs(4, 8, 1024, 128, 256, jnp.bfloat16)
    actual = tokamax.ragged_dot(a, b, group_sizes, preferred_element_type=out_type,
                                implementation="xla")
    assert actual.dtype == (out_type or jnp.bfloat16)
    tolerance = dict(atol=0.01, rtol=0.005) if actual.dtype == jnp.bfloat16 else {}
    assert_trees_all_close(actual, _reference(a, b, group_sizes), **tolerance)


@pytest.mark.exhaustive
@pytest.mark.parametrize("m", [1024, 128])
@pytest.mark.parametrize("k", [128, 64])
@pytest.mark.parametrize("n", [256, 128])
@pytest.mark.parametrize("activation", [None, relu, jax.nn.tanh])
def test_vjp(m, k, n, activation):
    """Upstream's `test_vjp`: bf16 operands with `BF16_BF16_F32`, float32 output, forward
    within 1e-5, gradients within atol 0.02, rtol 0.005."""
    a, b, group_sizes = _inputs(5, 8, m, k, n, jnp.bfloat16)
    f = functools.partial(_ragged_dot_f32, group_sizes=group_sizes, activation=activation,
                          precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32)
    f_ref = functools.partial(_reference, group_sizes=group_sizes, activation=activation)
    a_ref, b_ref = a.astype(jnp.float32), b.astype(jnp.float32)
    actual, pullback = jax.vjp(f, a, b)
    expected, pullback_ref = jax.vjp(f_ref, a_ref, b_ref)
    assert_trees_all_close(actual, expected, atol=1e-5)
    dout = jax.nn.standardize(expected).astype(jnp.bfloat16).astype(jnp.float32)
    assert_trees_all_close(pullback(dout), pullback_ref(dout), atol=0.02, rtol=0.005)


def test_group_sizes():
    """A `RaggedDotGroupSizes` runs as its value."""
    a, b, group_sizes = _inputs(6, 8, 1024, 128, 256, jnp.bfloat16)
    wrapped = tokamax.RaggedDotGroupSizes(group_sizes, (1,) * 8)
    assert_trees_all_close(_ragged_dot_f32(a, b, wrapped), _reference(a, b, group_sizes))


@pytest.mark.parametrize("activation", [None, relu])
def test_basic_api(activation):
    """Upstream's api `test_basic_api` for `xla` (the one that runs on CPU): value and
    gradients of `sum(ragged_dot)` under `jit` match `jax.lax.ragged_dot`'s."""
    k0, k1 = jax.random.split(jax.random.key(0))
    lhs = jax.random.normal(k0, (128, 64), jnp.bfloat16)
    rhs = jax.random.normal(k1, (8, 64, 128), jnp.bfloat16)
    group_sizes = jnp.array([16] * 8, jnp.uint32)

    def summed(dot):
        def f(lhs, rhs):
            out = dot(lhs, rhs)
            return jnp.sum(out if activation is None else activation(out))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    ours = summed(lambda a, b: tokamax.ragged_dot(a, b, group_sizes, implementation="xla"))
    plain = summed(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes))
    assert_trees_all_close(ours(lhs, rhs), plain(lhs, rhs))


@pytest.mark.parametrize(("m", "num_groups", "p"), [(256, 4, None), (16, 64, None),
                                                    (256, 4, (0.1, 0.2, 0.3, 0.4))])
def test_generate_group_sizes(m, num_groups, p):
    sizes = tokamax.generate_ragged_dot_group_sizes(m=m, num_groups=num_groups, p=p)
    assert len(sizes) == num_groups
    assert sum(int(s) for s in sizes) == m


# Upstream's `test_bench` specs: (groups, m, n, k, representative group sizes).
BENCH_SPECS = {  # slow: (8, 4096, 4096) bfloat16 weights; other cases run these paths
    "memory_bound": pytest.param((8, 8, 4096, 4096, [1] * 8), marks=pytest.mark.slow),
    "compute_bound": pytest.param((8, 4096, 4096, 4096, [4096] + [0] * 7),
                                  marks=pytest.mark.slow),
}


@pytest.mark.parametrize("spec", BENCH_SPECS.values(), ids=BENCH_SPECS)
def test_bench(spec):
    """bf16 operands at a benchmark shape, within atol 0.01, rtol 0.005 over the grouped
    rows."""
    num_groups, m, n, k, sizes = spec
    # NumPy draws the operands: `jax.random` at the CPU tests' XLA optimization level 0
    # takes seconds for the (8, 4096, 4096) weights.
    rng = np.random.default_rng(7)
    a, b = (jnp.asarray(rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16))
            for shape in ((m, k), (num_groups, k, n)))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    count = sum(sizes)
    actual = tokamax.ragged_dot(a, b, group_sizes, implementation="xla")
    assert_trees_all_close(actual[:count], _reference(a, b, group_sizes)[:count],
                           atol=0.01, rtol=0.005)


def test_upstream_hints_are_accepted_and_change_nothing():
    """Upstream's `bypass_device_check` and `manual_axis_type`, which user code passes
    (`bypass_device_check=False`, `manual_axis_type=None` in upstream's own test, or the
    operand's `jax.typeof(x).manual_axis_type`): the same result with any value; a value
    of another kind is refused."""
    ka, kb = jax.random.split(jax.random.key(3))
    a = jax.random.normal(ka, (24, 32), jnp.float32)
    b = jax.random.normal(kb, (3, 32, 16), jnp.float32)
    sizes = jnp.asarray([5, 0, 15], jnp.int32)
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    plain = tokamax.ragged_dot(a, b, sizes, precision=HIGHEST)
    general = tokamax.ragged_dot_general(a, b, sizes, numbers, precision=HIGHEST)
    assert_trees_all_close(plain[:20], _reference(a, b, sizes)[:20])
    hints = [{"bypass_device_check": value} for value in (None, False, True)]
    hints += [{"manual_axis_type": value} for value in (None, jax.typeof(a).manual_axis_type)]
    for hint in hints:
        assert_trees_all_close(tokamax.ragged_dot(a, b, sizes, precision=HIGHEST, **hint),
                               plain)
        assert_trees_all_close(tokamax.ragged_dot_general(
            a, b, sizes, numbers, precision=HIGHEST, **hint), general)
    refused = (
        (lambda: tokamax.ragged_dot(a, b, sizes, bypass_device_check="no"),
         "bypass_device_check must be True or False"),
        (lambda: tokamax.ragged_dot_general(a, b, sizes, numbers, bypass_device_check=1),
         "bypass_device_check must be True or False"),
        (lambda: tokamax.ragged_dot(a, b, sizes, manual_axis_type="x"),
         "ragged_dot: manual_axis_type must be None or a jax.sharding.ManualAxisType"),
        (lambda: tokamax.ragged_dot_general(a, b, sizes, numbers, manual_axis_type={}),
         "ragged_dot_general: manual_axis_type must be None"),
    )
    for op, message in refused:
        with pytest.raises(TypeError, match=message):
            op()


def test_manual_axis_type_inside_shard_map():
    """Inside a `shard_map`, given the operand's own manual type as upstream's callers do:
    each shard's product, and an output varying over the mapped axis."""
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("x",))
    ka, kb = jax.random.split(jax.random.key(4))
    a = jax.random.normal(ka, (2, 24, 32), jnp.float32)
    b = jax.random.normal(kb, (3, 32, 16), jnp.float32)
    sizes = jnp.asarray([5, 4, 15], jnp.int32)
    kinds = []

    def shard(a: jax.Array, b: jax.Array, sizes: jax.Array) -> jax.Array:
        out = tokamax.ragged_dot(a[0], b, sizes, precision=HIGHEST,
                                 manual_axis_type=jax.typeof(a).manual_axis_type)
        kinds.append(jax.typeof(out).manual_axis_type.varying)
        return out[None]

    spec = jax.sharding.PartitionSpec
    out = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(spec("x"), spec(), spec()),
                                out_specs=spec("x")))(a, b, sizes)
    assert kinds == [frozenset({"x"})]
    for i in range(2):
        assert_trees_all_close(out[i], _reference(a[i], b, sizes))
