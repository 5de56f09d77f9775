"""Ops over 8 fake CPU devices: partitioned with no gather of the sharded operands, equal to
the unsharded op forward and backward; the GPU kernels exported per device (abstract H200 mesh).
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import tokamax_pass as tk
from conftest import H200, assert_close, random_normal, reference_precision

pytestmark = pytest.mark.usefixtures("fake_devices")  # fails, never skips, without 8

ROWS = ("data", "model")


def _mesh(axis_type=AxisType.Auto):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


def _layer_norm(x, scale, offset):
    return tk.layer_norm(x, scale, offset, implementation="xla")


def _layer_norm_residual(h, x, scale, offset):
    """Both outputs of the pre-norm residual step, as one array (their product, so each
    gets its own cotangent); the residual splits like the input."""
    y, s = tk.layer_norm(h, scale, offset, residual=x, implementation="xla")
    return y * s


def _glu(x, w):
    return tk.gated_linear_unit(x, w, implementation="xla")


def _grouped_glu(x, w, sizes):
    return tk.gated_linear_unit(x, w, group_sizes=sizes, implementation="xla")


def _attention(q, k, v, bias, mask, q_len, kv_len):
    return tk.dot_product_attention(q, k, v, bias, mask, query_seq_lengths=q_len,
                                    key_value_seq_lengths=kv_len, implementation="xla")


def _ragged(lhs, rhs, sizes):
    return tk.ragged_dot(lhs, rhs, sizes, implementation="xla")


def _cases():
    """(name, function, inputs, specs, differentiable argnums)."""
    b, s, h, d = 8, 16, 4, 8
    q, k, v = (random_normal(i, shape) for i, shape in
               enumerate([(b, s, h, d), (b, s, 2, d), (b, s, 2, d)]))
    bias = random_normal(3, (b, h, s, s))
    mask = jax.random.bernoulli(jax.random.key(4), 0.8, (b, 1, s, s))
    lengths = jnp.array([16, 9, 12, 16, 5, 16, 11, 7], jnp.int32)
    attn_spec = P("data", None, "model", None)
    sizes = jnp.array([10, 0, 23, 17], jnp.int32)  # 50 of 64 rows: the tail gives zeros
    return [
        ("layer_norm", _layer_norm,
         (random_normal(5, (8, 4, 32)), random_normal(6, (32,)), random_normal(7, (32,))),
         (P("data", "model", None), P(), P()), (0, 1, 2)),
        ("layer_norm_residual", _layer_norm_residual,
         (random_normal(12, (8, 4, 32)), random_normal(13, (8, 4, 32)), random_normal(14, (32,)),
          random_normal(15, (32,))),
         (P("data", "model", None), P("data", "model", None), P(), P()), (0, 1, 2, 3)),
        ("gated_linear_unit", _glu, (random_normal(8, (16, 4, 24)), random_normal(9, (24, 2, 8))),
         (P("data", "model", None), P()), (0, 1)),
        ("attention", _attention, (q, k, v, bias, mask, lengths, lengths),
         (attn_spec, attn_spec, attn_spec, P("data", "model"), P("data"), P("data"), P("data")),
         (0, 1, 2, 3)),
        ("ragged_dot", _ragged, (random_normal(10, (64, 16)), random_normal(11, (4, 16, 8)), sizes),
         (P(ROWS, None), P(), P()), (0, 1)),
        ("grouped_gated_linear_unit", _grouped_glu,
         (random_normal(16, (64, 16)), random_normal(17, (4, 16, 2, 8)), sizes),
         (P(ROWS, None), P(), P()), (0, 1)),
    ]


CASES = {name: rest for name, *rest in _cases()}


def _loss(fn, argnums):
    def loss(*args):
        return jnp.sum(jnp.sin(fn(*args).astype(jnp.float32)))
    return jax.grad(loss, argnums=argnums)


def _put(mesh, inputs, specs):
    return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(inputs, specs, strict=True)]


def _gathers(hlo: str) -> list[str]:
    return [line.strip()[:160] for line in hlo.splitlines() if "all-gather" in line]


@pytest.mark.parametrize("name", list(CASES))
def test_jit_with_sharded_inputs_partitions_without_gathering(name):
    fn, inputs, specs, argnums = CASES[name]
    with reference_precision():
        expected, expected_grads = fn(*inputs), _loss(fn, argnums)(*inputs)
    mesh = _mesh()
    sharded = _put(mesh, inputs, specs)
    with jax.set_mesh(mesh), reference_precision():
        out = jax.jit(fn)(*sharded)
        grads = jax.jit(_loss(fn, argnums))(*sharded)
        forward_hlo = jax.jit(fn).lower(*sharded).compile().as_text()
        backward_hlo = jax.jit(_loss(fn, argnums)).lower(*sharded).compile().as_text()
        jaxpr = str(jax.make_jaxpr(fn)(*sharded))
    assert "custom_partitioning" in jaxpr
    assert_close(out, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        assert_close(g, e)
    assert out.sharding.spec[0] is not None  # the rows stay split
    assert _gathers(forward_hlo) == [] and _gathers(backward_hlo) == []


@pytest.mark.parametrize("name", [pytest.param("layer_norm", marks=pytest.mark.slow),
                                  pytest.param("attention", marks=pytest.mark.slow),
                                  "ragged_dot"])
def test_vmap_under_set_mesh_in_either_order_with_jit(name):
    """`jax.vmap` over op calls under a mesh: mapped inside `jax.jit` (the call is bound
    whole) and outside it (the partitioned call is mapped whole); batched calls lower
    unpartitioned."""
    fn, inputs, specs, argnums = CASES[name]
    in_axes = [0 if i in argnums else None for i in range(len(inputs))]
    stacked = [jnp.stack([x, x[::-1] * 0.5]) if a == 0 else x
               for x, a in zip(inputs, in_axes, strict=True)]
    mapped = jax.vmap(fn, in_axes=in_axes)
    with reference_precision():
        expected = mapped(*stacked)
        expected_grads = _loss(mapped, argnums)(*stacked)
    mesh = _mesh()
    sharded = [jax.device_put(x, NamedSharding(mesh, P(None, *s) if a == 0 else s))
               for x, s, a in zip(stacked, specs, in_axes, strict=True)]
    with jax.set_mesh(mesh), reference_precision():
        for program in (jax.jit(mapped), jax.vmap(jax.jit(fn), in_axes=in_axes)):
            assert_close(program(*sharded), expected)
            for g, e in zip(_loss(program, argnums)(*sharded), expected_grads, strict=True):
                assert_close(g, e)


def _per_example_loss(x, labels, w):
    return tk.linear_softmax_cross_entropy_loss(x, labels, w, reduction="mean",
                                                implementation="xla")


def _vmap_explicit_cases():
    """(function mapped over axis 0 of every array but the last, inputs, specs): a
    weight sharded over a dim the call is partitioned over (experts, vocabulary)."""
    sizes = jnp.array([[2, 3, 1, 4], [0, 0, 10, 0], [5, 0, 0, 0], [1, 1, 1, 1]], jnp.int32)
    labels = jax.random.randint(jax.random.key(32), (4, 6), 0, 16)
    return {
        "ragged_dot": (_ragged, (random_normal(30, (4, 10, 8)), random_normal(31, (4, 8, 8)),
                                 sizes), (P("data"), P("model"), P("data")), (0, 1)),
        "cross_entropy": (lambda x, w, labels: _per_example_loss(x, labels, w),
                          (random_normal(33, (4, 6, 8)), random_normal(34, (8, 16)), labels),
                          (P("data"), P(None, "model"), P("data")), (0, 1)),
    }


@pytest.mark.parametrize("name", ["ragged_dot", "cross_entropy"])
def test_vmap_under_explicit_mesh_with_a_sharded_weight(name):
    """`jax.vmap` inside `jax.jit` on an Explicit mesh, the weight (unmapped) sharded over
    a dim the call partitions: the call is bound whole (a per-device `restore` raised
    "Resource axis: data ... not found in mesh", a gradient lost its operand's sharding:
    "Expected cotangent type float32[4@data,6,8] but got float32[4,6,8]")."""
    fn, inputs, specs, argnums = _vmap_explicit_cases()[name]
    mapped = jax.vmap(fn, in_axes=(0, None, 0))
    with reference_precision():
        expected = mapped(*inputs)
        expected_grads = _loss(mapped, argnums)(*inputs)
    mesh = _mesh(AxisType.Explicit)
    sharded = _put(mesh, inputs, specs)
    with jax.set_mesh(mesh), reference_precision():
        assert_close(jax.jit(mapped)(*sharded), expected)
        grads = jax.jit(_loss(mapped, argnums))(*sharded)
    for i, g, e in zip(argnums, grads, expected_grads, strict=True):
        assert_close(g, e)
        assert _spec(g) == _spec(sharded[i]), (i, _spec(g))


def _spec(x):
    """`x`'s PartitionSpec as a tuple with one entry per dim."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


