"""moe_dispatch / moe_combine: against a per-token float64 loop, forward and gradients,
through a ragged dot, with dropped copies; their gradients gather (no scatter-add)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal

NUM_EXPERTS = 5


def _expert_ids(seed: int, tokens_shape: tuple[int, ...], top_k: int, *, dropped: bool
                ) -> jax.Array:
    """Random experts per token (distinct within a token, as top-k gives them); with
    `dropped`, some copies get -1 or NUM_EXPERTS (out of range: dropped)."""
    rng = np.random.default_rng(seed)
    tokens = int(np.prod(tokens_shape))
    ids = np.stack([rng.permutation(NUM_EXPERTS)[:top_k] for _ in range(tokens)])
    if dropped:
        ids[rng.random(ids.shape) < 0.2] = -1
        ids[rng.random(ids.shape) < 0.1] = NUM_EXPERTS
    return jnp.asarray(ids.reshape(tokens_shape + (top_k,)), jnp.int32)


def _reference(x, expert_ids, w, weights):
    """float64, per token: sum over its kept experts e_j of weights_j * (x @ w[e_j])."""
    x, w, weights = (np.asarray(a, np.float64) for a in (x, w, weights))
    ids = np.asarray(expert_ids)
    flat_x, flat_ids = x.reshape(-1, x.shape[-1]), ids.reshape(-1, ids.shape[-1])
    flat_weights = weights.reshape(flat_ids.shape)
    out = np.zeros((flat_x.shape[0], w.shape[2]))
    for t, (row, experts) in enumerate(zip(flat_x, flat_ids, strict=True)):
        for j, e in enumerate(experts):
            if 0 <= e < NUM_EXPERTS:
                out[t] += flat_weights[t, j] * (row @ w[e])
    return out.reshape(x.shape[:-1] + (w.shape[2],))


def _moe(x, w, weights, expert_ids):
    rows, group_sizes, routing = tokamax.moe_dispatch(x, expert_ids, NUM_EXPERTS)
    expert_out = tokamax.ragged_dot(rows, w, group_sizes, implementation="xla",
                                    preferred_element_type=x.dtype)
    return tokamax.moe_combine(expert_out, routing, weights)


@pytest.mark.parametrize("tokens_shape, top_k, dropped, dtype", [
    ((2, 13), 2, False, jnp.bfloat16), ((2, 3, 7), 3, True, jnp.float32),
    ((37,), 1, True, jnp.bfloat16)])
def test_through_a_ragged_dot_matches_the_per_token_reference(tokens_shape, top_k, dropped,
                                                              dtype):
    """Forward and every gradient (x, the expert weights, the routing weights) against
    float64 on random inputs and a random cotangent."""
    width, n = 24, 16
    x = random_normal(0, tokens_shape + (width,), dtype)
    w = random_normal(1, (NUM_EXPERTS, width, n), dtype) / width ** 0.5
    weights = jax.nn.softmax(random_normal(2, tokens_shape + (top_k,)), -1).astype(dtype)
    ids = _expert_ids(3, tokens_shape, top_k, dropped=dropped)
    dout = random_normal(4, tokens_shape + (n,), dtype)

    def value_and_pullback(x, w, weights, dout):
        out, pullback = jax.vjp(lambda x, w, g: _moe(x, w, g, ids), x, w, weights)
        return out, pullback(dout)

    # One compiled program each for the op's output and gradients and the reference's.
    out, grads = jax.jit(value_and_pullback)(x, w, weights, dout)
    assert out.dtype == dtype
    assert_close(out, _reference(x, ids, w, weights), dtype)

    def reference_loss(x, w, weights):
        return jnp.sum(_reference_jnp(x, ids, w, weights) * dout.astype(jnp.float64))

    with jax.enable_x64():
        expected = jax.jit(jax.grad(reference_loss, argnums=(0, 1, 2)))(
            *(jnp.asarray(np.asarray(a, np.float64)) for a in (x, w, weights)))
    for name, got, want in zip(("x", "w", "weights"), grads, expected, strict=True):
        assert got.dtype == dtype, name
        assert_close(got, want, dtype)


def _reference_jnp(x, expert_ids, w, weights):
    """The per-token reference as a differentiable dense expression (float64 under x64):
    every expert's output, masked to the kept ones."""
    kept = (expert_ids >= 0) & (expert_ids < NUM_EXPERTS)
    onehot = jax.nn.one_hot(jnp.where(kept, expert_ids, 0), NUM_EXPERTS, dtype=x.dtype)
    gates = jnp.sum(onehot * (weights * kept)[..., None], axis=-2)  # (..., E)
    every = jnp.einsum("...k,ekn->...en", x, w)
    return jnp.einsum("...en,...e->...n", every, gates)


