"""Upstream Tokamax's `tokamax.ops` namespace: the ops, as at the top level.

`ops.gpu` and `ops.tpu` hold the kernel classes and their configs under upstream's names
(imported on first use). Upstream's other ops (mostly TPU: `ragged_paged_attention`,
`top_k`, `sparse_mla`, ...) and `ops.experimental` have no implementation here and are
absent, so code that needs them fails at import rather than at run time
(docs/compatibility.md).
"""

from __future__ import annotations

import importlib
from typing import Any

from tokamax_kernels.attention import DotProductAttentionImplementation, dot_product_attention
from tokamax_kernels.gated_linear_unit import gated_linear_unit
from tokamax_kernels.layer_norm import layer_norm
from tokamax_kernels.linear_softmax_cross_entropy_loss import linear_softmax_cross_entropy_loss
from tokamax_kernels.ragged_dot import ragged_dot, ragged_dot_general
from tokamax_kernels.triangle_multiplication import triangle_multiplication

__all__ = [
    "DotProductAttentionImplementation",
    "dot_product_attention",
    "gated_linear_unit",
    "gpu",
    "layer_norm",
    "linear_softmax_cross_entropy_loss",
    "ragged_dot",
    "ragged_dot_general",
    "tpu",
    "triangle_multiplication",
]


def __getattr__(name: str) -> Any:
    if name in ("gpu", "tpu"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
