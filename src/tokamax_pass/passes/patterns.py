"""Plain-JAX patterns `optimize` recognizes in a jaxpr and can replace by an op call.

A pattern looks at one equation (and, for `graph` patterns, the region of equations it
ends) and answers with a `Candidate`: a function computing the same value through an op
family (traced by the pass, which keeps it only where `implementation=None` picks a
kernel), or the reason it is left alone (a near-miss: dimension numbers, dtypes or
options the op does not cover).

Patterns:

- `"ragged_dot"`: `ragged_dot_general` equations (what `jax.lax.ragged_dot` binds, and
  the ragged dots of its gradient and of `jax.vmap` over it) whose dimension numbers
  are one of the ragged-dot family's variants, after leading batch dimensions.
- `"dot_product_attention"`: `jax.nn.dot_product_attention` calls, recognized while the
  function is traced (`patterns_attention`).
- `"layer_norm"`: LayerNorm and RMSNorm written in `jnp` (`patterns_norm`).
- `"gated_linear_unit"`: `act(x @ w_gate) * (x @ w_up)` and the fused weight split in
  two, also over ragged dots (MoE experts: the grouped op, which then takes the ragged
  dots from the `"ragged_dot"` pattern; `enclosing_root`) (`patterns_glu`).
- `"linear_softmax_cross_entropy_loss"`: the per-token softmax cross-entropy of `x @ w`
  against integer labels (`patterns_cross_entropy`).
- `"attention"`: attention written out, `softmax(scale * q @ k^T ...) @ v`
  (`patterns_attention_einsum`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import source_info_util

from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.passes import (
    patterns_attention_einsum,
    patterns_cross_entropy,
    patterns_glu,
    patterns_norm,
)
from tokamax_pass.passes.candidate import Candidate
from tokamax_pass.passes.graph import Graph


@dataclasses.dataclass(frozen=True)
class RewriteMatch:
    """One equation a pattern matched, and what the pass did with it.

    `implementation` is the implementation chosen per platform where the equation was
    rewritten, and `reason` what chose it there ("cuda PallasMosaicGpuFlashAttention:
    heuristics; predicted: ...", one entry per platform and op call, joined by " | ":
    each call's source, what ranked it, and why it stands in for the implementation the
    target would run where this machine cannot lower that one); otherwise `reason` says
    why it was left alone. `plain_calls`: where the
    plain path was chosen, the op calls the rewrite would make, unconfigured (what
    `autotune="always"` measures, so that a kernel measured faster is found).
    """

    pattern: str
    path: str
    source_line: str
    rewritten: bool
    implementation: Mapping[str, str]
    reason: str = ""
    plain_calls: tuple[BoundArguments, ...] = dataclasses.field(default=(), compare=False,
                                                                repr=False)

    @property
    def outcome(self) -> str:
        if self.rewritten:
            return "rewritten: " + ", ".join(
                f"{platform} {name}" for platform, name in self.implementation.items())
        return f"left alone: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "path": self.path, "source_line": self.source_line,
                "rewritten": self.rewritten, "implementation": dict(self.implementation),
                "reason": self.reason}


def source_line(eqn: Any) -> str:
    """`file:line (function)` of the user code that made `eqn`, or `""` when unknown."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return ""
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


# --- ragged dot ------------------------------------------------------------------------

# The ragged-dot family's variants (`tokamax_kernels.ragged_dot.base`) as
# `(lhs contracting, rhs contracting, lhs ragged, rhs group)` dimensions, no batch.
_RAGGED_DOT_VARIANTS: dict[tuple[tuple[int, ...], ...], str] = {
    ((1,), (1,), (0,), (0,)): "forward",
    ((1,), (2,), (0,), (0,)): "dlhs",
    ((0,), (0,), (0,), ()): "drhs",
}


