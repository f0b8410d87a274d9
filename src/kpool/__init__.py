"""kpool: the pooled-key (kpool) sparse-attention indexer cache of GLM-5-Next-class models."""

from . import _backend

if _backend.interpreting():  # Triton's CPU interpreter: make its float downcasts exact first
    from ._interpreter import ensure_exact_downcasts as _ensure_exact_downcasts

    _ensure_exact_downcasts()

from .ops.compress import kpool_compress_and_write_cache
from .ops.decode import kpool_decode_update_and_maybe_write_cache_batched
from .ops.select import (append_tail_to_topk, build_pooled_page_table, compute_pooled_write_locs,
                         expand_pools_and_append_tail, expand_pools_to_tokens, history_group_budget_for_topk)
from .ops.tail import kpool_seed_tail_cache
from .ops.quant import fwht128_quant_fp8, quantize_queries
from .ops.logits import paged_pool_logits, ragged_pool_logits
from .ops.topk import select_pools
from .ops.score import paged_pool_topk
from .cache import CacheCapacityError, KPoolCache, StepMetadata
from .planning import decode_slot_mappings, prefill_plan
from .ops.prefill import write_prefill
from .indexer import KPoolIndexer
from . import _library  # noqa: F401  (registers torch.ops.kpool.*)

__all__ = ["kpool_compress_and_write_cache", "kpool_decode_update_and_maybe_write_cache_batched",
           "kpool_seed_tail_cache",
           "expand_pools_and_append_tail", "expand_pools_to_tokens", "append_tail_to_topk",
           "build_pooled_page_table", "compute_pooled_write_locs", "history_group_budget_for_topk"]
__all__ += ["fwht128_quant_fp8", "quantize_queries", "paged_pool_logits", "ragged_pool_logits", "select_pools",
            "paged_pool_topk"]
__all__ += ["KPoolCache", "StepMetadata", "CacheCapacityError", "KPoolIndexer", "decode_slot_mappings",
            "prefill_plan", "write_prefill"]
