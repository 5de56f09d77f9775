"""The ragged-dot family: argument checks, the XLA reference and the VJP op.

A ragged dot multiplies row groups of `lhs` (M, K) by per-group matrices `rhs`
(G, K, N): rows `[start_g, start_g + group_sizes[g])` use `rhs[g]`; rows past
`sum(group_sizes)` give zeros. Its gradients are ragged dots too, so the family
has three `variant`s and the VJP op calls the family once per gradient: each
gradient is a `tokamax_call` of its own, found and tuned as its own shape.

  variant    lhs        rhs          out         per group g
  "forward"  x (M,K)    w (G,K,N)    (M,N)       x_g @ w_g
  "dlhs"     dy (M,N)   w (G,K,N)    (M,K)       dy_g @ w_g^T
  "drhs"     x (M,K)    dy (M,N)     (G,K,N)     x_g^T @ dy_g (zeros for empty groups)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.lax import RaggedDotDimensionNumbers

from tokamax_kernels import _validation as v
from tokamax_kernels.ragged_dot import xla_tiled
from tokamax_pass.core import BoundArguments, Op, Target, VjpOp, current_target

_OP = "ragged_dot"
VARIANTS = ("forward", "dlhs", "drhs")

# `jax.lax.ragged_dot_general` dimension numbers of each variant (lhs rows are ragged).
_DIMENSION_NUMBERS = {
    "forward": RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,)),
    "dlhs": RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,)),
    "drhs": RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ()),
}


def canonical_precision(precision: Any, *, op: str) -> Any:
    """`None`, one `jax.lax.Precision`, a pair of them (strings like "highest" accepted), or
    a `jax.lax.DotAlgorithmPreset` (as `jax.lax.dot_general` and upstream Tokamax take)."""
    if precision is None or isinstance(precision, jax.lax.DotAlgorithmPreset):
        return precision
    try:
        if isinstance(precision, (tuple, list)):
            if len(precision) != 2:
                raise ValueError
            return tuple(jax.lax.Precision(p) for p in precision)
        return jax.lax.Precision(precision)
    except (ValueError, TypeError, KeyError):
        raise ValueError(
            f"{op}: precision must be None, a jax.lax.Precision (or its name, e.g. 'highest'), "
            f"a pair of them or a jax.lax.DotAlgorithmPreset, got {precision!r}"
        ) from None


def canonical_dtype(dtype: Any, *, name: str, op: str) -> np.dtype | None:
    if dtype is None:
        return None
    try:  # float64 is float32 without x64, as jax.lax takes it (lowering one fails)
        return np.dtype(jax.dtypes.canonicalize_dtype(jnp.dtype(dtype)))
    except TypeError:
        raise ValueError(
            f"{op}: {name} must be None or a dtype (e.g. jnp.float32), got {dtype!r}"
        ) from None


def _require_real(name: str, value: Any) -> None:
    """Floating or integer: `jax.lax.ragged_dot`'s operands that an op spec can name."""
    if not (jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)):
        raise ValueError(
            f"{_OP}: {name} must be a floating-point or integer array, got dtype {value.dtype}")


# Mean rows a group at or below which a row-grouping kernel is bound by reading the
# groups' weights, not by its matmuls (a decode step's MoE layer: 24 rows a group).
FEW_ROWS_PER_GROUP = 64


def few_rows_per_group(ba: BoundArguments) -> bool:
    """True for a forward or dlhs call whose groups average `FEW_ROWS_PER_GROUP` rows or
    fewer: kernels then pick tiles that waste fewer padded rows and stream the weights
    through deeper pipelines."""
    args = ba.arguments
    groups = args["group_sizes"].shape[0]
    if args["variant"] == "drhs" or groups == 0:
        return False
    return args["lhs"].shape[0] / groups <= FEW_ROWS_PER_GROUP


def _check_concrete_group_sizes(group_sizes: Any, m: int) -> None:
    """Negative sizes or a total above M are errors when the sizes are known now (the
    total only against a known M: a symbolic one, under `jax.export`, cannot be compared)."""
    if isinstance(group_sizes, (jax.core.Tracer, jax.ShapeDtypeStruct)):
        return
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
        raise ValueError(f"{_OP}: group_sizes must be >= 0, got {sizes.tolist()}")
    if isinstance(m, int) and int(sizes.sum()) > m:
        raise ValueError(
            f"{_OP}: group_sizes sum to {int(sizes.sum())}, more than the {m} rows of lhs"
        )


