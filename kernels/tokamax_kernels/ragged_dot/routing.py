"""Mixture-of-experts routing around `ragged_dot`: sort token copies by expert, and back.

`moe_dispatch(x, expert_ids, num_experts)` gives the rows a ragged dot takes (each token
repeated once per chosen expert, sorted by expert) and `group_sizes`;
`moe_combine(expert_out, routing, weights)` puts the experts' rows back in token order
and adds each token's copies, weighted.

Why a function of the library: written the plain way (`x[order // k]`, then
`zeros.at[order].set(out)`), autodiff transposes the row gather into a scatter-add with
repeated indices and the forward's `.at[].set` is a scatter, several times slower on the
H200; here every direction is a gather through `order` or its inverse permutation, with
bitwise equal results (`benchmarks/probes/moe_routing_probe.py`). Plain XLA, no kernel:
nothing to choose or tune, so these are functions, not ops.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_kernels import _validation as v

_DISPATCH = "moe_dispatch"
_COMBINE = "moe_combine"


@functools.partial(jax.tree_util.register_dataclass, data_fields=("order", "inverse", "kept"),
                   meta_fields=("tokens_shape", "top_k"))
@dataclasses.dataclass(frozen=True)
class MoeRouting:
    """How `moe_dispatch` sorted the token copies (a pytree: it passes through `jax.jit`).

    `order[r]`: the token copy (`token * top_k + j`, `j` the copy's place in
    `expert_ids[token]`) at sorted row `r`; `inverse`: its inverse permutation, the
    sorted row of each copy. `kept`: how many copies an expert takes (the sum of
    `group_sizes`; the dropped ones sort after them). `tokens_shape`: the leading axes
    of `x`."""

    order: jax.Array
    inverse: jax.Array
    kept: jax.Array
    tokens_shape: tuple[int, ...]
    top_k: int


def moe_dispatch(x: jax.Array, expert_ids: jax.Array, num_experts: int
                 ) -> tuple[jax.Array, jax.Array, MoeRouting]:
    """`(rows, group_sizes, routing)`: the rows of `x` (..., W) once per chosen expert in
    `expert_ids` (..., top_k), sorted by expert (stable: token order within an expert),
    as `ragged_dot(rows, w, group_sizes)` takes them; `group_sizes` (num_experts,)
    int32. Ids outside `[0, num_experts)` drop their copy (capacity limits can set an
    id to `num_experts` for that): it sorts after every group, is not counted in
    `group_sizes`, and `moe_combine` leaves it out whatever the experts wrote there.
    The gradient with respect to `x` gathers each token's copies by the inverse
    permutation and adds them in float32."""
    v.require_rank("x", x, range(2, 64), op=_DISPATCH)
    v.require_float("x", x, op=_DISPATCH)
    v.require_rank("expert_ids", expert_ids, range(2, 64), op=_DISPATCH)
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"{_DISPATCH}: expert_ids must be an integer array (..., top_k), got "
                         f"{expert_ids.dtype}")
    if tuple(expert_ids.shape[:-1]) != tuple(x.shape[:-1]):
        raise ValueError(f"{_DISPATCH}: expert_ids must have shape {tuple(x.shape[:-1])} + "
                         f"(top_k,): x's leading axes, then the experts of each token; got "
                         f"{tuple(expert_ids.shape)} for x of shape {tuple(x.shape)}")
    if (isinstance(num_experts, (bool, np.bool_)) or not isinstance(num_experts, (int, np.integer))
            or num_experts < 1):
        raise ValueError(f"{_DISPATCH}: num_experts must be a Python int >= 1 (static: it "
                         f"sets the shape of group_sizes), got {num_experts!r}")
    num_experts = int(num_experts)  # a NumPy integer (a config read with NumPy) is static too
    for name, array in (("x", x), ("expert_ids", expert_ids)):
        _require_tokens_unsharded(_DISPATCH, name, array)
    tokens_shape, top_k = tuple(x.shape[:-1]), int(expert_ids.shape[-1])
    if top_k == 0 or x.shape[-1] == 0:
        raise ValueError(f"{_DISPATCH}: each token must choose at least one expert and have "
                         f"features: expert_ids (..., top_k) with top_k >= 1 and x (..., W) "
                         f"with W >= 1; got expert_ids {tuple(expert_ids.shape)}, x "
                         f"{tuple(x.shape)}")
    copies = math.prod(tokens_shape) * top_k
    if copies >= 2**31:
        raise ValueError(f"{_DISPATCH}: {copies} token copies (tokens x top_k) do not fit "
                         f"int32 row indices; dispatch fewer tokens per call")
    ids = expert_ids.reshape(copies)
    # Dropped copies (ids out of range) become expert `num_experts`, sorting last. The range
    # is checked in the ids' own dtype only where `num_experts` fits it: uint8 ids against
    # 256 experts compared with 256 wrapped to 0, and every copy went to expert 0.
    in_range = ids >= 0
    if num_experts <= jnp.iinfo(ids.dtype).max:
        in_range &= ids < num_experts
    ids = jnp.where(in_range, ids.astype(jnp.int32), num_experts)
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(copies, dtype=jnp.int32),
                                                  unique_indices=True)
    group_sizes = jnp.bincount(ids, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    flat = x.reshape(-1, x.shape[-1])
    kept = jnp.sum(ids < num_experts, dtype=jnp.int32)
    routing = MoeRouting(order, inverse, kept, tokens_shape, top_k)
    return _gather_copies(flat, order, inverse, top_k), group_sizes, routing


def moe_combine(expert_out: jax.Array, routing: MoeRouting, weights: jax.Array
                ) -> jax.Array:
    """`out[token] = sum_j weights[token, j] * expert_out[row of copy (token, j)]`, shape
    `tokens_shape + (N,)` in `expert_out`'s dtype, the products and sum in float32.
    `expert_out` (copies, N) is in `moe_dispatch`'s sorted order (e.g. the ragged dot's
    output); `weights` (..., top_k) are the routing weights. Dropped copies add nothing
    (and get zero gradients). Gradients: `expert_out`'s
    gathers by `order`, `weights`' is a row dot."""
    if not isinstance(routing, MoeRouting):
        raise ValueError(f"{_COMBINE}: routing must be the MoeRouting that moe_dispatch "
                         f"returned, got {type(routing).__name__}")
    v.require_rank("expert_out", expert_out, (2,), op=_COMBINE)
    v.require_float("expert_out", expert_out, op=_COMBINE)
    copies = routing.order.shape[0]
    if expert_out.shape[0] != copies or expert_out.shape[1] == 0:
        raise ValueError(f"{_COMBINE}: expert_out must have one row per token copy "
                         f"({copies}, N) with N >= 1, in moe_dispatch's order; got shape "
                         f"{tuple(expert_out.shape)}")
    v.require_float("weights", weights, op=_COMBINE)
    expected = routing.tokens_shape + (routing.top_k,)
    if tuple(weights.shape) != expected:
        raise ValueError(f"{_COMBINE}: weights must have shape {expected} (one weight per "
                         f"token and chosen expert, as expert_ids), got "
                         f"{tuple(weights.shape)}")
    for name, array in (("expert_out", expert_out), ("weights", weights)):
        _require_tokens_unsharded(_COMBINE, name, array)
    wide = jnp.promote_types(expert_out.dtype, jnp.float32)
    per_copy = _ungather(expert_out, routing.order, routing.inverse)
    per_copy = per_copy.reshape(-1, routing.top_k, expert_out.shape[1]).astype(wide)
    kept = (routing.inverse < routing.kept).reshape(-1, routing.top_k, 1)
    flat_weights = jnp.where(kept, weights.reshape(-1, routing.top_k, 1).astype(wide), 0)
    out = jnp.sum(per_copy * flat_weights, axis=1)
    return out.astype(expert_out.dtype).reshape(routing.tokens_shape + (expert_out.shape[1],))