@pytest.mark.parametrize("name", list(CASES))
def test_explicit_mesh_uses_shard_map(name):
    """`jax.make_mesh`'s default axes: the operands' types carry their shardings, so the
    call is split by them in `shard_map` (no gather); outputs and gradients keep them."""
    fn, inputs, specs, argnums = CASES[name]
    with reference_precision():
        expected, expected_grads = fn(*inputs), _loss(fn, argnums)(*inputs)
    mesh = _mesh(AxisType.Explicit)
    sharded = _put(mesh, inputs, specs)
    with jax.set_mesh(mesh), reference_precision():
        out = jax.jit(fn)(*sharded)
        grads = jax.jit(_loss(fn, argnums))(*sharded)
        optimized = tk.optimize(_loss(fn, argnums))(*sharded)
        hlo = jax.jit(_loss(fn, argnums)).lower(*sharded).compile().as_text()
        jaxpr = str(jax.make_jaxpr(fn)(*sharded))
    assert "shard_map" in jaxpr
    assert_close(out, expected)
    assert _gathers(hlo) == []
    assert _spec(out)[0] is not None  # the rows stay split, as on the Auto path
    for i, g, o, e in zip(argnums, grads, optimized, expected_grads, strict=True):
        assert_close(g, e)
        assert_close(o, e)
        assert _spec(g) == _spec(sharded[i]) == _spec(o), (i, _spec(g), _spec(o))