def test_dispatch_sorts_copies_stably_and_counts_the_kept_ones():
    x = random_normal(0, (2, 9, 4))
    ids = _expert_ids(1, (2, 9), 2, dropped=True)
    rows, group_sizes, routing = tokamax.moe_dispatch(x, ids, NUM_EXPERTS)
    flat_ids = np.asarray(ids).reshape(-1)
    key = np.where((flat_ids >= 0) & (flat_ids < NUM_EXPERTS), flat_ids, NUM_EXPERTS)
    order = np.argsort(key, kind="stable")
    np.testing.assert_array_equal(routing.order, order)
    np.testing.assert_array_equal(routing.inverse, np.argsort(order))
    assert int(routing.kept) == int((key < NUM_EXPERTS).sum())
    np.testing.assert_array_equal(rows, np.asarray(x).reshape(-1, 4)[order // 2])
    np.testing.assert_array_equal(group_sizes, np.bincount(key, minlength=NUM_EXPERTS + 1)
                                  [:NUM_EXPERTS])
    assert group_sizes.dtype == jnp.int32


def test_dispatch_takes_a_numpy_integer_expert_count():
    """`num_experts` read from a NumPy config (np.int64) routes as the Python int."""
    x = random_normal(0, (2, 9, 4))
    ids = _expert_ids(1, (2, 9), 2, dropped=True)
    expected = tokamax.moe_dispatch(x, ids, NUM_EXPERTS)
    got = tokamax.moe_dispatch(x, ids, np.int64(NUM_EXPERTS))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="num_experts must be a Python int"):
        tokamax.moe_dispatch(x, ids, np.bool_(True))


@pytest.mark.parametrize("dtype, num_experts", [(jnp.uint8, 256), (jnp.int8, 300),
                                                 (jnp.uint8, 200), (jnp.int16, 40000)])
def test_narrow_expert_ids_route_as_int32_ones(dtype, num_experts):
    """Ids whose dtype cannot hold `num_experts` (uint8 ids, 256 experts) compared with
    `num_experts` wrapped (to 0): every copy was dropped or sent to expert 0, silently."""
    rng = np.random.default_rng(3)
    high = min(num_experts, int(jnp.iinfo(dtype).max) + 1)
    ids = rng.integers(0, high, size=(2, 11, 3))
    if jnp.iinfo(dtype).min < 0:
        ids[rng.random(ids.shape) < 0.2] = -1  # dropped copies stay dropped
    x = random_normal(4, (2, 11, 8))
    want = tokamax.moe_dispatch(x, jnp.asarray(ids, jnp.int32), num_experts)
    got = tokamax.moe_dispatch(x, jnp.asarray(ids, dtype), num_experts)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_gradients_are_gathers_and_equal_the_plain_expression():
    """The point of the functions: no floating scatter-add in the gradient program, and the same
    values as autodiff of the plain expression (`x[order // k]`, `.at[order].set`)."""
    x = random_normal(0, (16, 8), jnp.bfloat16)
    ids = _expert_ids(1, (16,), 2, dropped=False)
    expert_out = random_normal(2, (32, 8), jnp.bfloat16)
    weights = random_normal(3, (16, 2), jnp.bfloat16)
    cotangents = (random_normal(4, (32, 8), jnp.bfloat16), random_normal(5, (16, 8),
                                                                          jnp.bfloat16))

    def ours(x, expert_out, weights):
        rows, _, routing = tokamax.moe_dispatch(x, ids, NUM_EXPERTS)
        return rows, tokamax.moe_combine(expert_out, routing, weights)

    def plain(x, expert_out, weights):
        order = jnp.argsort(ids.reshape(-1))
        out = jnp.zeros_like(expert_out).at[order].set(expert_out).reshape(16, 2, 8)
        combined = jnp.sum(out.astype(jnp.float32) * weights[..., None].astype(jnp.float32), 1)
        return x[order // 2], combined.astype(x.dtype)

    def scatter_adds(f) -> int:
        program = jax.jit(lambda *a: jax.vjp(f, *a)[1](cotangents)).lower(
            x, expert_out, weights).as_text()
        return sum("stablehlo.add" in body and ("tensor<f" in body or "tensor<bf16" in body)
                   for body in _scatter_bodies(program))

    assert scatter_adds(plain) > 0  # what the check looks for is there to find
    assert scatter_adds(ours) == 0
    got = jax.vjp(ours, x, expert_out, weights)
    want = jax.vjp(plain, x, expert_out, weights)
    for a, b in zip(jax.tree.leaves((got[0], got[1](cotangents))),
                    jax.tree.leaves((want[0], want[1](cotangents))), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _scatter_bodies(program: str) -> list[str]:
    """The text of every scatter op in a StableHLO program, its update computation
    included."""
    bodies, rest = [], program
    while "stablehlo.scatter" in rest:
        rest = rest[rest.index("stablehlo.scatter"):]
        end = rest.index("})")
        bodies.append(rest[:end])
        rest = rest[end:]
    return bodies


def _bad_calls():
    x, ids = random_normal(0, (6, 4)), _expert_ids(1, (6,), 2, dropped=False)
    rows, _, routing = tokamax.moe_dispatch(x, ids, NUM_EXPERTS)
    weights = random_normal(2, (6, 2))
    return {
        "x rank 1": (lambda: tokamax.moe_dispatch(x[0], ids, NUM_EXPERTS), "x must have rank"),
        "integer x": (lambda: tokamax.moe_dispatch(ids, ids, NUM_EXPERTS), "x must"),
        "float ids": (lambda: tokamax.moe_dispatch(x, x[:, :2], NUM_EXPERTS),
                      "expert_ids must be an integer array"),
        "ids of other tokens": (lambda: tokamax.moe_dispatch(x, ids[:5], NUM_EXPERTS),
                                "expert_ids must have shape"),
        "traced num_experts": (lambda: tokamax.moe_dispatch(x, ids, jnp.int32(5)),
                               "num_experts must be a Python int"),
        "zero experts": (lambda: tokamax.moe_dispatch(x, ids, 0), "num_experts must"),
        "routing of another kind": (lambda: tokamax.moe_combine(rows, routing.order, weights),
                                    "routing must be the MoeRouting"),
        "rows not per copy": (lambda: tokamax.moe_combine(rows[:-1], routing, weights),
                              "expert_out must have one row per token copy"),
        "expert_out rank 3": (lambda: tokamax.moe_combine(rows[None], routing, weights),
                              "expert_out must have rank 2"),
        "weights per token only": (lambda: tokamax.moe_combine(rows, routing, weights[:, 0]),
                                   "weights must have shape"),
        "integer weights": (lambda: tokamax.moe_combine(rows, routing, ids), "weights must"),
        # A list or a float: AttributeError ('list' object has no attribute 'dtype').
        "weights a list": (lambda: tokamax.moe_combine(rows, routing, [[1.0, 1.0]] * 6),
                           "weights must be an array, got list"),
        # Zero-sized axes: ZeroDivisionError from NumPy's reshape(-1, top_k, ...).
        "no expert per token": (lambda: tokamax.moe_dispatch(x, ids[:, :0], NUM_EXPERTS),
                                "each token must choose at least one expert"),
        "no features": (lambda: tokamax.moe_dispatch(x[:, :0], ids, NUM_EXPERTS),
                        "W >= 1"),
        "no output columns": (lambda: tokamax.moe_combine(rows[:, :0], routing, weights),
                              "with N >= 1"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_names_the_argument(case):
    call, message = _bad_calls()[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_dropped_copies_add_nothing_whatever_the_experts_wrote():
    """Past `sum(group_sizes)` a ragged dot writes zeros, but an expert computation that
    adds a bias (or anything else) must not leak into the combined tokens."""
    x = random_normal(0, (2, 9, 4))
    ids = _expert_ids(1, (2, 9), 3, dropped=True)
    weights = random_normal(2, (2, 9, 3))
    rows, _, routing = tokamax.moe_dispatch(x, ids, NUM_EXPERTS)
    expert_out = rows + 1.0  # nonzero everywhere, the dropped rows too
    (out, pullback) = jax.vjp(lambda e, w: tokamax.moe_combine(e, routing, w), expert_out,
                              weights)
    kept = np.asarray((ids >= 0) & (ids < NUM_EXPERTS))
    expected = np.einsum("btkn,btk->btn", (np.asarray(x) + 1.0)[:, :, None, :]
                         * np.ones((1, 1, 3, 1)), np.asarray(weights) * kept)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    d_expert_out, d_weights = pullback(random_normal(3, out.shape))
    assert not np.asarray(d_weights)[~kept].any()
    assert not np.asarray(d_expert_out)[int(routing.kept):].any()


def test_under_vmap_and_jit():
    """A leading mapped axis (say, per-device shards under `jax.vmap`) gives each slice's
    own routing."""
    x = random_normal(0, (3, 10, 4))
    ids = _expert_ids(1, (3, 10), 2, dropped=True)
    weights = random_normal(2, (3, 10, 2))

    def route_and_combine(x, ids, weights):
        rows, group_sizes, routing = tokamax.moe_dispatch(x, ids, NUM_EXPERTS)
        return tokamax.moe_combine(rows * 2.0, routing, weights), group_sizes

    mapped, sizes = jax.jit(jax.vmap(route_and_combine))(x, ids, weights)
    for i in range(3):
        one, one_sizes = route_and_combine(x[i], ids[i], weights[i])
        np.testing.assert_allclose(mapped[i], one, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(sizes[i], one_sizes)


def test_optimize_and_export_for_every_platform():
    """An MoE layer through the routing functions and `ragged_dot`: `optimize` gives jit's
    gradients, and `jax.export` lowers it for CPU, CUDA and TPU from this machine."""
    x = random_normal(0, (2, 8, 16))
    w = random_normal(1, (NUM_EXPERTS, 16, 8)) / 4.0
    weights = random_normal(2, (2, 8, 2))
    ids = _expert_ids(3, (2, 8), 2, dropped=True)

    def loss(x, w, weights):
        return jnp.sum(_moe(x, w, weights, ids) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    for got, want in zip(tokamax.optimize(grad)(x, w, weights), jax.jit(grad)(x, w, weights),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    exported = jax.export.export(jax.jit(grad), platforms=["cpu", "cuda", "tpu"])(
        x, w, weights)
    assert exported.platforms == ("cpu", "cuda", "tpu")


@pytest.mark.usefixtures("fake_devices")
def test_sharded_tokens_under_jit_and_shard_map():
    """Tokens sharded over a mesh axis: under `jax.jit` with Auto axes (GSPMD partitions
    the sort and gathers) the layer and its gradients equal the unsharded ones; inside
    `jax.shard_map` each device routes its own tokens, as expert-parallel MoE code does
    before its exchange; under Explicit axes the features may be sharded, and sharded
    tokens are a `ValueError` naming the argument and both fixes."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    x = random_normal(0, (8, 6, 16))
    w = random_normal(1, (NUM_EXPERTS, 16, 8)) / 4.0
    weights = random_normal(2, (8, 6, 2))
    ids = _expert_ids(3, (8, 6), 2, dropped=True)
    cotangent = random_normal(4, (8, 6, 8))

    def grads(x, w, weights, ids):
        out, pullback = jax.vjp(lambda x, w, g: _moe(x, w, g, ids), x, w, weights)
        return out, pullback(cotangent)

    def assert_equal(got, want):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    expected = jax.jit(grads)(x, w, weights, ids)
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    tokens = NamedSharding(auto, P("data"))
    sharded = [jax.device_put(a, tokens) for a in (x, weights, ids)]
    assert_equal(jax.jit(grads)(sharded[0], w, sharded[1], sharded[2]), expected)

    per_device = jax.jit(jax.shard_map(
        _moe, mesh=auto, in_specs=(P("data"), P(), P("data"), P("data")),
        out_specs=P("data")))(sharded[0], w, sharded[1], sharded[2])
    for i in range(4):  # each data shard holds two batch rows, routed on their own
        rows = slice(2 * i, 2 * i + 2)
        assert_equal(per_device[rows], _moe(x[rows], w, weights[rows], ids[rows]))

    explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(explicit):
        features = jax.device_put(x, NamedSharding(explicit, P(None, None, "model")))
        assert_equal(jax.jit(grads)(features, w, weights, ids), expected)
        x_tokens = jax.device_put(x, NamedSharding(explicit, P("data")))
        with pytest.raises(ValueError, match="x is sharded over its token axes"):
            jax.jit(grads)(x_tokens, w, weights, ids)
