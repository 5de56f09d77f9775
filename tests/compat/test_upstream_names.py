"""Upstream Tokamax's public names and spellings, accepted by tokamax_pass."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from tokamax_pass.core import NullConfig, spec


def _lce_reference(x, labels, weights):
    logits = jnp.matmul(x, weights, precision=jax.lax.Precision.HIGHEST)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]


def test_chunked_xla_is_the_chunked_cross_entropy():
    x, weights = random_normal(0, (2, 9, 16)), random_normal(1, (16, 37))
    labels = jax.random.randint(jax.random.key(2), (2, 9), 0, 37)
    dloss = random_normal(3, (2, 9))

    def loss(implementation):
        return lambda x, w: tokamax.linear_softmax_cross_entropy_loss(
            x, labels, w, reduction="none", precision="highest",
            implementation=implementation)

    out, pullback = jax.vjp(loss("chunked_xla"), x, weights)
    expected, ref_pullback = jax.vjp(lambda x, w: _lce_reference(x, labels, w), x, weights)
    assert_close(out, expected)
    for g, e in zip(pullback(dloss), ref_pullback(dloss), strict=True):
        assert_close(g, e)
    ops, explicit = tokamax.linear_softmax_cross_entropy_loss.__globals__[
        "FAMILY"].resolve("chunked_xla")
    assert explicit and [op.implementation for op in ops] == ["xla_chunked"]


def test_version_info_is_the_version_as_ints():
    assert tokamax.__version_info__ == tuple(int(p) for p in tokamax.__version__.split("."))
    assert all(isinstance(p, int) for p in tokamax.__version_info__)


def test_benchmark_takes_standardized_function_and_arrays():
    def f(x, w):
        return jnp.tanh(x @ w)

    f_std, arrays = tokamax.standardize_function(
        f, jax.ShapeDtypeStruct((2, 8, 16), jnp.float32), random_normal(4, (16, 8)))
    data = tokamax.benchmark(f_std, arrays, iterations=2, method="wallclock")
    assert isinstance(data, tokamax.BenchmarkData)
    assert len(data.evaluation_times_ms) == 2 and data.median_evaluation_time_ms > 0
    assert data.metadata == {"method": "wallclock"}
    record = data.asdict()
    assert record["median_evaluation_time_ms"] == data.median_evaluation_time_ms
    assert record["metadata"] == {"method": "wallclock"}
    np.testing.assert_array_equal(f_std(arrays), f(*arrays))


@jax.custom_vjp
def _doubled(x):
    return 2.0 * x


def _doubled_fwd(x):
    # Differs from the primal on purpose: only a forward run for differentiation uses it.
    return 3.0 * x, x


_doubled.defvjp(_doubled_fwd, lambda x, dy: (2.0 * dy,))


def test_forward_res_runs_the_forward_as_differentiation_does():
    x = random_normal(5, (2, 6))
    forward, arrays = tokamax.standardize_function(_doubled, x, mode="forward")
    forward_res, arrays_res = tokamax.standardize_function(_doubled, x, mode="forward_res")
    assert_close(forward(arrays), 2.0 * x)
    assert_close(forward_res(arrays_res), 3.0 * x)
    data = tokamax.benchmark(_doubled, x, mode="forward_res", iterations=1, method="wallclock")
    assert len(data.evaluation_times_ms) == 1


def test_forward_and_vjp_returns_a_gradient_for_every_array_as_upstream():
    """Upstream's `out, (dargs,) = f_std(arrays)`: the gradients of `f_std`'s one
    argument, the list of arrays (float0 zeros for an integer one)."""
    x, y = random_normal(6, (2, 3)), random_normal(7, (2, 3))
    steps = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)

    def f(x, y, steps):
        return {"out": jnp.sin(x) * y + steps}

    f_std, arrays = tokamax.standardize_function(f, x, y, steps, mode="forward_and_vjp")
    out, (dargs,) = f_std(arrays)
    expected, pullback = jax.vjp(lambda x, y: f(x, y, steps), x, y)
    assert_close(out["out"], expected["out"])
    for got, want in zip(dargs[:2], pullback(expected), strict=True):
        assert_close(got, want)
    assert dargs[2].dtype == jax.dtypes.float0 and dargs[2].shape == steps.shape


def test_standardize_function_runs_batched_shape_dtypes_under_vmap():
    def gram(x, y):  # rank-2 operands only: the batch must come from vmap
        return jnp.matmul(x, y.T, precision=jax.lax.Precision.HIGHEST)

    x = tokamax.BatchedShapeDtype((3, 4), jnp.float32, [(0, 2)])
    y = tokamax.BatchedShapeDtype((5, 4), jnp.float32, [(1, 2)])
    assert x.vmap_shape == (2, 3, 4) and y.vmap_shape == (5, 2, 4)
    assert x.vmap_axis_sizes == (2,)
    assert x != jax.ShapeDtypeStruct((3, 4), jnp.float32)
    f_std, arrays = tokamax.standardize_function(gram, x, y, seed=7)
    assert [a.shape for a in arrays] == [(2, 3, 4), (5, 2, 4)]
    expected = jax.vmap(gram, in_axes=(0, 1))(*arrays)
    assert expected.shape == (2, 3, 5)
    assert_close(f_std(arrays), expected)
    with pytest.raises(ValueError, match="cannot mix"):
        tokamax.standardize_function(gram, x, jnp.ones((5, 4)))


def test_an_op_written_against_upstreams_generic_op_subclasses_ours():
    """Upstream's `Op[P, T, R, C, K]`: the config type fourth."""

    @dataclasses.dataclass(frozen=True)
    class Config:
        block: int = 8

    class Doubled(tokamax.Op[Any, jax.Array, None, Config, Any]):
        config_cls = Config

        def _fwd(self, x, *, config, return_residuals):
            return 2.0 * x, None

        def _get_heuristics_config(self, ba):
            return Config()

    class Plain(tokamax.Op[Config]):
        config_cls = Config

    x = random_normal(11, (2, 4))
    assert_close(Doubled()(x), 2.0 * x)
    assert typing.get_args(Doubled.__orig_bases__[0]) == typing.get_args(
        Plain.__orig_bases__[0]) == (Config,)


