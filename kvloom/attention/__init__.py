"""Attention over the paged KV cache: a plain-torch reference and a fast path, chosen by name."""

from kvloom.attention.metadata import AttentionMetadata
from kvloom.attention.registry import get_attention_backend

__all__ = ["AttentionMetadata", "get_attention_backend"]