PATHS = ("auto", "lax", "tiled")


def _runs_tiled(path: str, rule: xla_tiled.TilingRule, variant: str, lhs: Any, rhs: Any,
                group_sizes: Any) -> bool:
    """`path` "auto": tiled on platforms whose `jax.lax.ragged_dot` is dense per group
    (`xla_tiled.TILED_PLATFORMS`), for floating operands of one dtype, where
    `rule` predicts the tiled form well ahead of `jax.lax.ragged_dot`. Never for symbolic
    shapes (`jax.export`): the tiles need the row count, `jax.lax.ragged_dot` does not."""
    if path != "auto":
        return path == "tiled"
    if not all(isinstance(d, int) for d in (*lhs.shape, *rhs.shape)):
        return False
    if current_target().platform not in xla_tiled.TILED_PLATFORMS:
        return False
    if lhs.dtype != rhs.dtype or not jnp.issubdtype(lhs.dtype, jnp.floating):
        return False
    return rule.prefers_tiled(xla_tiled.problem(lhs, rhs, group_sizes, variant))


@functools.cache
def xla_ragged_dot(variant: str, precision: Any, preferred_element_type: Any,
                   path: str = "auto", rule: xla_tiled.TilingRule | None = None) -> Callable:
    """`jax.lax.ragged_dot_general` for `variant`, with batching and gradient rules of its own.

    `path`: "lax" calls `jax.lax.ragged_dot_general`; "tiled" runs `xla_tiled` (work in
    proportion to the rows, not groups times rows); "auto" picks by platform and shape
    (`_runs_tiled`) when the call is traced, after any batch is folded in. `rule`: the
    tiling (`xla_tiled.DEFAULT_RULE` when `None`). Gradients take the same path and rule.

    JAX batches a ragged dot only when all three operands carry the batch axis, so
    under `jax.vmap` the batch is folded into the groups instead: each batch entry
    gets its G groups plus one padding group over its rows past the sum (times a
    zero matrix), and the result is one ragged dot, exact and unbatched at this level.
    """

    if path not in PATHS:
        raise ValueError(f"{_OP}: path must be one of {PATHS}, got {path!r}")
    tiling = rule or xla_tiled.DEFAULT_RULE

    @jax.custom_batching.custom_vmap
    def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        if _runs_tiled(path, tiling, variant, lhs, rhs, group_sizes):
            return xla_tiled.tiled_ragged_dot(
                lhs, rhs, group_sizes, variant=variant,
                dimension_numbers=_DIMENSION_NUMBERS[variant], precision=precision,
                preferred_element_type=preferred_element_type, rule=tiling)
        return jax.lax.ragged_dot_general(
            lhs, rhs, group_sizes, _DIMENSION_NUMBERS[variant], precision=precision,
            preferred_element_type=preferred_element_type,
        )

    @ragged_dot.def_vmap
    def _fold_batch(axis_size: int, in_batched: Any, lhs: jax.Array, rhs: jax.Array,
                    group_sizes: jax.Array) -> tuple[jax.Array, bool]:
        lhs, rhs, group_sizes = (
            x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip((lhs, rhs, group_sizes), in_batched, strict=True)
        )
        b, m = lhs.shape[:2]
        if jnp.iinfo(group_sizes.dtype).max < b * m:  # `bind` checked m rows, not b * m
            group_sizes = group_sizes.astype(jnp.int32)
        # Each entry's group ends, clipped to its own rows: sizes summing past them (or
        # negative, unchecked once traced) would otherwise shift every later entry's
        # groups. Clipped, an entry's groups past its rows are empty, as unbatched.
        ends = jax.lax.cummax(jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32), axis=1),
                                       0, m), axis=1)
        group_sizes = jnp.diff(ends, axis=1, prepend=0).astype(group_sizes.dtype)
        pad = (m - ends[:, -1:]).astype(group_sizes.dtype)
        sizes = jnp.concatenate([group_sizes, pad], axis=1).reshape(-1)
        lhs = lhs.reshape(b * m, -1)
        if variant == "drhs":
            out = ragged_dot(lhs, rhs.reshape(b * m, -1), sizes)
            return out.reshape(b, -1, *out.shape[1:])[:, :-1], True
        rhs = jnp.concatenate([rhs, jnp.zeros_like(rhs[:, :1])], axis=1)
        out = ragged_dot(lhs, rhs.reshape(-1, *rhs.shape[2:]), sizes)
        return out.reshape(b, m, -1), True

    # `custom_vmap` has no autodiff: give it the family's own gradients (see `_GRADIENTS`).
    @jax.custom_vjp
    def differentiable(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return ragged_dot(lhs, rhs, group_sizes)

    def fwd(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> tuple[jax.Array, Any]:
        return ragged_dot(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def bwd(saved: Any, dout: jax.Array) -> tuple[jax.Array, jax.Array, None]:
        lhs, rhs, group_sizes = saved
        calls = _gradient_calls(dout=dout, lhs=lhs, rhs=rhs, group_sizes=group_sizes,
                                precision=precision, variant=variant)
        dlhs, drhs = (
            xla_ragged_dot(kw["variant"], kw["precision"], kw["preferred_element_type"],
                           path, rule)(*args)
            for args, kw in (calls["lhs"], calls["rhs"])
        )
        return dlhs, drhs, None

    differentiable.defvjp(fwd, bwd)
    return differentiable


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedDot(Op[Any]):
    """The ragged dot (all three variants) by `jax.lax.ragged_dot_general`."""

    def partition_rule(self, ba: BoundArguments) -> Any:
        """How a call splits over devices (`tokamax_pass.core.sharding`)."""
        from tokamax_kernels.ragged_dot.sharding import partition_rule

        return partition_rule(ba)

    def bind(self, lhs: Any, rhs: Any, group_sizes: Any, *, precision: Any = None,
             preferred_element_type: Any = None, variant: str = "forward") -> BoundArguments:
        if variant not in VARIANTS:
            raise ValueError(f"{_OP}: variant must be one of {VARIANTS}, got {variant!r}")
        v.require_rank("lhs", lhs, (2,), op=_OP)
        v.require_rank("rhs", rhs, (2,) if variant == "drhs" else (3,), op=_OP)
        v.require_rank("group_sizes", group_sizes, (1,), op=_OP)
        _require_real("lhs", lhs)
        _require_real("rhs", rhs)
        if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
            raise ValueError(
                f"{_OP}: group_sizes must be an integer array (e.g. int32), got {group_sizes.dtype}"
            )
        m = lhs.shape[0]
        v.require_sizes_dtype_holds("group_sizes", group_sizes, m, op=_OP, rows_of="lhs")
        if variant == "forward" and lhs.shape[1] != rhs.shape[1]:
            raise ValueError(
                f"{_OP}: K mismatch: lhs is {tuple(lhs.shape)} (M, K) but rhs is "
                f"{tuple(rhs.shape)} (G, K, N)"
            )
        if variant == "dlhs" and lhs.shape[1] != rhs.shape[2]:
            raise ValueError(
                f"{_OP}: N mismatch: lhs (the output cotangent) is {tuple(lhs.shape)} (M, N) but "
                f"rhs is {tuple(rhs.shape)} (G, K, N)"
            )
        if variant == "drhs" and rhs.shape[0] != m:
            raise ValueError(
                f"{_OP}: M mismatch: lhs is {tuple(lhs.shape)} (M, K) but rhs (the output "
                f"cotangent) is {tuple(rhs.shape)} (M, N)"
            )
        if variant != "drhs" and group_sizes.shape[0] != rhs.shape[0]:
            raise ValueError(
                f"{_OP}: group_sizes must have shape ({rhs.shape[0]},) (one size per group of "
                f"rhs), got {tuple(group_sizes.shape)}"
            )
        _check_concrete_group_sizes(group_sizes, m)
        return BoundArguments(self, dict(
            lhs=lhs, rhs=rhs, group_sizes=group_sizes,
            precision=canonical_precision(precision, op=_OP),
            preferred_element_type=canonical_dtype(
                preferred_element_type, name="preferred_element_type", op=_OP),
            variant=variant,
        ))

    def _fwd(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, precision: Any,
             preferred_element_type: Any, variant: str, config: Any,
             return_residuals: bool) -> tuple[jax.Array, None]:
        return xla_ragged_dot(variant, precision, preferred_element_type)(
            lhs, rhs, group_sizes), None

    def _default_vjp(self) -> Op:
        return RaggedDotVjp(inner=self.replace(config=None, vjp=None))

    def random_arguments(self, ba: BoundArguments, seed: int) -> dict[str, Any]:
        """Autotuning inputs: normal operands and uneven group sizes that fill all M rows.

        Uniform-ish but uneven sizes (as a MoE router gives) keep timings honest: random
        small integers would leave most rows outside every group.
        """
        arguments = dict(ba.arguments)
        lead = [[level.size for level in ba.vmap if level.axes[i] is not None] for i in range(3)]
        keys = jax.random.split(jax.random.key(seed), 3)
        for i, name in enumerate(("lhs", "rhs")):
            shape = (*lead[i], *arguments[name].shape)
            arguments[name] = jax.random.normal(keys[i], shape).astype(arguments[name].dtype)
        m, groups = arguments["lhs"].shape[-2], arguments["group_sizes"].shape[0]
        weights = jax.random.uniform(keys[2], (groups,), minval=0.5, maxval=1.5)
        sizes = jnp.floor(weights / weights.sum() * m).astype(jnp.int32)
        group_sizes = sizes.at[0].add(m - sizes.sum()).astype(arguments["group_sizes"].dtype)
        arguments["group_sizes"] = jnp.broadcast_to(group_sizes, (*lead[2], groups))
        return arguments


# The gradients of each variant, as ragged dots: {argument: (variant, first, second)}, where
# "dout" is the output cotangent and "lhs"/"rhs" the variant's own operands.
_GRADIENTS = {
    "forward": {"lhs": ("dlhs", "dout", "rhs"), "rhs": ("drhs", "lhs", "dout")},
    "dlhs": {"lhs": ("forward", "dout", "rhs"), "rhs": ("drhs", "dout", "lhs")},
    "drhs": {"lhs": ("dlhs", "rhs", "dout"), "rhs": ("forward", "lhs", "dout")},
}


def _as_dtype(x: Any, dtype: Any) -> Any:
    if isinstance(x, jax.Array):
        return x.astype(dtype)
    return jax.ShapeDtypeStruct(x.shape, dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedDotVjp(VjpOp):
    """The ragged-dot gradient as two more ragged dots of the family (see `_GRADIENTS`).

    `inner` runs both, each as a nested op call so autotuning finds each gradient as
    its own shape. The cotangent is cast to the dtype of the operand it multiplies
    (kernels take one input dtype); each gradient comes out in its argument's dtype.
    """

    inner: Op = dataclasses.field(default_factory=RaggedDot)

    forward_family = RaggedDot

    @property
    def runs_without_evidence(self) -> bool:
        return self.inner.runs_without_evidence

    def reference_op(self) -> Op:
        return RaggedDotVjp(inner=self.inner.reference_op())

    def evidence_calls(self, ba: BoundArguments) -> list[BoundArguments]:
        """The gradients' own ragged dots: a VJP is as fast as they are measured."""
        arguments = {k: val for k, val in ba.arguments.items() if k not in ("residuals", "out")}
        return [self.inner.bind(*args, **kwargs).replace(vmap=ba.vmap)
                for args, kwargs in _gradient_calls(**arguments).values()]

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        # Each gradient runs under the same vmaps as this call.
        for args, kwargs in _gradient_calls(**ba.arguments).values():
            inner_ba = self.inner.bind(*args, **kwargs).replace(vmap=ba.vmap)
            self.inner.check_supported(inner_ba, target)

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Any, return_residuals: bool,
             **forward_arguments: Any) -> tuple[dict[str, Any], None]:
        calls = _gradient_calls(dout=dout, **forward_arguments)
        return {name: self.inner(*args, **kwargs) for name, (args, kwargs) in calls.items()}, None


def _gradient_calls(*, dout: Any, lhs: Any, rhs: Any, group_sizes: Any, precision: Any,
                    variant: str, **_: Any) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """`{argument: (args, kwargs)}` of the ragged dots that give each gradient."""
    operands = {"lhs": lhs, "rhs": rhs, "dout": dout}
    calls = {}
    for name, (grad_variant, first, second) in _GRADIENTS[variant].items():
        a, b = operands[first], operands[second]
        if first == "dout":
            a = _as_dtype(a, b.dtype)
        else:
            b = _as_dtype(b, a.dtype)
        calls[name] = ((a, b, group_sizes), dict(
            precision=precision, preferred_element_type=operands[name].dtype,
            variant=grad_variant))
    return calls