def _ragged_dot_variant(numbers: Any) -> tuple[str, int] | None:
    """`(variant, batch dimensions)` for dimension numbers that are a variant after
    leading batch dimensions shared by both operands, else `None`."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = numbers.dot_dimension_numbers
    batch = len(lhs_batch)
    if tuple(lhs_batch) != tuple(range(batch)) or tuple(rhs_batch) != tuple(range(batch)):
        return None
    key = tuple(tuple(int(d) - batch for d in dims) for dims in (
        lhs_contract, rhs_contract, numbers.lhs_ragged_dimensions,
        numbers.rhs_group_dimensions))
    variant = _RAGGED_DOT_VARIANTS.get(key)
    return None if variant is None else (variant, batch)


def _match_ragged_dot(eqn: Any) -> Candidate:
    params = eqn.params
    numbers = params["ragged_dot_dimension_numbers"]
    found = _ragged_dot_variant(numbers)
    if found is None:
        return Candidate("ragged_dot", None, f"dimension numbers {numbers} are no variant of "
                                             "ragged_dot")
    if params.get("group_offset") is not None:
        return Candidate("ragged_dot", None, "group_offset is not supported")
    if not _replicated(params.get("out_sharding")):
        return Candidate("ragged_dot", None, "an out_sharding that splits the output is not "
                                             "supported")
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    if not all(jnp.issubdtype(a.dtype, jnp.floating) for a in (lhs, rhs)):
        return Candidate("ragged_dot", None, f"operands {lhs.dtype} and {rhs.dtype} are not "
                                             "both floating")
    wanted = params.get("preferred_element_type")
    if wanted is not None and not jnp.issubdtype(wanted, jnp.floating):
        return Candidate("ragged_dot", None, f"preferred_element_type {wanted} is not "
                                             "floating")
    variant, batch = found
    precision = params.get("precision")

    def function(lhs: Any, rhs: Any, group_sizes: Any) -> Any:
        from tokamax_kernels.ragged_dot.api import FAMILY

        def one(lhs: Any, rhs: Any, group_sizes: Any) -> Any:
            return FAMILY(None, lhs, rhs, group_sizes, precision=precision,
                          preferred_element_type=wanted, variant=variant)

        for _ in range(batch):
            one = jax.vmap(one)
        out = one(lhs, rhs, group_sizes)
        # A ragged contraction puts the group dimension before the batch dimensions.
        return jnp.moveaxis(out, batch, 0) if variant == "drhs" else out

    return Candidate("ragged_dot", function)


# Pattern name -> (primitives it is matched at, matcher). A matcher answers `None` where
# the equation is no instance at all. `"dot_product_attention"` is matched while the
# function is traced (`patterns_attention`), at no equation.
_PATTERNS: dict[str, tuple[frozenset[str], Callable[[Any, Graph | None], Candidate | None]
                           | None]] = {
    "ragged_dot": (frozenset({"ragged_dot_general"}),
                   lambda eqn, graph: _match_ragged_dot(eqn)),
    "dot_product_attention": (frozenset(), None),
    "layer_norm": (patterns_norm.PRIMITIVES, patterns_norm.match),
    "gated_linear_unit": (patterns_glu.PRIMITIVES, patterns_glu.match),
    "linear_softmax_cross_entropy_loss": (patterns_cross_entropy.PRIMITIVES,
                                          patterns_cross_entropy.match),
    "attention": (patterns_attention_einsum.PRIMITIVES, patterns_attention_einsum.match),
}
NAMES = tuple(_PATTERNS)
# Patterns matched over several equations, whose derivatives read values inside them: a
# function JAX differentiates or maps is rewritten before (`transforms`). A ragged dot is
# one equation, and JAX's derivative of it ragged dots this pattern matches too.
REGIONS = frozenset({"layer_norm", "gated_linear_unit", "linear_softmax_cross_entropy_loss",
                     "attention"})


def selected(rewrite: bool | str | Sequence[str]) -> frozenset[str]:
    """The pattern names an `optimize(..., rewrite=)` argument turns on: all for `True`,
    none for `False`, else the names given (each one of `NAMES`)."""
    if rewrite is True:
        return frozenset(NAMES)
    if rewrite is False:
        return frozenset()
    names = (rewrite,) if isinstance(rewrite, str) else rewrite
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"optimize: rewrite must be True, False or a sequence of pattern names "
                        f"from {NAMES}, got {rewrite!r}")
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise ValueError(f"optimize: unknown rewrite patterns {unknown}; known: {NAMES}")
    return frozenset(names)


def primitives(names: frozenset[str]) -> frozenset[str]:
    """The primitives the patterns `names` are matched at."""
    return frozenset().union(*(_PATTERNS[name][0] for name in names))


def match(eqn: Any, names: frozenset[str], graph: Graph | None = None) -> Candidate | None:
    """The candidate of the first pattern in `names` that matches at `eqn`, if any."""
    for name in NAMES:
        primitive_names, matcher = _PATTERNS[name]
        if name in names and matcher is not None and eqn.primitive.name in primitive_names:
            candidate = matcher(eqn, graph)
            if candidate is not None:
                return candidate
    return None


def enclosing_root(eqn: Any, names: frozenset[str], graph: Graph | None) -> Any:
    """The equation ending a larger match of `names` whose region holds `eqn`, or
    `None`: a ragged dot that is a grouped gated linear unit's projection
    (`patterns_glu.grouped_unit_root`). The larger match takes `eqn` where it is kept;
    else `eqn` is matched on its own."""
    if (graph is None or eqn.primitive.name != "ragged_dot_general"
            or "gated_linear_unit" not in names):
        return None
    return patterns_glu.grouped_unit_root(graph, eqn)


def _replicated(sharding: Any) -> bool:
    """Whether an `out_sharding` param asks for nothing beyond the default: none, or a
    spec that splits no dimension (as JAX's transposes carry under an abstract mesh)."""
    if sharding is None:
        return True
    spec = getattr(sharding, "spec", None)
    return spec is not None and all(axis is None for axis in spec)
