"""Attention over the paged KV cache: one backend interface, chosen by device."""

from engine.attention.backend import AttentionBackend, AttentionMetadata, select_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "select_backend"]
