"""How attention partitions: over batch and heads, with no communication.

q, k, v, bias, mask and the sequence lengths split alike on batch; q, k, v, bias
and mask on heads (GQA: the kv heads must divide by the head shards; with one kv
head (MQA) k and v are replicated). Sequence and head_dim are not partitionable:
a sequence-sharded input is gathered (a ring over k/v would be needed).
"""

from __future__ import annotations

from typing import Any

from tokamax_pass.core import BoundArguments
from tokamax_pass.core.partition_rules import Dims, PartitionRule


def _broadcast(x: Any, factors: tuple[str | None, ...]) -> Dims | None:
    """Factors of a (B|1, H|1, Sq|1, Sk|1) bias or mask: size-1 dims are broadcast."""
    if x is None:
        return None
    return Dims(tuple(f if n != 1 else None for f, n in zip(factors, x.shape, strict=True)))


def partition_rule(ba: BoundArguments) -> PartitionRule:
    args = ba.arguments
    kv_heads = "heads" if args["key"].shape[2] > 1 else None
    q = Dims(("batch", None, "heads", None))
    kv = Dims(("batch", None, kv_heads, None))
    logits = ("batch", "heads", None, None)
    lengths = Dims(("batch",))
    return PartitionRule(
        arguments={
            "query": q, "key": kv, "value": kv,
            "bias": _broadcast(args["bias"], logits), "mask": _broadcast(args["mask"], logits),
            "query_seq_lengths": lengths, "key_value_seq_lengths": lengths,
        },
        out=q, residuals=(Dims(("batch", "heads", None)),), order=("batch", "heads"),
    )