@dataclasses.dataclass(frozen=True)
class _TileConfig:
    tile: int


class _UpstreamStyleOp(tokamax.Op[Any, jax.Array, None, _TileConfig, Any]):
    """Written as upstream's autotuning tests write an op: the config named only in the
    generic base, no `config_cls`."""

    def _fwd(self, x, *, config, return_residuals):
        return x + config.tile, None

    def _get_heuristics_config(self, ba):
        return _TileConfig(4)

    def _get_autotuning_configs(self, ba):
        return {_TileConfig(1), _TileConfig(2)}


def test_an_op_naming_its_config_only_in_upstreams_generic_base_is_tuned():
    assert _UpstreamStyleOp.config_cls is _TileConfig
    x = jnp.zeros((2, 3))
    ba = _UpstreamStyleOp().bind(x)
    assert ba.default_config == _TileConfig(4)
    assert_close(_UpstreamStyleOp()(x), x + 4.0)
    result = tokamax.autotune([ba], progress=False, iterations=1)
    ((_, data),) = result.data
    assert set(data) == {_TileConfig(1), _TileConfig(2), _TileConfig(4)}
    with result:
        assert ba.default_config == data.fastest_config


@dataclasses.dataclass(frozen=True)
class _ShiftConfig:
    shift: int


class _UnregisteredOp(tokamax.Op[Any, jax.Array, None, _ShiftConfig, Any]):
    """A user's op, never passed to `register_serializable`."""

    def _fwd(self, x, *, config, return_residuals):
        return x + config.shift, None

    def _get_heuristics_config(self, ba):
        return _ShiftConfig(1)

    def _get_autotuning_configs(self, ba):
        return {_ShiftConfig(2)}