@pytest.mark.parametrize("name", list(CASES))
def test_operands_placed_on_an_explicit_mesh_without_set_mesh(name):
    """Operands `jax.device_put` onto a mesh with Explicit axes, then `jax.jit` (or an
    eager call, or `optimize`) with no `jax.set_mesh`, as plain JAX takes them: the call
    is split over the mesh their types name, not over the empty mesh in context; values,
    gradients and their shardings as under `jax.set_mesh`."""
    fn, inputs, specs, argnums = CASES[name]
    with reference_precision():
        expected, expected_grads = fn(*inputs), _loss(fn, argnums)(*inputs)
    sharded = _put(_mesh(AxisType.Explicit), inputs, specs)
    with reference_precision():
        eager = fn(*sharded)
        out = jax.jit(fn)(*sharded)
        grads = jax.jit(_loss(fn, argnums))(*sharded)
        optimized = tk.optimize(_loss(fn, argnums))(*sharded)
    assert_close(eager, expected)
    assert_close(out, expected)
    assert _spec(out)[0] is not None  # the rows stay split
    for i, g, o, e in zip(argnums, grads, optimized, expected_grads, strict=True):
        assert_close(g, e)
        assert_close(o, e)
        assert _spec(g) == _spec(sharded[i]) == _spec(o), (i, _spec(g), _spec(o))


