"""The switch every model is written against: plain JAX, or the kernel library.

`PLAIN` is what a user writes without us: jnp norms, `jax.nn.dot_product_attention`
(cuDNN on a GPU, where it supports the options; a jnp attention where it does not,
as for Gemma-2's logit soft cap), `jax.lax.ragged_dot` for the experts, and the GLU
as `activation(h @ w[:, 0]) * (h @ w[:, 1])`, the MoE routing by gather and
`.at[order].set`. `Library(tokamax_pass)` calls our ops
with `implementation=None`; `Library(tokamax)` calls the upstream wheel's ops the same
way, where it is installed. Both take the same parameters, so one model definition
serves all of them.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.models import blocks


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _jnp_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                   window: int | None, soft_cap: float | None) -> jax.Array:
    """Attention as a user writes it in jnp when `jax.nn` cannot (soft cap): float32
    logits, the cap, the masks, softmax, probabilities in the inputs' dtype into the second
    product."""
    b, t, n, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, d)
    logits = jnp.einsum("bthgd,bshd->bhgts", q, k, preferred_element_type=jnp.float32)
    logits = logits / math.sqrt(d)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    rows, cols = jnp.arange(t)[:, None], jnp.arange(k.shape[1])[None, :]
    keep = jnp.ones((t, k.shape[1]), bool)
    if causal:
        keep &= cols <= rows
    if window is not None:
        keep &= rows - cols <= window
    logits = jnp.where(keep, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgts,bshd->bthgd", probs, v)
    return out.reshape(b, t, n, d)


def _activation_product(both: jax.Array, activation: Callable[[jax.Array], jax.Array]
                        ) -> jax.Array:
    """`activation(gate) * up` of `[gate | up]` along the last axis, in float32."""
    n = both.shape[-1] // 2
    gate, up = both[..., :n].astype(jnp.float32), both[..., n:].astype(jnp.float32)
    return (activation(gate) * up).astype(both.dtype)


@dataclasses.dataclass(frozen=True)
class Plain:
    """Plain JAX: what the model costs without a kernel library."""

    name: str = "plain"

    def rms_norm(self, x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)

    def add_rms_norm(self, x: jax.Array, h: jax.Array, scale: jax.Array,
                     eps: float = 1e-6) -> tuple[jax.Array, jax.Array]:
        """The pre-norm residual step: `(rms_norm(x + h), x + h)`."""
        x = x + h
        return self.rms_norm(x, scale, eps), x

    def layer_norm(self, x: jax.Array, scale: jax.Array, offset: jax.Array,
                   eps: float = 1e-6) -> jax.Array:
        xf = x.astype(jnp.float32)
        centered = xf - jnp.mean(xf, axis=-1, keepdims=True)
        y = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
        return (y * scale.astype(jnp.float32) + offset.astype(jnp.float32)).astype(x.dtype)

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                  window: int | None = None, soft_cap: float | None = None) -> jax.Array:
        cudnn = _on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16)
        if soft_cap is not None or (q.dtype == jnp.float16 and not cudnn):
            # jax.nn has no soft cap; and its XLA attention asks float16 inputs for an
            # F16_F16_F32 dot that XLA:CPU rejects when compiling (jax 0.11.2).
            return _jnp_attention(q, k, v, causal=causal, window=window, soft_cap=soft_cap)
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal,
            local_window_size=None if window is None else (window, 0),
            implementation="cudnn" if cudnn else None)

    def glu(self, h: jax.Array, w: jax.Array,
            activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
        return activation(h @ w[:, 0]) * (h @ w[:, 1])

    def ragged_dot(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(x, w, group_sizes)

    def moe_glu(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """The experts' gate/up products: one ragged dot over (E, K, 2N) weights, then
        `activation(gate) * up` in float32, cast back."""
        return _activation_product(self.ragged_dot(x, w, group_sizes), activation)

    def moe_dispatch(self, x: jax.Array, experts: jax.Array, num_experts: int
                     ) -> tuple[jax.Array, jax.Array, Any]:
        """`(rows, group_sizes, order)`: each token's row once per chosen expert, sorted by
        expert, as a user writes it (autodiff transposes the gather to a scatter-add)."""
        top_k = experts.shape[-1]
        flat_experts = experts.reshape(-1)
        order = jnp.argsort(flat_experts)
        group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
        return x.reshape(-1, x.shape[-1])[order // top_k], group_sizes, order

    def moe_combine(self, expert_out: jax.Array, order: Any, weights: jax.Array
                    ) -> jax.Array:
        """The expert rows back in token order (`.at[order].set`), each token's copies
        weighted and added in float32."""
        out = jnp.zeros_like(expert_out).at[order].set(expert_out)
        out = out.reshape(weights.shape + expert_out.shape[-1:]).astype(jnp.float32)
        combined = jnp.einsum("...kw,...k->...w", out, weights.astype(jnp.float32))
        return combined.astype(expert_out.dtype)

    def lm_head_loss(self, h: jax.Array, head: jax.Array, labels: jax.Array,
                     soft_cap: float | None = None) -> jax.Array:
        """The LM head and its mean loss: logits `h @ head` in the inputs' dtype, then
        optax-style float32 softmax cross entropy (the logits materialized)."""
        return blocks.cross_entropy(h @ head, labels, soft_cap)


@dataclasses.dataclass(frozen=True)
class Library:
    """A kernel library's ops, every implementation `None` (ours, or upstream Tokamax)."""

    module: ModuleType
    name: str

    def rms_norm(self, x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
        return self.module.layer_norm(x, scale, None, epsilon=eps, subtract_mean=False)

    def add_rms_norm(self, x: jax.Array, h: jax.Array, scale: jax.Array,
                     eps: float = 1e-6) -> tuple[jax.Array, jax.Array]:
        """`layer_norm(h, ..., residual=x)`, the residual add fused into the norm (plain
        JAX's add where the library has no `residual`, as upstream Tokamax 0.0.17)."""
        if self.name != "ours":
            x = x + h
            return self.rms_norm(x, scale, eps), x
        return self.module.layer_norm(h, scale, None, epsilon=eps, subtract_mean=False,
                                      residual=x)

    def layer_norm(self, x: jax.Array, scale: jax.Array, offset: jax.Array,
                   eps: float = 1e-6) -> jax.Array:
        return self.module.layer_norm(x, scale, offset, epsilon=eps)

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                  window: int | None = None, soft_cap: float | None = None) -> jax.Array:
        extra: dict[str, Any] = {}
        if window is not None:
            extra["local_window_size"] = (window, 0)
        if soft_cap is not None:
            extra["logits_soft_cap"] = soft_cap
        return self.module.dot_product_attention(q, k, v, is_causal=causal, **extra)

    def glu(self, h: jax.Array, w: jax.Array,
            activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
        return self.module.gated_linear_unit(h, w, activation=activation)

    def ragged_dot(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return self.module.ragged_dot(x, w, group_sizes)

    def moe_glu(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """The grouped `gated_linear_unit` (the activation in the expert GEMMs' epilogue
        where a kernel runs it), or the library's ragged dot and the activation where it
        has no grouped GLU (upstream Tokamax 0.0.17)."""
        if self.name != "ours":
            return _activation_product(self.ragged_dot(x, w, group_sizes), activation)
        experts, k, both = w.shape
        return self.module.gated_linear_unit(
            x, w.reshape(experts, k, 2, both // 2), group_sizes=group_sizes,
            activation=activation)

    def moe_dispatch(self, x: jax.Array, experts: jax.Array, num_experts: int
                     ) -> tuple[jax.Array, jax.Array, Any]:
        """Our `moe_dispatch` (gathers both ways), or plain JAX's routing for a library
        without it (upstream Tokamax 0.0.17)."""
        if self.name != "ours":
            return Plain().moe_dispatch(x, experts, num_experts)
        return self.module.moe_dispatch(x, experts, num_experts)

    def moe_combine(self, expert_out: jax.Array, routing: Any, weights: jax.Array
                    ) -> jax.Array:
        if self.name != "ours":
            return Plain().moe_combine(expert_out, routing, weights)
        return self.module.moe_combine(expert_out, routing, weights)

    def lm_head_loss(self, h: jax.Array, head: jax.Array, labels: jax.Array,
                     soft_cap: float | None = None) -> jax.Array:
        """Our `linear_softmax_cross_entropy_loss`, or plain JAX's head for another library
        (upstream Tokamax 0.0.17's op of that name takes other arguments: called as ours,
        it failed on the H200)."""
        if self.name != "ours":
            return Plain().lm_head_loss(h, head, labels, soft_cap)
        extra = {} if soft_cap is None else {"logits_soft_cap": soft_cap}
        return self.module.linear_softmax_cross_entropy_loss(
            h, labels, head, reduction="mean", **extra)


def variants(upstream: bool = False) -> dict[str, Any]:
    """`{"plain": Plain(), "ours": Library(tokamax_pass)}`, and with `upstream` the
    `tokamax` wheel's ops as `"upstream"` where it is installed."""
    import tokamax_pass

    found: dict[str, Any] = {"plain": Plain(), "ours": Library(tokamax_pass, "ours")}
    if not upstream:
        return found
    try:
        import tokamax  # the upstream wheel, a peer where installed
    except ImportError as e:
        # Said, not swallowed: a wheel installed without one of its dependencies would
        # look like no wheel at all.
        print(f"upstream tokamax not importable, its variant is skipped: {e}", file=sys.stderr)
        return found
    if getattr(tokamax, "__name__", "") == "tokamax" and tokamax is not tokamax_pass:
        found["upstream"] = Library(tokamax, "upstream")
    return found


@dataclasses.dataclass(frozen=True)
class Swapped:
    """`base`'s ops with the ones named in `plain_ops` taken from plain JAX instead: one
    model with one op family swapped, to see what that op costs in the whole step."""

    base: Any
    plain_ops: frozenset[str]

    @property
    def name(self) -> str:
        return f"{self.base.name} with plain {'+'.join(sorted(self.plain_ops))}"

    def __getattr__(self, op: str) -> Any:
        return getattr(Plain() if op in self.plain_ops else self.base, op)
