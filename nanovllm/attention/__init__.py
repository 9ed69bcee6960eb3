"""Paged attention: per-step metadata, the backend interface, and the backend registry."""
from nanovllm.attention.backend import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionMetadata,
    OutputRows,
    get_attention_backend,
)

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "OutputRows", "get_attention_backend"]