@pytest.mark.parametrize("wrap", [jax.jit, tk.optimize], ids=["jit", "optimize"])
def test_explicit_mesh_output_type_inside_a_traced_vjp(wrap):
    """Code traced after an op call sees its output typed as partitioned, under `optimize`
    (whose first trace binds calls whole) as under `jax.jit`: a cotangent resharded like
    the output, inside `lax.switch`, runs (it raised "Reshard should only be used with
    out_shardings which ... have a non-empty mesh")."""
    x, scale = random_normal(40, (4, 8, 4, 8)), random_normal(41, (8,))
    ct = random_normal(42, x.shape)
    branches = [lambda x, s: _layer_norm(x, s, None), lambda x, s: x * 2.0]

    def step(x, scale):
        out, pullback = jax.vjp(lambda x, s: jax.lax.switch(0, branches, x, s), x, scale)
        specs.append(_spec(out))
        return pullback(jax.sharding.reshard(ct, jax.typeof(out).sharding))

    with reference_precision():
        expected = jax.vjp(lambda x, s: _layer_norm(x, s, None), x, scale)[1](ct)
    mesh = _mesh(AxisType.Explicit)
    sharded = _put(mesh, (x, scale), (P("data", None, "model"), P()))
    specs: list = []
    with jax.set_mesh(mesh), reference_precision():
        grads = wrap(step)(*sharded)
    assert specs[0] == ("data", None, "model", None)
    for g, e in zip(grads, expected, strict=True):
        assert_close(g, e)


@pytest.mark.parametrize("name", list(CASES))
def test_explicit_mesh_with_replicated_operands(name):
    """Replicated operands under Explicit axes: a replicated call, forward and gradient
    (`jax.lax.ragged_dot_general` fails here without an `out_sharding`)."""
    fn, inputs, _, argnums = CASES[name]
    with reference_precision():
        expected, expected_grads = fn(*inputs), _loss(fn, argnums)(*inputs)
    mesh = _mesh(AxisType.Explicit)
    with jax.set_mesh(mesh), reference_precision():
        out = jax.jit(fn)(*inputs)
        grads = jax.jit(_loss(fn, argnums))(*inputs)
        optimized = tk.optimize(_loss(fn, argnums))(*inputs)
    assert_close(out, expected)
    assert all(entry is None for entry in _spec(out))
    for g, o, e in zip(grads, optimized, expected_grads, strict=True):
        assert_close(g, e)
        assert_close(o, e)


@pytest.mark.parametrize("name", ["layer_norm", "layer_norm_residual", "attention",
                                  "gated_linear_unit"])
