"""The ragged dot's work: ideal, and what the `xla` implementation does on a GPU.

Kept apart from `base.py` so the kernels' source hash (which autotuning caches key on)
does not change with the prediction rules.
"""

from __future__ import annotations

import math

import jax

from tokamax_kernels.ragged_dot import xla_tiled
from tokamax_kernels.ragged_dot.base import RaggedDot
from tokamax_pass.core import BoundArguments, Work
from tokamax_pass.core.roofline import nbytes, register_family_work, register_performed_work


def ragged_dot_work(ba: BoundArguments) -> Work:
    """One product over all rows, every variant 2 M K N FLOPs (see `base`'s table); the
    operands read and the output written once."""
    lhs, rhs, variant = ba.arguments["lhs"], ba.arguments["rhs"], ba.arguments["variant"]
    m, inner = lhs.shape
    # The output's other dimension: N (forward, drhs) or K (dlhs: rhs is (G, K, N)).
    other = rhs.shape[-2] if variant == "dlhs" else rhs.shape[-1]
    groups = ba.arguments["group_sizes"].shape[0]
    out_dtype = ba.arguments["preferred_element_type"]
    out = jax.ShapeDtypeStruct((groups, inner, other) if variant == "drhs" else (m, other),
                               lhs.dtype if out_dtype is None else out_dtype)
    return Work(2.0 * m * inner * other, nbytes(lhs) + nbytes(rhs) + nbytes(out))


def xla_ragged_dot_work(ba: BoundArguments) -> Work:
    """The work the `xla` implementation does on a GPU, by the form it runs there
    (`base._runs_tiled` with `xla_tiled.DEFAULT_RULE`): the tiled form multiplies
    M + G * T rows and gathers each tile's matrix; `jax.lax.ragged_dot` multiplies all
    rows by every group's matrix (the ideal FLOPs times the group count)."""
    ideal = ragged_dot_work(ba)
    lhs, rhs = ba.arguments["lhs"], ba.arguments["rhs"]
    p = xla_tiled.problem(lhs, rhs, ba.arguments["group_sizes"], ba.arguments["variant"])
    rule = xla_tiled.DEFAULT_RULE
    same_float = lhs.dtype == rhs.dtype and jax.numpy.issubdtype(lhs.dtype, jax.numpy.floating)
    if same_float and rule.prefers_tiled(p):
        tile = rule.tile_rows(p)
        tiles = -(-p.m // tile) + p.groups
        gathered = tiles * p.k * p.n * p.itemsize
        return Work(2.0 * tiles * tile * p.k * p.n, ideal.bytes + 3 * gathered)
    return Work(ideal.flops * max(1, p.groups), ideal.bytes)


def features(ba: BoundArguments) -> tuple[float, ...]:
    """The mean rows a group (log2): few rows a group leave a kernel's row tiles mostly
    empty and make the weights' bytes dominate, at any total work."""
    rows = ba.arguments["lhs"].shape[0]
    groups = max(1, ba.arguments["group_sizes"].shape[0])
    return (math.log2(max(1.0, rows / groups)),)


# The gradient is two more ragged dots (`RaggedDotVjp.evidence_calls`): their work adds up.
register_family_work(RaggedDot, ragged_dot_work, features=features)
register_performed_work(RaggedDot, xla_ragged_dot_work)