class _NeverLoweredOp(_UnregisteredOp):
    """Defined, never called."""


def test_an_unregistered_op_is_tuned_from_the_programs_it_lowers_in_this_process():
    """`autotune(f)` reads the op calls back from the program `f` lowers: a user's op
    reads back without registration once this process has lowered it (upstream tunes
    such ops), while a spec naming an op class this process never ran stays an error."""
    path = f"{__name__}._UnregisteredOp"
    with pytest.raises(tokamax.SpecError, match="not a registered serializable"):
        spec.resolve(path, kind="dataclass")
    x = random_normal(0, (2, 3))
    f = jax.jit(lambda x: _UnregisteredOp()(x) * 2.0)
    result = tokamax.autotune(f, x, ignore_cache=True, progress=False, iterations=1)
    ((ba, data),) = result.data
    assert type(ba.op) is _UnregisteredOp
    assert set(data) == {_ShiftConfig(1), _ShiftConfig(2)}
    assert spec.resolve(path, kind="dataclass") is _UnregisteredOp
    assert not spec.is_registered(_UnregisteredOp)
    with pytest.raises(tokamax.SpecError, match="not a registered serializable"):
        spec.resolve(f"{__name__}._NeverLoweredOp", kind="dataclass")


class _OwnConfigOp(_UpstreamStyleOp):
    config_cls = _ShiftConfig


class _SubclassOfOwnConfigOp(_OwnConfigOp):
    """Sets no `config_cls` and names no generic base of its own."""


def test_a_subclass_keeps_its_parents_config_cls_over_a_grandparents_generic_base():
    """Only a class's own `Op[...]` base names its config: a subclass inherits the
    `__orig_bases__` attribute of the first class that wrote one."""
    assert _SubclassOfOwnConfigOp.config_cls is _ShiftConfig


class _CachedUnregisteredOp(_UnregisteredOp):
    """A user's op with a measurement in the user cache, never registered."""


def test_an_unregistered_ops_user_cache_entry_is_used_from_its_first_call(tmp_path,
                                                                           monkeypatch):
    """The user cache read before the op was first called (its entry unreadable then) is
    read again when it is: the measured config runs from the first call on."""
    from tokamax_pass.autotuning import cache, keys
    from tokamax_pass.autotuning.entry import Entry, Measurement

    monkeypatch.setenv("TOKAMAX_PASS_CACHE_DIR", str(tmp_path))
    cache._USER.invalidate()
    x = random_normal(1, (2, 3))
    ba = keys.canonical(_CachedUnregisteredOp().bind(x))
    entry = Entry(ba, {_ShiftConfig(5): Measurement((1.0,))}, keys.provenance(ba.op))
    tokamax.AutotuningResult(tokamax.core.current_target().device_kind,
                             [entry]).save_to_cache()
    with pytest.warns(UserWarning, match="_CachedUnregisteredOp"):
        assert not cache._USER.result(tokamax.core.current_target().device_kind).entries
    assert_close(jax.jit(lambda x: _CachedUnregisteredOp()(x))(x), x + 5.0)
    cache._USER.invalidate()


class _UpstreamStyleFamily[C, K](tokamax.Op[Any, jax.Array, None, C, K]):
    """A family generic in its config, as upstream writes its families (`Normalization[C,
    K]`, `GatedLinearUnit[C, K]`)."""

    def _fwd(self, x, *, config, return_residuals):
        return x + config.shift, None

    def _get_heuristics_config(self, ba):
        return _ShiftConfig(3)


class _FamilyImplementation(_UpstreamStyleFamily[_ShiftConfig, Any]):
    """An implementation naming its config in the family's generic base."""


def test_an_implementation_naming_its_config_in_a_generic_familys_base_takes_it():
    assert _UpstreamStyleFamily.config_cls is NullConfig
    assert _FamilyImplementation.config_cls is _ShiftConfig
    x = random_normal(2, (2, 3))
    assert _FamilyImplementation().bind(x).default_config == _ShiftConfig(3)
