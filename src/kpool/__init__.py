"""kpool: the pooled-key (kpool) sparse-attention indexer cache of GLM-5-Next-class models."""

from .ops.compress import kpool_compress_and_write_cache

__all__ = ["kpool_compress_and_write_cache"]
