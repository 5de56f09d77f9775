"""The pass under `jax.set_mesh` (Auto axes, 8 fake CPU devices): `optimize` partitions like
`jax.jit`, its plan and its autotuning see the per-device calls, and so does `autotune`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tokamax_pass as tk
from conftest import assert_close, random_normal, reference_precision
from tokamax_pass.core import BoundArguments, Family, NullConfig, Op, register_family
from tokamax_pass.core.partition_rules import Dims, PartitionRule

pytestmark = pytest.mark.usefixtures("fake_devices")  # fails, never skips, without 8


def _mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _put(mesh, inputs, specs):
    return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(inputs, specs, strict=True)]


def _gathers(hlo: str) -> list[str]:
    return [line.strip()[:160] for line in hlo.splitlines() if "all-gather" in line]


def _layer_norm_loss(x, scale):
    return jnp.sum(jnp.sin(tk.layer_norm(x, scale, None)))


def _attention_loss(q, k, v):
    return jnp.sum(jnp.sin(tk.dot_product_attention(q, k, v, is_causal=True)))


CASES = {
    # name: loss, inputs, specs, the per-device shape of the first input as the plan shows it
    "layer_norm": (_layer_norm_loss, lambda: (random_normal(0, (8, 4, 32)),
                                              random_normal(1, (32,))),
                   (P("data", "model", None), P()), "x=f32[2,2,32]"),
    "attention": (_attention_loss, lambda: tuple(random_normal(i, (8, 16, 4, 8))
                                                 for i in range(3)),
                  (P("data", None, "model", None),) * 3, "query=f32[2,16,2,8]"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_optimize_under_set_mesh_partitions_like_jit(name):
    loss, make, specs, local = CASES[name]
    mesh = _mesh()
    inputs = _put(mesh, make(), specs)
    grad = jax.grad(loss, argnums=tuple(range(len(inputs))))
    with jax.set_mesh(mesh), reference_precision():
        for fn in (loss, grad):
            optimized = tk.optimize(fn)
            got, want = optimized(*inputs), jax.jit(fn)(*inputs)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                assert_close(g, w)
            assert _gathers(optimized.lower(*inputs).compile().as_text()) == []
            plan = optimized.plan(*inputs)
            assert len(plan) == (1 if fn is loss else 2)
            assert all(local in row.arguments for row in plan), str(plan)
        assert [row.path.split("/")[-1] for row in plan] == [
            plan[0].path, f"{plan[0].path}_vjp"]
        # jax.grad of the optimized function: its backward is re-emitted partitioned too.
        later = jax.jit(jax.grad(tk.optimize(loss), argnums=tuple(range(len(inputs)))))
        for g, w in zip(later(*inputs), grad(*inputs), strict=True):
            assert_close(g, w)
        assert _gathers(later.lower(*inputs).compile().as_text()) == []


def test_optimize_under_set_mesh_at_depth():
    """Calls inside jit, scan and remat are partitioned and planned per device too."""
    mesh = _mesh()
    x, scale = _put(mesh, (random_normal(0, (3, 8, 32)), random_normal(1, (32,))),
                    (P(None, ("data", "model"), None), P()))

    def fn(x, scale):
        ln = lambda v: tk.layer_norm(v, scale, None)
        y = jax.lax.scan(lambda c, row: (c, jax.jit(ln)(row)), 0.0, x)[1]
        return jnp.sum(jax.checkpoint(lambda v: ln(jnp.sin(v)))(y))

    with jax.set_mesh(mesh), reference_precision():
        optimized = tk.optimize(jax.grad(fn))
        assert_close(optimized(x, scale), jax.jit(jax.grad(fn))(x, scale))
        plan = optimized.plan(x, scale)
    assert {row.arguments.split(", ")[-1] for row in plan} == {"x=f32[1,32]", "x=f32[3,1,32]"}
    assert any(row.path.startswith("scan/jit") for row in plan), str(plan)


# --- a tunable op with a partition rule: x * scale over rows, computed in row chunks --------


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    chunk: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowScale(Op[NullConfig]):
    """`x * scale` (scale broadcast over the rows of `x`); partitions over rows."""

    def bind(self, x: Any, scale: Any) -> BoundArguments:
        if x.ndim != 2 or scale.shape != (x.shape[1],):
            raise ValueError(f"row_scale: x must be (rows, n), scale (n,); got {x.shape}, "
                             f"{scale.shape}")
        return BoundArguments(self, dict(x=x, scale=scale))

    def _fwd(self, x, scale, *, config, return_residuals):
        return x * scale, None

    def partition_rule(self, ba: BoundArguments) -> PartitionRule:
        rows = Dims(("rows", None))
        return PartitionRule(arguments={"x": rows}, out=rows, order=("rows",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedRowScale(RowScale):
    config_cls = ChunkConfig
    implementation = "chunked"

    def _fwd(self, x, scale, *, config, return_residuals):
        rows, n = x.shape
        return (x.reshape(rows // config.chunk, config.chunk, n) * scale).reshape(rows, n), None

    def _get_heuristics_config(self, ba):
        return ChunkConfig(1)

    def _get_autotuning_configs(self, ba):
        return {ChunkConfig(2), ChunkConfig(4)}


ROW_SCALE = register_family(Family("row_scale", {"chunked": ChunkedRowScale, "xla": RowScale},
                                   automatic=("chunked", "xla")))


def _row_scale_loss(x, scale):
    return jnp.sum(jnp.sin(ROW_SCALE("chunked", x, scale)))


def test_autotuning_under_set_mesh_tunes_per_device_shapes(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKAMAX_PASS_CACHE_DIR", str(tmp_path))
    mesh = _mesh()
    x, scale = _put(mesh, (random_normal(0, (32, 16)), random_normal(1, (16,))),
                    (P(("data", "model"), None), P()))  # 4 rows per device
    with jax.set_mesh(mesh):
        result = tk.autotune(_row_scale_loss, x, scale, progress=False)
        assert {tuple(ba.arguments["x"].shape) for ba, _ in result} == {(4, 16)}
        optimized = tk.optimize(_row_scale_loss, autotune="missing")
        np.testing.assert_allclose(optimized(x, scale), jax.jit(_row_scale_loss)(x, scale),
                                   rtol=1e-6)
        ((row,), (tuned,)) = optimized.plan(x, scale), optimized._tuned
    assert (row.arguments, row.source) == ("scale=f32[16], x=f32[4,16]", "autotuned")
    assert {tuple(ba.arguments["x"].shape) for ba, _ in tuned} == {(4, 16)}
    assert {config for _, data in tuned for config in data} == {
        ChunkConfig(1), ChunkConfig(2), ChunkConfig(4)}
