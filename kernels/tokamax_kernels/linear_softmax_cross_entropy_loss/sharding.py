"""How the LM-head loss partitions: over the tokens (x's leading axes, labels, the lse
residual); the weights are replicated (a sharded H or V is gathered).

Each device computes the loss of its block of tokens: "none" stays split and "sum" is a
partial sum. "mean" needs the global count of labels: `_restore` turns each device's
mean into its share of the global mean (times local count / global count, a psum over
the token axes) and scales its gradients the same way (its VJP divided by the local
count); the shares, and the weights' gradients, are then summed over the devices.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tokamax_pass.core import BoundArguments
from tokamax_pass.core.partition_rules import Dims, PartitionRule, Shard


def _token_factors(ndim: int) -> tuple[str, ...]:
    return tuple(f"x{d}" for d in range(ndim))


def _restore(outputs: Any, arguments: dict[str, Any], shard: Shard) -> Any:
    """A device's "mean" (or its gradients) rescaled to its share of the global mean."""
    if arguments["reduction"] != "mean":
        return outputs
    labels = arguments["labels"]
    axes = tuple(a for f in _token_factors(labels.ndim) for a in shard.axes.get(f, ()))
    if not axes:
        return outputs
    counted = jnp.sum(labels >= 0)
    share = (jnp.maximum(counted, 1).astype(jnp.float32)
             / jnp.maximum(jax.lax.psum(counted, axes), 1).astype(jnp.float32))

    def scaled(a: jax.Array) -> jax.Array:
        return (a * share).astype(a.dtype)

    if isinstance(outputs, dict):  # a VJP call: the gradients of x and weights
        return {**outputs, "x": scaled(outputs["x"]), "weights": scaled(outputs["weights"])}
    if isinstance(outputs, tuple):  # (out, residuals)
        return (scaled(outputs[0]), *outputs[1:])
    return scaled(outputs)


def partition_rule(ba: BoundArguments) -> PartitionRule:
    tokens = _token_factors(ba.arguments["labels"].ndim)
    reduced = ba.arguments["reduction"] != "none"
    return PartitionRule(
        arguments={"x": Dims((*tokens, None)), "labels": Dims(tokens)},
        out=Dims((), summed=tokens) if reduced else Dims(tokens),
        residuals=(Dims(tokens),), order=tokens, restore=_restore,
    )
