"""kpool: the pooled-key (kpool) sparse-attention indexer cache of GLM-5-Next-class models."""

from . import _backend

if _backend.interpreting():  # Triton's CPU interpreter: make its float downcasts exact first
    from ._interpreter import ensure_exact_downcasts as _ensure_exact_downcasts

    _ensure_exact_downcasts()

from .ops.compress import kpool_compress_and_write_cache
from .ops.decode import kpool_decode_update_and_maybe_write_cache_batched
from .ops.tail import kpool_seed_tail_cache

__all__ = ["kpool_compress_and_write_cache", "kpool_decode_update_and_maybe_write_cache_batched", "kpool_seed_tail_cache"]
