"""The ragged dot's work: ideal, and what `jax.lax.ragged_dot` does on a GPU.

Kept apart from `base.py` so the kernels' source hash (which autotuning caches key on)
does not change with the prediction rules.
"""

from __future__ import annotations

import jax

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


def lax_ragged_dot_work(ba: BoundArguments) -> Work:
    """The work `jax.lax.ragged_dot` does on a GPU: a dense product of all rows per group
    (the ideal FLOPs times the group count), so its time grows with the groups.

    The `xla` implementation calls it; an `xla` implementation that does not do dense
    work per group drops this registration."""
    ideal = ragged_dot_work(ba)
    return Work(ideal.flops * max(1, ba.arguments["group_sizes"].shape[0]), ideal.bytes)


# The gradient is two more ragged dots (`RaggedDotVjp.evidence_calls`): their work adds up.
register_family_work(RaggedDot, ragged_dot_work)
register_performed_work(RaggedDot, lax_ragged_dot_work)
