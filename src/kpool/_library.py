"""``torch.library`` registration of kpool's ops (namespace ``kpool::``), with hand-written fakes.

For ``torch.compile`` graphs and other dispatcher users: ``torch.ops.kpool.<op>(...)``.
Eager code calls the plain Python functions (``kpool.kpool_compress_and_write_cache``,
...), which skip the dispatcher's per-call overhead; both run the same launchers.

Cache writers mutate their cache arguments in place and return nothing (their fakes do
nothing); the others return new tensors whose fakes give shapes and dtypes only. Every fake
checks that its tensors share one device (``_one_device``), and the scorer's and the
expansion's fakes check the integers that set their output shapes as the ops do. Optional
arguments of the Python API that select a variant are explicit here (``layout``,
``fp8_dtype``) so a traced graph never depends on the platform default at replay time.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._checks import MAX_SELECT, check_int
from .layout import HEAD_DIM
from .ops.compress import kpool_compress_and_write_cache
from .ops.decode import kpool_decode_update_and_maybe_write_cache_batched
from .ops.prefill import write_prefill
from .ops.quant import fwht128_quant_fp8, quantize_queries
from .ops.score import paged_pool_topk
from .ops.select import expand_pools_and_append_tail, expansion_width

NAMESPACE = "kpool"


def _one_device(op: str, **tensors) -> None:
    """A fake's check: its tensor arguments (None: absent) on one device. A meta tensor among
    real ones routes the call to the fake, which would otherwise write nothing, silently."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{NAMESPACE}::{op} takes its tensors on one device, got "
                         + ", ".join(f"{name} on {device}" for name, device in devices.items()))


@torch.library.custom_op(f"{NAMESPACE}::compress_and_write_cache", mutates_args=("kv_cache",))
def compress_and_write_cache(kv_cache: torch.Tensor, slot_k: torch.Tensor, slot_score: torch.Tensor,
                             ape: torch.Tensor, loc: torch.Tensor, pool_size: int, round_scale: bool, layout: str,
                             fp8_dtype: torch.dtype, write_mask: Optional[torch.Tensor] = None) -> None:
    """``kpool_compress_and_write_cache`` (in place on ``kv_cache``)."""
    kpool_compress_and_write_cache(kv_cache, slot_k, slot_score, ape, loc, pool_size, write_mask=write_mask,
                                   round_scale=round_scale, layout=layout, fp8_dtype=fp8_dtype)


@compress_and_write_cache.register_fake
def _(kv_cache, slot_k, slot_score, ape, loc, pool_size, round_scale, layout, fp8_dtype, write_mask=None):
    _one_device("compress_and_write_cache", kv_cache=kv_cache, slot_k=slot_k, slot_score=slot_score, ape=ape,
                loc=loc, write_mask=write_mask)
    return None


@torch.library.custom_op(f"{NAMESPACE}::decode_update", mutates_args=("kv_cache", "tail_kv_cache"))
def decode_update(kv_cache: torch.Tensor, tail_kv_cache: torch.Tensor, tail_slot_mapping: torch.Tensor,
                  key: torch.Tensor, slot_score: torch.Tensor, ape: torch.Tensor, slot_mapping: torch.Tensor,
                  positions: torch.Tensor, pool_size: int, round_scale: bool, layout: str,
                  fp8_dtype: torch.dtype, metadata_ready: bool = False) -> None:
    """``kpool_decode_update_and_maybe_write_cache_batched`` (in place on both caches)."""
    kpool_decode_update_and_maybe_write_cache_batched(kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score,
                                                      ape, slot_mapping, positions, pool_size,
                                                      round_scale=round_scale, layout=layout, fp8_dtype=fp8_dtype,
                                                      metadata_ready=metadata_ready)


@decode_update.register_fake
def _(kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score, ape, slot_mapping, positions, pool_size,
      round_scale, layout, fp8_dtype, metadata_ready=False):
    _one_device("decode_update", kv_cache=kv_cache, tail_kv_cache=tail_kv_cache, tail_slot_mapping=tail_slot_mapping,
                key=key, slot_score=slot_score, ape=ape, slot_mapping=slot_mapping, positions=positions)
    return None


@torch.library.custom_op(f"{NAMESPACE}::write_prefill", mutates_args=("kv_cache", "tail"))
def prefill_write(kv_cache: torch.Tensor, tail: torch.Tensor, key: torch.Tensor, gate: torch.Tensor,
                  ape: torch.Tensor, pools: torch.Tensor, requests: torch.Tensor, pool_size: int, round_scale: bool,
                  layout: str, fp8_dtype: torch.dtype) -> None:
    """``write_prefill`` (in place on both caches)."""
    write_prefill(kv_cache, tail, key, gate, ape, pools, requests, pool_size, layout=layout, fp8_dtype=fp8_dtype,
                  round_scale=round_scale)