def test_inside_shard_map_ops_see_blocks(name):
    fn, inputs, specs, argnums = CASES[name]
    with reference_precision():
        expected, expected_grads = fn(*inputs), _loss(fn, argnums)(*inputs)
    mesh = _mesh()
    out_spec = specs[0]

    def blocks(*args):
        return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_spec,
                             check_vma=False)(*args)

    def loss(*args):  # the sum over blocks, so gradients of replicated inputs add up
        return jnp.sum(jnp.sin(blocks(*args).astype(jnp.float32)))

    with reference_precision():
        out = jax.jit(blocks)(*inputs)
        grads = jax.jit(jax.grad(loss, argnums=argnums))(*inputs)
        jaxpr = str(jax.make_jaxpr(blocks)(*inputs))
    assert "custom_partitioning" not in jaxpr  # already per device: bound as is
    assert re.search(r"tokamax_call\[", jaxpr)
    assert_close(out, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        assert_close(g, e)


def test_sequence_sharded_attention_gathers_with_a_warning(caplog):
    fn, inputs, _, argnums = CASES["attention"]
    mesh = _mesh()
    seq = P("data", "model", None, None)  # sequence split over "model": must be gathered
    specs = (seq, seq, seq, P("data"), P("data"), P("data"), P("data"))
    sharded = _put(mesh, inputs, specs)
    with reference_precision():
        expected = fn(*inputs)
    with jax.set_mesh(mesh), reference_precision(), caplog.at_level(logging.WARNING):
        out = jax.jit(fn)(*sharded)
    assert_close(out, expected)
    assert any("cannot partition" in r.message and "model" in r.message for r in caplog.records)


def test_discovery_finds_the_per_device_calls():
    fn, inputs, specs, argnums = CASES["layer_norm"]
    mesh = _mesh(AxisType.Explicit)  # shard_map: the per-device specs are in the lowering
    with jax.set_mesh(mesh):
        found = tk.autotuning.discovery.get_bound_args(_loss(fn, argnums), *_put(mesh, inputs,
                                                                                  specs))
    shapes = {tuple(ba.arguments["x"].shape) for ba in found}
    assert shapes == {(2, 2, 32)}  # (8, 4, 32) over data=4, model=2
    assert len(found) == 2  # the forward and its VJP op


def test_ragged_dot_local_group_sizes():
    from tokamax_kernels.ragged_dot.sharding import local_group_sizes

    sizes = jnp.array([10, 0, 23, 17], jnp.int32)
    blocks = [np.asarray(local_group_sizes(sizes, r, 16)) for r in range(0, 64, 16)]
    assert [b.tolist() for b in blocks] == [[10, 0, 6, 0], [0, 0, 16, 0], [0, 0, 1, 15],
                                            [0, 0, 0, 2]]


# --- expert parallelism: ragged_dot with rhs split over its groups ------------------------------

# 8 groups over data=4 (2 per device): uneven, empty ones, a device with no rows at all.
EXPERT_SIZES = jnp.array([10, 0, 23, 3, 0, 0, 17, 5], jnp.int32)


def _expert_inputs():
    return random_normal(20, (64, 16)), random_normal(21, (8, 16, 8)), EXPERT_SIZES


@pytest.mark.exhaustive
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
@pytest.mark.parametrize("lhs_spec", [P(), P("model", None)], ids=["rows_replicated",
                                                                  "rows_sharded"])
def test_ragged_dot_expert_parallel_under_set_mesh(lhs_spec, axis_type):
    fn, argnums = _ragged, (0, 1)
    inputs = _expert_inputs()
    with reference_precision():
        expected, expected_grads = fn(*inputs), _loss(fn, argnums)(*inputs)
    mesh = _mesh(axis_type)
    sharded = _put(mesh, inputs, (lhs_spec, P("data", None, None), P()))
    with jax.set_mesh(mesh), reference_precision():
        out = jax.jit(fn)(*sharded)
        grads = jax.jit(_loss(fn, argnums))(*sharded)
        hlos = [jax.jit(f).lower(*sharded).compile().as_text() for f in (fn, _loss(fn, argnums))]
    assert_close(out, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        assert_close(g, e)
    assert grads[1].sharding.spec[0] == "data"  # drhs stays with each device's experts
    assert all(_gathers(hlo) == [] for hlo in hlos)
    assert all("all-reduce" in hlo for hlo in hlos)  # the psum over the expert axis


@pytest.mark.parametrize("name", ["ragged_dot", "gated_linear_unit", "layer_norm"])
def test_explicit_mesh_with_the_contracted_axis_sharded(name):
    """Under Explicit axes an operand sharded over an axis the op computes whole (the
    contraction K, or the normalized features): the gradient comes back with the
    operand's sharding, as JAX requires of a custom VJP (it raised "the bwd rule produced
    an output of type float32[96,16] corresponding to an input of type
    float32[96,16@model]")."""
    fn, inputs, specs, argnums = CASES[name]
    specs = [P(*([None] * (x.ndim - 1)), "model") if i == 0 else s
             for i, (x, s) in enumerate(zip(inputs, specs, strict=True))]
    with reference_precision():
        expected_grads = _loss(fn, argnums)(*inputs)
    mesh = _mesh(AxisType.Explicit)
    sharded = _put(mesh, inputs, specs)
    with jax.set_mesh(mesh), reference_precision():
        grads = jax.jit(_loss(fn, argnums))(*sharded)
    for i, g, e in zip(argnums, grads, expected_grads, strict=True):
        assert_close(g, e)
        assert _spec(g) == _spec(sharded[i]), (i, _spec(g))


def test_explicit_mesh_grouped_glu_with_fused_weights_sharded_on_n():
    """Fused (G, K, 2, N) weights sharded over N on an Explicit mesh: the gradient's
    evidence views them as (G, K, 2N) by shape (reshaping the sharded array raised
    "This reshape is not supported"), and the gradients equal the reference's."""
    fn, inputs, _, argnums = CASES["grouped_gated_linear_unit"]
    with reference_precision():
        expected_grads = _loss(fn, argnums)(*inputs)
    mesh = _mesh(AxisType.Explicit)
    sharded = _put(mesh, inputs, (P(), P(None, None, None, "model"), P()))
    with jax.set_mesh(mesh), reference_precision():
        grads = jax.jit(_loss(fn, argnums))(*sharded)
    for i, g, e in zip(argnums, grads, expected_grads, strict=True):
        assert_close(g, e)
        assert _spec(g) == _spec(sharded[i]), (i, _spec(g))


def test_ragged_dot_expert_parallel_inside_shard_map():
    from tokamax_kernels.ragged_dot.expert_parallel import expert_parallel_ragged_dot

    inputs = _expert_inputs()
    with reference_precision():
        expected, expected_grads = _ragged(*inputs), _loss(_ragged, (0, 1))(*inputs)
    experts = jax.shard_map(
        lambda a, b, s: expert_parallel_ragged_dot(a, b, s, axis_name="data",
                                                   implementation="xla"),
        mesh=_mesh(), in_specs=(P(), P("data"), P()), out_specs=P(), check_vma=False)
    with reference_precision():
        out = jax.jit(experts)(*inputs)
        grads = jax.jit(_loss(experts, (0, 1)))(*inputs)
        hlo = jax.jit(_loss(experts, (0, 1))).lower(*inputs).compile().as_text()
    assert_close(out, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        assert_close(g, e)
    assert _gathers(hlo) == []


def test_ragged_dot_expert_block():
    from tokamax_kernels.ragged_dot.sharding import expert_block

    blocks = [expert_block(EXPERT_SIZES, first, 2) for first in range(0, 8, 2)]
    assert [(int(o), s.tolist()) for o, s in blocks] == [
        (0, [10, 0]), (10, [23, 3]), (36, [0, 0]), (36, [17, 5])]


# --- GPU kernels, exported for an 8-device abstract H200 mesh ------------------------------------

def _abstract_mesh(axis_type):
    return AbstractMesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2,
                        abstract_device=AbstractDevice(H200, None, "cuda"))


KERNEL_CALLS = {"triton": "__gpu$xla.gpu.triton", "mosaic": "mosaic_gpu_v2"}


def _export(fn, *shapes_specs_dtypes, axis_type=AxisType.Auto):
    mesh = _abstract_mesh(axis_type)
    with jax.sharding.use_abstract_mesh(mesh):
        args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
                for shape, spec, dtype in shapes_specs_dtypes]
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                     disabled_checks=tk.DISABLE_JAX_EXPORT_CHECKS)(*args)
    return exported.mlir_module()


