"""Expert parallelism by hand: a ragged dot inside `jax.shard_map` over expert shards.

Outside `shard_map` the partition rule in `sharding.py` does the same split by itself;
this is for code that already runs per device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tokamax_kernels.ragged_dot.api import ragged_dot
from tokamax_kernels.ragged_dot.sharding import expert_block


def expert_parallel_ragged_dot(lhs: Any, rhs: Any, group_sizes: Any, *, axis_name: Any,
                               **kwargs: Any) -> Any:
    """`tokamax_pass.ragged_dot` inside `jax.shard_map` with `rhs` split over its groups.

    Each device passes its own block of `rhs` ((G/E, K, N), blocks in the order of
    `axis_name`), all rows of `lhs` and the global `group_sizes` (G,); the result
    (M, N) is the whole ragged dot on every device (one `psum` over `axis_name`).
    """
    groups = rhs.shape[0]
    offset, sizes = expert_block(group_sizes, jax.lax.axis_index(axis_name) * groups, groups)
    out = ragged_dot(jnp.roll(lhs, -offset, axis=0), rhs, sizes, **kwargs)
    return jax.lax.psum(jnp.roll(out, offset, axis=0), axis_name)
