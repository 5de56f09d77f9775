"""The op framework with user-defined ops: binding, the primitive, AD, vmap, the registry."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.custom_partitioning import custom_partitioning

import tokamax_pass as tokamax
from conftest import assert_close, measured, random_normal
from tokamax_pass import core
from tokamax_pass.core import spec


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    power: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaledSine(tokamax.Op[ScaleConfig]):
    """A user op: `sin(x) * y * factor ** config.power`, with a config and a search space."""

    config_cls = ScaleConfig

    def bind(self, x, y, *, factor=2.0):
        if x.shape != y.shape:
            raise ValueError(f"y must have the shape of x {x.shape}, got {y.shape}")
        return tokamax.BoundArguments(self, dict(x=x, y=y, factor=float(factor)))

    def _fwd(self, x, y, *, factor, config, return_residuals):
        return jnp.sin(x) * y * factor**config.power, None

    def _get_heuristics_config(self, ba):
        return ScaleConfig(power=1)

    def _get_autotuning_configs(self, ba):
        return {ScaleConfig(power=p) for p in (1, 2, 3)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuOnlySine(ScaledSine):
    """An implementation that exists only for cuda (to test fallback and per-platform lowering)."""

    implementation = "gpu_only"
    platforms = frozenset({"cuda"})

    def _fwd(self, x, y, *, factor, config, return_residuals):
        return jnp.sin(x) * y * factor**config.power + 0.0, None


FAMILY = core.register_family(core.Family(
    name="scaled_sine",
    implementations={"gpu_only": GpuOnlySine, "xla": ScaledSine},
    automatic=("gpu_only", "xla"),
))


def reference(x, y, factor=2.0, power=1):
    return np.sin(np.asarray(x, np.float64)) * np.asarray(y, np.float64) * factor**power


def test_user_op_forward_jit_grad_vmap():
    x, y = random_normal(0, (3, 5)), random_normal(1, (3, 5))
    op = ScaledSine()
    assert_close(op(x, y), reference(x, y))
    assert_close(jax.jit(op)(x, y), reference(x, y))
    ct = random_normal(2, (3, 5))  # a random cotangent
    dx, dy = jax.grad(lambda x, y: jnp.sum(op(x, y) * ct), argnums=(0, 1))(x, y)
    assert_close(dx, np.cos(np.asarray(x)) * np.asarray(y) * 2.0 * np.asarray(ct))
    assert_close(dy, np.sin(np.asarray(x)) * 2.0 * np.asarray(ct))
    batched = jax.vmap(op, in_axes=(0, None))(jnp.stack([x, 2 * x]), y)
    assert_close(batched[1], reference(2 * x, y))
    cts = random_normal(3, (2, 3, 5))  # one per batch element
    per_example = jax.jit(jax.vmap(jax.grad(lambda x, ct: jnp.sum(op(x, y) * ct))))(
        jnp.stack([x, 2 * x]), cts)
    for i, xi in enumerate((x, 2 * x)):
        assert_close(per_example[i], np.cos(np.asarray(xi)) * np.asarray(y) * 2.0
                     * np.asarray(cts[i]))


def test_pinned_config_is_used():
    x, y = random_normal(0, (4,)), random_normal(1, (4,))
    assert_close(ScaledSine(config=ScaleConfig(power=3))(x, y), reference(x, y, power=3))


def test_metadata_is_stamped_and_parses_back():
    x, y = random_normal(0, (3, 5)), random_normal(1, (3, 5))
    text = jax.jit(lambda x, y: ScaledSine()(x, y, factor=3.0)).lower(x, y).as_text()
    payloads = set(re.findall(r'tokamax_pass_spec = "((?:[^"\\]|\\.)*)"', text))
    assert len(payloads) == 1
    ba = tokamax.BoundArguments.from_json(payloads.pop().replace("\\22", '"'))
    assert isinstance(ba.op, ScaledSine)
    assert ba.op.config == ScaleConfig(power=1)
    assert ba.arguments["factor"] == 3.0
    assert ba.arguments["x"] == jax.ShapeDtypeStruct((3, 5), jnp.float32)


def test_grad_stamps_the_vjp_op():
    x, y = random_normal(0, (3,)), random_normal(1, (3,))
    text = jax.jit(jax.grad(lambda x: ScaledSine()(x, y).sum())).lower(x).as_text()
    assert "AutodiffVjp" in text.replace("\\22", '"')


def test_bound_arguments_json_round_trip_with_vmap():
    ba = ScaledSine().bind(jax.ShapeDtypeStruct((2, 3), jnp.bfloat16),
                           jax.ShapeDtypeStruct((2, 3), jnp.bfloat16))
    ba = ba.replace(vmap=(core.bound_arguments.VmapLevel((0, None), 4),))
    again = tokamax.BoundArguments.from_json(ba.to_json())
    assert again == ba
    assert again.cache_key == ba.cache_key
    assert '"bf16[2,3]"' in ba.to_json()
    assert ba.autotuning_configs == {ScaleConfig(1), ScaleConfig(2), ScaleConfig(3)}


@pytest.mark.parametrize("vmap", [
    [[[0, None], 2.7]], [[[0, None], 0]], [[[0, None], -3]], [[[0, None], float("inf")]],
    [[[0, None], True]], [[["x"], 2]], "ab", [[[0, None]]],
])
def test_bound_arguments_from_json_rejects_a_bad_vmap(vmap):
    ba = ScaledSine().bind(jax.ShapeDtypeStruct((2, 3), jnp.bfloat16),
                           jax.ShapeDtypeStruct((2, 3), jnp.bfloat16))
    data = json.loads(ba.to_json())
    data["arguments"]["__vmap__"] = vmap
    with pytest.raises(tokamax.SpecError, match="'__vmap__' must be"):
        tokamax.BoundArguments.from_json(json.dumps(data))


def test_vmapped_call_records_vmap_levels():
    x, y = random_normal(0, (2, 3)), random_normal(1, (3,))
    text = jax.jit(jax.vmap(lambda x: ScaledSine()(x, y))).lower(x).as_text()
    (payload,) = set(re.findall(r'tokamax_pass_spec = "((?:[^"\\]|\\.)*)"', text))
    ba = tokamax.BoundArguments.from_json(payload.replace("\\22", '"'))
    assert ba.arguments["x"].shape == (3,)
    assert ba.vmap == (core.bound_arguments.VmapLevel((0, None), 2),)


def test_implementation_none_falls_back_on_cpu():
    x, y = random_normal(0, (4,)), random_normal(1, (4,))
    assert_close(FAMILY(None, x, y), reference(x, y))
    text = jax.jit(lambda x, y: FAMILY(None, x, y)).lower(x, y).as_text()
    assert "GpuOnlySine" not in text and "ScaledSine" in text


def test_explicit_unsupported_implementation_raises():
    x, y = random_normal(0, (4,)), random_normal(1, (4,))
    with pytest.raises(NotImplementedError, match="cuda"):
        FAMILY("gpu_only", x, y)
    with pytest.raises(ValueError, match="valid names are"):
        FAMILY("nope", x, y)
    with pytest.raises(ValueError, match="empty"):
        FAMILY([], x, y)


def test_bind_errors_propagate():
    with pytest.raises(ValueError, match="y must have the shape"):
        FAMILY(None, jnp.ones(3), jnp.ones(4))


def test_each_platform_lowers_its_own_implementation():
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    # `None` runs the GPU kernel where a measurement says it wins, the XLA path elsewhere.
    evidence = measured("NVIDIA H200", {GpuOnlySine(): 1.0, ScaledSine(): 2.0}, x, x)
    for implementation, gpu_kernel in ((None, False), (("gpu_only", "xla"), True)):
        with core.targeting("NVIDIA H200"):
            exported = jax.export.export(jax.jit(lambda x, y, i=implementation: FAMILY(
                i, x, y)), platforms=("cpu", "cuda"))(x, x)
        text = exported.mlir_module().replace("\\22", '"')
        assert ("GpuOnlySine" in text) == gpu_kernel and "ScaledSine" in text
    with evidence, core.targeting("NVIDIA H200"):
        exported = jax.export.export(
            jax.jit(lambda x, y: FAMILY(None, x, y)), platforms=("cpu", "cuda"))(x, x)
    text = exported.mlir_module().replace("\\22", '"')
    assert "GpuOnlySine" in text and "ScaledSine" in text
    xs = random_normal(0, (4,))
    assert_close(exported.call(xs, xs), reference(xs, xs))


def test_targeting_sets_the_device_kind():
    with core.targeting("NVIDIA H200"):
        target = core.current_target()
    assert target == core.Target("cuda", "NVIDIA H200")
    assert target.is_hopper and target.is_gpu
    assert core.current_target().platform == "cpu"
    for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H20", "NVIDIA GH200 480GB"):
        assert core.Target("cuda", kind).is_hopper
    for kind in ("NVIDIA H2000", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S"):
        assert not core.Target("cuda", kind).is_hopper
    for kind in ("Tesla V100-SXM2-16GB", "Tesla T4", "NVIDIA GeForce RTX 2080 Ti",
                 "Quadro RTX 8000", "NVIDIA TITAN RTX", "NVIDIA TITAN V"):
        assert not core.Target("cuda", kind).is_ampere_or_newer, kind
    for kind in ("NVIDIA RTX 2000 Ada Generation", "NVIDIA A10G", "NVIDIA H200",
                 "NVIDIA GeForce RTX 4090", "NVIDIA RTX A6000"):
        assert core.Target("cuda", kind).is_ampere_or_newer, kind


def test_spec_encoding():
    assert spec.array_spec(jax.ShapeDtypeStruct((32, 2048, 16, 64), jnp.bfloat16)) == (
        "bf16[32,2048,16,64]")
    assert spec.parse_array_spec("s32[]") == jax.ShapeDtypeStruct((), jnp.int32)
    assert spec.decode(spec.encode(jax.nn.swish)) is jax.nn.swish
    assert spec.decode(spec.encode(jax.lax.Precision.HIGHEST)) == jax.lax.Precision.HIGHEST
    assert spec.decode(spec.encode(jnp.dtype(jnp.bfloat16))) == jnp.dtype(jnp.bfloat16)
    with pytest.raises(spec.SpecError, match="not importable"):
        spec.decode(spec.encode(lambda v: v))
    with pytest.raises(spec.SpecError, match="array spec"):
        spec.parse_array_spec("q7[1]")
    with pytest.raises(spec.SpecError, match="newer"):
        spec.check_schema({"schema_version": spec.SCHEMA_VERSION + 1}, what="file")


def test_null_config_loads_under_its_former_import_path():
    """Specs that name `NullConfig` by the module it was defined in before
    (`tokamax_pass.core.op`: profiles' stamps of plain-JAX calls) still load."""
    encoded = spec.encode(core.NullConfig())
    assert spec.decode(encoded) == core.NullConfig()
    former = json.loads(json.dumps(encoded).replace("core.bound_arguments.NullConfig",
                                                    "core.op.NullConfig"))
    assert former != encoded
    assert spec.decode(former) == core.NullConfig()


def test_snake_case_names():
    assert core.snake_case_name(ScaledSine) == "scaled_sine"
    assert tokamax.snake_case_name(GpuOnlySine()) == "gpu_only_sine"
    assert GpuOnlySine.family_name() == "scaled_sine"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TakesOptions(tokamax.Op):
    def _fwd(self, x, options, *, config, return_residuals):
        return x * len(options), None


def test_unhashable_static_argument_is_a_clear_error():
    with pytest.raises(TypeError, match="options"):
        TakesOptions()(jnp.ones(2), {1, 2})


def test_local_op_classes_run_but_do_not_reload():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Local(tokamax.Op):
        def _fwd(self, x, *, config, return_residuals):
            return 2 * x, None

    assert_close(Local()(jnp.ones(2)), np.full(2, 2.0))
    with pytest.raises(spec.SpecError, match="module level"):
        tokamax.BoundArguments.from_json(Local().bind(jnp.ones(2)).to_json())


@custom_partitioning
def _partitioned_sine(x):
    return jnp.sin(x)


_partitioned_sine.def_partition(
    partition=lambda mesh, args, result: (mesh, jnp.sin, args[0].sharding, (args[0].sharding,)),
    sharding_rule="i -> i",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartitionedSine(tokamax.Op):
    """Lowers through `custom_partitioning`, as cuDNN attention does."""

    def _fwd(self, x, *, config, return_residuals):
        return _partitioned_sine(x), None


def test_kernels_that_lower_through_custom_partitioning():
    x = random_normal(0, (4,))
    assert_close(jax.jit(PartitionedSine())(x), np.sin(np.asarray(x)))
    assert_close(jax.jit(lambda x: PartitionedSine()(x) * 2)(x), 2 * np.sin(np.asarray(x)))


def test_second_order_gradients():
    x, y = random_normal(0, (6,)), random_normal(1, (6,))

    def first(x):
        return jax.grad(lambda x: ScaledSine()(x, y).sum())(x)  # 2 y cos(x)

    second = jax.grad(lambda x: jnp.sum(first(x) ** 2))(x)
    xn, yn = np.asarray(x, np.float64), np.asarray(y, np.float64)
    assert_close(first(x), 2 * yn * np.cos(xn))
    assert_close(second, -8 * yn**2 * np.sin(xn) * np.cos(xn))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SummedSineVjp(core.VjpOp):
    """A VJP of `ScaledSine` that computes `dx + dy` itself when x and y are one array."""

    accepts_shared_inputs = True

    def _fwd(self, residuals, out, dout, *, x, y, factor, config, return_residuals,
             shared_inputs=()):
        dx, dy = dout * jnp.cos(x) * y * factor, dout * jnp.sin(x) * factor
        if shared_inputs:
            return {"x": dx + dy}, None
        return {"x": dx, "y": dy}, None


def _vjp_calls(jaxpr):
    return [e.params["call"] for e in jaxpr.eqns if core.primitive.is_tokamax_call(e.primitive)
            and isinstance(e.params["call"].candidates[0], core.VjpOp)]


@pytest.mark.parametrize("vjp", [None, SummedSineVjp()], ids=["autodiff", "summed"])
def test_one_array_under_two_names_gets_one_summed_gradient(vjp):
    """f(x, x): the VJP call is told the names share an array (`shared_inputs`), and
    the gradient is the sum autodiff would form, whether the VJP op sums it or not."""
    x = random_normal(0, (16,))
    op = ScaledSine(vjp=vjp)
    ct = random_normal(1, (16,))  # a random cotangent
    grad = jax.grad(lambda x: jnp.sum(op(x, x) * ct))
    xn = np.asarray(x, np.float64)
    assert_close(grad(x), 2.0 * (np.cos(xn) * xn + np.sin(xn)) * np.asarray(ct))
    (call,) = _vjp_calls(jax.make_jaxpr(grad)(x))
    assert dict(call.statics)  # the group is static: part of the call's cache key
    assert call.arguments([None] * len(call.operand_indices))["shared_inputs"] == (("x", "y"),)
    (call,) = _vjp_calls(jax.make_jaxpr(jax.grad(lambda x: op(x, x + 0.0).sum()))(x))
    assert "shared_inputs" not in call.arguments([None] * len(call.operand_indices))


@pytest.mark.parametrize("groups,message", [
    ((("x", "z"),), "unknown"), ((("x",),), "two or more"), ("xy", "two or more"),
    ((("x", "y"),), "different shapes"),
])
def test_vjp_bind_rejects_bad_shared_inputs(groups, message):
    x, y = random_normal(0, (4,)), random_normal(1, (5,))
    with pytest.raises(ValueError, match=message):
        SummedSineVjp().bind(None, x, x, shared_inputs=groups, x=x, y=y, factor=2.0)