def _kernel_operand_shapes(text: str, implementation: str) -> list[list[str]]:
    """The operand types of each kernel custom call, e.g. `["2x128x2x64xbf16", ...]`."""
    target = re.escape(KERNEL_CALLS[implementation])
    calls = [line for line in text.splitlines()
             if re.search(f"custom_call @{target}\\b|call_target_name = \"{target}\"", line)]
    operands = [re.search(r":\s*\(([^)]*)\)\s*->", line).group(1) for line in calls]
    return [re.findall(r"tensor<([^>]*)>", types) for types in operands]


BF16 = jnp.bfloat16
EXPORTS = {
    "layer_norm": (lambda impl: lambda x, s: tk.layer_norm(x, s, None, implementation=impl),
                   [((8, 4, 256), P("data", "model", None), BF16), ((256,), P(), BF16)],
                   "4x256xbf16", ("triton",)),
    "layer_norm_residual": (
        lambda impl: lambda h, x, s: jnp.multiply(*tk.layer_norm(
            h, s, None, residual=x, implementation=impl)),
        [((8, 4, 256), P("data", "model", None), BF16),
         ((8, 4, 256), P("data", "model", None), BF16), ((256,), P(), BF16)],
        "4x256xbf16", ("triton",)),
    "gated_linear_unit": (
        lambda impl: lambda x, w: tk.gated_linear_unit(x, w, implementation=impl),
        [((512, 256), P(ROWS, None), BF16), ((256, 2, 128), P(), BF16)],
        "64x256xbf16", ("triton",)),
    "attention": (
        lambda impl: lambda q, k, v: tk.dot_product_attention(q, k, v, implementation=impl),
        [((8, 256, 4, 64), P("data", None, "model", None), BF16),
         ((8, 256, 4, 64), P("data", None, "model", None), BF16),
         ((8, 256, 4, 64), P("data", None, "model", None), BF16)],
        "2x256x2x64xbf16", ("triton", "mosaic")),
    "ragged_dot": (
        lambda impl: lambda a, b, s: tk.ragged_dot(a, b, s, implementation=impl),
        [((512, 128), P(ROWS, None), BF16), ((4, 128, 256), P(), BF16),
         ((4,), P(), jnp.int32)],
        "64x128xbf16", ("triton", "mosaic")),
}


