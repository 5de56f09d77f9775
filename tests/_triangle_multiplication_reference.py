"""The triangle multiplicative update written out in float32 at `Precision.HIGHEST` (the
reference of the op's tests and of upstream's cases), and random arguments for it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from conftest import normal_values

HIGHEST = jax.lax.Precision.HIGHEST
# The weights in the order the op takes them after `x` and `mask`.
WEIGHTS = ("projection_in_weights", "gate_in_weights", "projection_out_weights",
           "gate_out_weights", "layernorm_in_scale", "layernorm_in_offset",
           "layernorm_out_scale", "layernorm_out_offset")


def random_arguments(seed: int, batch: tuple[int, ...], n: int, c: int, h: int, d: int,
                     dtype=jnp.float32) -> dict[str, jax.Array]:
    """`x` (*batch, n, n, c), a random bool `mask` and the weights, as keywords."""
    shapes = dict(x=(*batch, n, n, c), projection_in_weights=(c, 2, h),
                  gate_in_weights=(c, 2, h), projection_out_weights=(h, d),
                  gate_out_weights=(c, d), layernorm_in_scale=(c,),
                  layernorm_in_offset=(c,), layernorm_out_scale=(h,),
                  layernorm_out_offset=(h,))
    keys = jax.random.split(jax.random.key(seed), len(shapes) + 1)
    arguments = {name: normal_values(key, shape, dtype)
                 for key, (name, shape) in zip(keys, shapes.items(), strict=False)}
    arguments["mask"] = jax.random.bernoulli(keys[-1], 0.75, (*batch, n, n))
    return arguments


def _layer_norm(z, scale, offset, epsilon):
    mean = z.mean(-1, keepdims=True)
    variance = jnp.square(z - mean).mean(-1, keepdims=True)
    return (z - mean) / jnp.sqrt(variance + epsilon) * scale + offset


def reference(x, mask, projection_in_weights, gate_in_weights, projection_out_weights,
              gate_out_weights, layernorm_in_scale, layernorm_in_offset, layernorm_out_scale,
              layernorm_out_offset, triangle_type, epsilon=1e-6):
    """The update in float32, per channel as (N, N) matrix products: outgoing `L @ R^T`,
    incoming `R^T @ L`."""
    f32 = lambda a: a.astype(jnp.float32)
    a = _layer_norm(f32(x), f32(layernorm_in_scale), f32(layernorm_in_offset), epsilon)
    projected = jnp.einsum("...c,csh->...sh", a, f32(projection_in_weights), precision=HIGHEST)
    gates = jnp.einsum("...c,csh->...sh", a, f32(gate_in_weights), precision=HIGHEST)
    edges = jax.nn.sigmoid(gates) * projected * mask[..., None, None]
    # (..., H, N, N): one matrix per channel.
    left = jnp.moveaxis(edges[..., 0, :], -1, -3)
    right = jnp.moveaxis(edges[..., 1, :], -1, -3)
    if triangle_type == "outgoing":
        per_channel = jnp.matmul(left, jnp.swapaxes(right, -1, -2), precision=HIGHEST)
    else:
        per_channel = jnp.matmul(jnp.swapaxes(right, -1, -2), left, precision=HIGHEST)
    triangles = _layer_norm(jnp.moveaxis(per_channel, -3, -1), f32(layernorm_out_scale),
                            f32(layernorm_out_offset), epsilon)
    out = jnp.matmul(triangles, f32(projection_out_weights), precision=HIGHEST)
    return out * jax.nn.sigmoid(jnp.matmul(a, f32(gate_out_weights), precision=HIGHEST))
