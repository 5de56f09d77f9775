"""Dot-product attention (multi-head, GQA/MQA, cross attention, masks, soft cap)."""

from tokamax_kernels.attention.api import dot_product_attention
from tokamax_kernels.attention.base import DotProductAttention, DotProductAttentionVjp

__all__ = ["DotProductAttention", "DotProductAttentionVjp", "dot_product_attention"]