def _require_tokens_unsharded(op: str, name: str, array: jax.Array) -> None:
    """Under Explicit mesh axes an array's type carries its sharding, and JAX refuses to
    sort or gather along a sharded axis; the routing orders every token of the call
    together, so its token axes (all but the last) must be whole on each device."""
    sharding = getattr(jax.typeof(array), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if (sharding is None or mesh is None or mesh.empty
            or jax.sharding.AxisType.Explicit not in mesh.axis_types):
        return
    sharded = [axis for axis in tuple(sharding.spec)[:array.ndim - 1] if axis is not None]
    if sharded:
        raise ValueError(
            f"{op}: {name} is sharded over its token axes ({sharded}) under Explicit mesh "
            f"axes, and the routing sorts the call's tokens together. Route each device's "
            f"tokens inside jax.shard_map (as expert-parallel MoE layers do), or "
            f"jax.sharding.reshard {name} so that its token axes are not sharded")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_copies(x: jax.Array, order: jax.Array, inverse: jax.Array, top_k: int
                   ) -> jax.Array:
    """`x[order // top_k]`: each sorted row's token."""
    return x[order // top_k]


def _gather_copies_fwd(x: jax.Array, order: jax.Array, inverse: jax.Array, top_k: int
                       ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _gather_copies(x, order, inverse, top_k), (order, inverse)


def _gather_copies_bwd(top_k: int, residuals: tuple[jax.Array, jax.Array], d: jax.Array
                       ) -> tuple[jax.Array, None, None]:
    """Each token's copies, gathered by the inverse permutation and added in float32 (no
    scatter-add)."""
    order, inverse = residuals
    wide = jnp.promote_types(d.dtype, jnp.float32)
    per_token = d[inverse].reshape(-1, top_k, d.shape[1]).astype(wide)
    return jnp.sum(per_token, axis=1).astype(d.dtype), None, None


_gather_copies.defvjp(_gather_copies_fwd, _gather_copies_bwd)


@jax.custom_vjp
def _ungather(rows: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """`rows[inverse]`: the sorted rows back in token-copy order."""
    return rows[inverse]


def _ungather_fwd(rows: jax.Array, order: jax.Array, inverse: jax.Array
                  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return rows[inverse], (order, inverse)


def _ungather_bwd(residuals: tuple[jax.Array, jax.Array], d: jax.Array
                  ) -> tuple[jax.Array, None, None]:
    """The transpose of a permutation's gather is the gather by its inverse."""
    order, inverse = residuals
    return d[order], None, None


_ungather.defvjp(_ungather_fwd, _ungather_bwd)