@prefill_write.register_fake
def _(kv_cache, tail, key, gate, ape, pools, requests, pool_size, round_scale, layout, fp8_dtype):
    _one_device("write_prefill", kv_cache=kv_cache, tail=tail, key=key, gate=gate, ape=ape, pools=pools,
                requests=requests)
    return None


@torch.library.custom_op(f"{NAMESPACE}::fwht128_quant_fp8", mutates_args=())
def fwht128_quant(q: torch.Tensor, fp8_dtype: torch.dtype, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``fwht128_quant_fp8``: ``q [..., 128]`` bf16 -> (``[..., 128]`` fp8, ``[..., 1]`` fp32)."""
    return fwht128_quant_fp8(q, fp8_dtype=fp8_dtype, round_scale=round_scale)


@fwht128_quant.register_fake
def _(q, fp8_dtype, round_scale):
    lead = tuple(q.shape[:-1])
    return q.new_empty((*lead, HEAD_DIM), dtype=fp8_dtype), q.new_empty((*lead, 1), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::quantize_queries", mutates_args=())
def quantize(q: torch.Tensor, weights: torch.Tensor, fp8_dtype: torch.dtype,
             round_scale: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_queries``: (``q_fp8 [..., H, 128]``, ``q_scale [..., H, 1]``, folded ``w [..., H]``)."""
    return quantize_queries(q, weights, fp8_dtype=fp8_dtype, round_scale=round_scale)


@quantize.register_fake
def _(q, weights, fp8_dtype, round_scale):
    _one_device("quantize_queries", q=q, weights=weights)
    lead = tuple(q.shape[:-1])
    return (q.new_empty((*lead, HEAD_DIM), dtype=fp8_dtype), q.new_empty((*lead, 1), dtype=torch.float32),
            q.new_empty(lead, dtype=torch.float32))


@torch.library.custom_op(f"{NAMESPACE}::paged_pool_topk", mutates_args=())
def pool_topk(q_fp8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, pool_lens: torch.Tensor,
              page_table: torch.Tensor, select_k: int, layout: str, fp8_dtype: torch.dtype,
              max_pools: int, seq_lens: Optional[torch.Tensor] = None, pool_size: int = 1,
              width: int = 0) -> torch.Tensor:
    """``paged_pool_topk``: int32 ``[B * next_n, select_k]`` pool ids (``max_pools``: a bound on
    every row's visible pools, given so the op needs no host sync); with ``seq_lens`` the
    selection expanded to tokens with the tails appended, ``expand=(seq_lens, pool_size,
    width)``: int32 ``[B * next_n, width]`` (``width`` 0: the natural ``select_k * P + P - 1``)."""
    expand = None if seq_lens is None else (seq_lens, pool_size, width or None)
    return paged_pool_topk(q_fp8, kv_cache, weights, pool_lens, page_table, select_k, layout=layout,
                           fp8_dtype=fp8_dtype, max_pools=max_pools, expand=expand)


@pool_topk.register_fake
def _(q_fp8, kv_cache, weights, pool_lens, page_table, select_k, layout, fp8_dtype, max_pools, seq_lens=None,
      pool_size=1, width=0):
    _one_device("paged_pool_topk", q_fp8=q_fp8, kv_cache=kv_cache, weights=weights, pool_lens=pool_lens,
                page_table=page_table, seq_lens=seq_lens)
    check_int("select_k", select_k, most=MAX_SELECT)
    cols = select_k if seq_lens is None else expansion_width(select_k, pool_size, width or None)
    return q_fp8.new_empty((q_fp8.shape[0] * q_fp8.shape[1], cols), dtype=torch.int32)


@torch.library.custom_op(f"{NAMESPACE}::expand_pools_and_append_tail", mutates_args=())
def expand_and_append(pool_ids: torch.Tensor, seq_lens: torch.Tensor, pool_size: int, width: int) -> torch.Tensor:
    """``expand_pools_and_append_tail``: int32 ``[rows, width]`` token ids."""
    return expand_pools_and_append_tail(pool_ids, seq_lens, pool_size, width=width)


@expand_and_append.register_fake
def _(pool_ids, seq_lens, pool_size, width):
    _one_device("expand_pools_and_append_tail", pool_ids=pool_ids, seq_lens=seq_lens)
    width = expansion_width(pool_ids.shape[-1], pool_size, width)
    return pool_ids.new_empty((pool_ids.shape[0], width), dtype=torch.int32)
