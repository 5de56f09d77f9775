"""Attention's work, kept apart from `base.py` so the kernels' source hash (which
autotuning caches key on) does not change with the prediction rules."""

from __future__ import annotations

import math

import numpy as np

from tokamax_kernels.attention.base import DotProductAttention
from tokamax_pass.core import BoundArguments, Work
from tokamax_pass.core.roofline import nbytes, register_family_work


def kept_logits(q_len: int, kv_len: int, causal: bool,
                window: tuple[int, int] | None) -> float:
    """How many (query, key) logits the causal mask and the window keep, queries and
    keys aligned at their first position."""
    left, right = window if window is not None else (kv_len, kv_len)
    if causal:
        right = 0
    rows = np.arange(q_len)
    last = np.minimum(rows + right, kv_len - 1)
    first = np.maximum(rows - left, 0)
    return float(np.maximum(last - first + 1, 0).sum())


def forward_work(ba: BoundArguments) -> Work:
    """The two products over the logits the masks keep (4 D FLOPs a kept logit); query,
    key, value and bias read and the output written once."""
    a = ba.arguments
    query = a["query"]
    logits = kept_logits(query.shape[-3], a["key"].shape[-3], a["is_causal"],
                         a["local_window_size"])
    heads = math.prod(query.shape[:-3]) * query.shape[-2]
    moved = 2 * nbytes(query) + nbytes(a["key"]) + nbytes(a["value"]) + nbytes(a["bias"])
    return Work(4.0 * heads * logits * query.shape[-1], moved)


def vjp_work(ba: BoundArguments) -> Work:
    """Five products over the kept logits (the logits again, the probabilities' and the
    values' cotangents, the query's and the key's); the forward's arrays and the
    output's cotangent read, the cotangents written."""
    forward = forward_work(ba)
    a = ba.arguments
    cotangents = nbytes(a["query"]) + nbytes(a["key"]) + nbytes(a["value"])
    return Work(2.5 * forward.flops, forward.bytes + nbytes(a["query"]) + cotangents)


def features(ba: BoundArguments) -> tuple[float, ...]:
    """The head dim (log2): at equal work, it sets a kernel's tile sizes and register use
    (Triton's float32 kernel at head dim 256 runs at a fraction of its speed at 64)."""
    return (math.log2(ba.arguments["query"].shape[-1]),)


register_family_work(DotProductAttention, forward_work, vjp_work, features)