@pytest.mark.exhaustive
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
@pytest.mark.parametrize("name,implementation", [
    (name, impl) for name, (*_, impls) in EXPORTS.items() for impl in impls])
def test_cuda_export_puts_kernels_in_manual_computation_with_local_shapes(
        name, implementation, axis_type):
    make, args, local_shape, _ = EXPORTS[name]
    fn = make(implementation)
    text = _export(fn, *args, axis_type=axis_type)
    assert "sdy.manual_computation" in text
    forward = _kernel_operand_shapes(text, implementation)
    assert len(forward) == 1 and local_shape in forward[0], forward
    float_args = tuple(i for i, (_, _, dtype) in enumerate(args) if dtype == BF16)

    def loss(*xs):
        return jnp.sum(fn(*xs).astype(jnp.float32))

    grad_text = _export(jax.grad(loss, argnums=float_args), *args, axis_type=axis_type)
    shapes = _kernel_operand_shapes(grad_text, implementation)
    assert len(shapes) >= 2  # forward + backward kernels, all on per-device blocks
    global_shape = "x".join(map(str, args[0][0])) + "x"
    assert not any(t.startswith(global_shape) for types in shapes for t in types), shapes


def test_plain_jit_with_sharded_inputs_partitions_at_lowering():
    """No mesh in context: the call is partitioned when jit lowers it for 8 devices."""
    x, scale = random_normal(20, (8, 4, 32)), random_normal(21, (32,))
    op = tk.PallasTritonLayerNorm(interpret=True)  # a kernel XLA cannot split by itself

    def fn(x, scale):
        return op(x, scale, None)

    xs = jax.device_put(x, NamedSharding(_mesh(), P("data", "model", None)))
    grad = _loss(fn, (0, 1))
    with tk.core.sharding.partitioning(False):  # what plain jit did before: gather
        assert _gathers(jax.jit(lambda x, s: fn(x, s)).lower(xs, scale).compile().as_text())
    out, grads = jax.jit(fn)(xs, scale), jax.jit(grad)(xs, scale)
    assert_close(out, fn(x, scale))
    for g, e in zip(grads, grad(x, scale), strict=True):
        assert_close(g, e)
    assert out.sharding.spec[:2] == ("data", "model")
    assert _gathers(jax.jit(fn).lower(xs, scale).compile().as_text()) == []
    assert _gathers(jax.jit(grad).lower(xs, scale).compile().as_text()) == []


def test_inside_shard_map_with_the_default_vma_checks():
    """Operands varying over different manual axes are `pcast` alike; a replicated input's
    gradient is summed over the devices."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    x, scale = random_normal(30, (16, 32)), random_normal(31, (32,))

    def loss(fn):
        return jax.grad(lambda x, s: jnp.sum(jnp.sin(fn(x, s))), argnums=(0, 1))

    def per_device(x, s):
        return tk.layer_norm(x, s, None)

    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P()),
                            out_specs=P("data"))
    assert_close(jax.jit(sharded)(x, scale), per_device(x, scale))
    for got, want in zip(jax.jit(loss(sharded))(x, scale), loss(per_device)(x, scale),
                         strict=True):
        assert_close(got, want)
