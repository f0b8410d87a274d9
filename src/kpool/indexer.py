"""KPoolIndexer: one layer's kpool indexer (weights -> q, k, gate, head weights -> token indices).

Holds the layer's indexer weights under the checkpoint's names and shapes
(``model.layers.{L}.self_attn.indexer.`` + the names below), so ``load_state_dict`` takes
checkpoint tensors as they are:

===============================  ======================  =========================================
name                             shape                   dtype / use
===============================  ======================  =========================================
``wq_b.weight``                  ``[H*128, q_lora_rank]``  bf16; ``q = wq_b(q_resid)``
``wk.weight``                    ``[128, hidden]``         bf16; ``k = LayerNorm(wk(h))``
``k_norm.weight`` / ``.bias``    ``[128]``                 LayerNorm eps 1e-6, computed in fp32
``weights_proj.weight``          ``[H, hidden]``           head weights ``h.float() @ W.float().T``
``index_kpool_compress_gate``    ``[128, hidden]``         bf16 raw Parameter; ``gate = F.linear(h, G)``
``index_kpool_compress_ape``     ``[P, 128]``              fp32 position bias of the pool softmax
===============================  ======================  =========================================

``forward`` writes the step's keys / gates into a ``KPoolCache`` (prefill or decode /
verify), then returns ``KPoolCache.topk_indices`` for the step's tokens.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import check_int, check_tensor
from .cache import KPoolCache, selection_width
from .layout import HEAD_DIM, cdiv
from .ops.logits import check_heads

_NAMES = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
          "index_kpool_compress_gate", "index_kpool_compress_ape")
FP8_BLOCK = 128  # block-fp8 checkpoints: one ``weight_scale_inv`` per 128 x 128 block


class KPoolIndexer(nn.Module):
    """One layer's kpool indexer (GLM-5.3-Flash defaults).

    Parameters
    ----------
    hidden_size, q_lora_rank : model dims (4096, 1536).
    n_heads : indexer heads H (32; 16 and 64 also supported).
    pool_size : P, tokens per pool (``index_kpool``, 4).
    index_topk : tokens selected per query (2048; ``select_k = index_topk // P`` pools).
    dtype : dtype of the linear weights and k_norm (bf16); ``index_kpool_compress_ape``
        is always fp32.
    device : where the parameters live (default: torch's default device).
    """

    def __init__(self, hidden_size=4096, q_lora_rank=1536, n_heads=32, pool_size=4, index_topk=2048,
                 dtype=torch.bfloat16, device=None):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("q_lora_rank", q_lora_rank), ("n_heads", n_heads),
                            ("pool_size", pool_size), ("index_topk", index_topk)):
            check_int(name, value)
        check_heads("n_heads", n_heads)
        selection_width(index_topk, None, pool_size)
        self.hidden_size, self.q_lora_rank, self.n_heads = hidden_size, q_lora_rank, n_heads
        self.pool_size, self.index_topk = pool_size, index_topk
        kw = {"dtype": dtype, "device": device}
        self.wq_b = nn.Linear(q_lora_rank, n_heads * HEAD_DIM, bias=False, **kw)
        self.wk = nn.Linear(hidden_size, HEAD_DIM, bias=False, **kw)
        self.k_norm = nn.LayerNorm(HEAD_DIM, eps=1e-6, **kw)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False, **kw)
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(HEAD_DIM, hidden_size, **kw))
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(pool_size, HEAD_DIM, dtype=torch.float32,
                                                                 device=device))
        nn.init.normal_(self.index_kpool_compress_gate, std=hidden_size ** -0.5)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_checkpoint(cls, state_dict, prefix="", *, index_topk=2048, dtype=torch.bfloat16, device=None):
        """Build an indexer from a checkpoint ``state_dict`` (keys ``prefix + name``).

        ``prefix`` is the layer's indexer prefix, e.g. ``"model.layers.3.self_attn.indexer."``
        (a missing trailing dot is added); keys outside it are ignored, keys under it must be the
        indexer's (or their block-fp8 scales). The geometry
        (hidden size, q_lora_rank, heads, P) is read off the tensor shapes. Block-fp8 weights
        with a ``weight_scale_inv`` (``[ceil(out/128), ceil(in/128)]``) are dequantized.
        """
        if prefix and not prefix.endswith("."):
            prefix += "."
        sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        missing = [n for n in _NAMES if n not in sub]
        if missing:
            raise KeyError(f"checkpoint lacks {', '.join(prefix + n for n in missing)}")
        sub = _dequantize_block_fp8(sub, prefix)
        heads_x_dim, q_lora_rank = sub["wq_b.weight"].shape
        n_heads, hidden = sub["weights_proj.weight"].shape
        pool_size = sub["index_kpool_compress_ape"].shape[0]
        if heads_x_dim != n_heads * HEAD_DIM:
            raise ValueError(f"{prefix}wq_b.weight has {heads_x_dim} rows, expected n_heads * {HEAD_DIM} = "
                             f"{n_heads * HEAD_DIM} (n_heads from weights_proj)")
        mod = cls(hidden_size=hidden, q_lora_rank=q_lora_rank, n_heads=n_heads, pool_size=pool_size,
                  index_topk=index_topk, dtype=dtype, device=device)
        mod.load_state_dict({n: sub[n] for n in _NAMES}, strict=True)
        return mod

    def make_cache(self, num_pages, *, page_size=64, max_requests, max_spec_tokens=0, device=None, layout=None,
                   fp8_dtype=None, round_scale=True) -> KPoolCache:
        """A ``KPoolCache`` for this layer (its P and this module's ``index_kpool_compress_ape``).

        ``device`` defaults to the module's. ``forward`` re-syncs the cache's ape from the
        module, so loading weights after making the cache is fine.
        """
        ape = self.index_kpool_compress_ape.detach()
        device = ape.device if device is None else device
        return KPoolCache(num_pages, page_size=page_size, pool_size=self.pool_size, max_requests=max_requests,
                          max_spec_tokens=max_spec_tokens, ape=ape, device=device, layout=layout,
                          fp8_dtype=fp8_dtype, round_scale=round_scale)

    # ------------------------------------------------------------------ math
    def project(self, hidden_states, q_resid):
        """Token-major projections: ``hidden_states [T, hidden]``, ``q_resid [T, q_lora_rank]`` ->

        ``q`` bf16 ``[T, H, 128]`` (``wq_b``), ``k`` bf16 ``[T, 128]`` (LayerNorm in fp32 of
        ``wk(h)``, cast back), ``weights`` fp32 ``[T, H]`` (``h.float() @ W.float().T``),
        ``gate`` bf16 ``[T, 128]`` (``F.linear(h, index_kpool_compress_gate)``).
        """
        t = hidden_states.shape[0]
        q = self.wq_b(q_resid).view(t, self.n_heads, HEAD_DIM).to(torch.bfloat16)
        k = F.layer_norm(self.wk(hidden_states).float(), (HEAD_DIM,), self.k_norm.weight.float(),
                         self.k_norm.bias.float(), self.k_norm.eps).to(torch.bfloat16)
        weights = hidden_states.float() @ self.weights_proj.weight.float().T
        gate = F.linear(hidden_states, self.index_kpool_compress_gate).to(torch.bfloat16)
        return q, k, weights, gate

    def forward(self, cache: KPoolCache, request_ids, hidden_states, q_resid, *, mode="prefill", cu_seqlens=None,
                width=None, layer=None):
        """Write one step's keys into ``cache`` and return its tokens' selected indices.

        Parameters
        ----------
        cache : the layer's ``KPoolCache`` (``make_cache``).
        request_ids : the step's requests, in order.
        hidden_states : bf16 attention-block input. ``mode="prefill"``: packed ``[T, hidden]``
            with ``cu_seqlens`` (``[R + 1]`` offsets; may be omitted for one request).
            ``mode="decode"`` (decode / speculative verify): ``[B, next_n, hidden]``, the same
            ``next_n`` tokens for every request (``[B, hidden]`` means ``next_n = 1``).
        q_resid : bf16 MLA q-lora activation after ``q_a_layernorm``, same leading shape
            with ``q_lora_rank`` last.
        width : output columns (default ``index_topk + P - 1``).
        layer : ``(kv_cache, tail)`` of this layer (``cache.layer_buffers()``) when ``cache``
            plans for the model's layers: the planning layer's call (``layer=None``) takes the
            step, each other layer's call with the same requests and mode writes it into its
            own buffers (``cache.write_layer``) and selects from them.

        Returns
        -------
        int32 ``[T, width]`` (``T = B * next_n`` in decode, request-major): request-relative
        token indices, as ``KPoolCache.topk_indices``.
        """
        if not isinstance(cache, KPoolCache):
            raise TypeError(f"cache must be a KPoolCache, got {type(cache).__name__}")
        if cache.pool_size != self.pool_size:
            raise ValueError(f"cache has pool_size {cache.pool_size}, this indexer {self.pool_size}")
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
        request_ids = list(request_ids)
        check_tensor("hidden_states", hidden_states, dtype=self.wk.weight.dtype, device=cache.device)
        check_tensor("q_resid", q_resid, dtype=self.wq_b.weight.dtype, device=cache.device)
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must end in hidden_size = {self.hidden_size}, got "
                             f"{list(hidden_states.shape)}")
        if q_resid.shape[:-1] != hidden_states.shape[:-1] or q_resid.shape[-1] != self.q_lora_rank:
            raise ValueError(f"q_resid must have shape {list(hidden_states.shape[:-1]) + [self.q_lora_rank]}, "
                             f"got {list(q_resid.shape)}")
        selection_width(self.index_topk, width, self.pool_size)  # before anything is written
        if mode == "prefill":
            if hidden_states.ndim != 2:
                raise ValueError(f"prefill hidden_states must be packed [T, hidden], got {list(hidden_states.shape)}")
            if cu_seqlens is None:
                if len(request_ids) != 1:
                    raise ValueError("prefill of several requests needs cu_seqlens")
                cu_seqlens = [0, hidden_states.shape[0]]
            q, k, weights, gate = self.project(hidden_states, q_resid)
            take_step = functools.partial(cache.prefill, request_ids, k, gate, cu_seqlens=cu_seqlens)
        else:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens is for mode='prefill'; decode takes [B, next_n, hidden]")
            h3 = hidden_states.unsqueeze(1) if hidden_states.ndim == 2 else hidden_states
            if h3.ndim != 3 or h3.shape[0] != len(request_ids):
                raise ValueError(f"decode hidden_states must be [B={len(request_ids)}, next_n, hidden] or "
                                 f"[B, hidden], got {list(hidden_states.shape)}")
            batch, next_n = h3.shape[:2]
            q, k, weights, gate = self.project(h3.reshape(batch * next_n, -1), q_resid.reshape(batch * next_n, -1))
            k, gate = k.view(batch, next_n, HEAD_DIM), gate.view(batch, next_n, HEAD_DIM)
            take_step = functools.partial(cache.decode, request_ids, k, gate)
        if layer is None:  # the planning layer
            with self._pooling_ape(cache):
                take_step()
            kv_cache = None
        else:
            kv_cache, tail = layer
            last = cache.metadata()
            if last is None or last.kind != mode or last.request_ids != request_ids:
                planned = 'none' if last is None else last.kind
                raise ValueError(f"layer= writes the step the cache planned last ({planned}"
                                 f" of {None if last is None else last.request_ids}): call the planning layer first, "
                                 f"with the same request_ids and mode={mode!r}")
            cache.write_layer(kv_cache, tail, k, gate, self.index_kpool_compress_ape.detach())
        return cache.topk_indices(request_ids, q.contiguous(), weights, index_topk=self.index_topk, width=width,
                                  kv_cache=kv_cache)

    @contextlib.contextmanager
    def _pooling_ape(self, cache: KPoolCache):
        """The cache pools the step with this module's (possibly reloaded) ape; a step that
        raises (before writing anything) leaves the cache's ape as it was."""
        before = cache.ape.clone()
        cache.ape.copy_(self.index_kpool_compress_ape.detach())
        try:
            yield
        except BaseException:
            cache.ape.copy_(before)
            raise

    def _apply(self, fn, recurse=True):
        """``.to()`` / ``.cuda()`` / ``.half()`` move ``index_kpool_compress_ape`` but keep it fp32
        (the pooling softmax's bias is fp32 in the checkpoint and in SPEC §2)."""
        ape = self._parameters.pop("index_kpool_compress_ape")
        try:
            super()._apply(fn, recurse)
        finally:
            self._parameters["index_kpool_compress_ape"] = ape
        ape.data = ape.data.to(fn(ape.data[:0]).device)
        return self

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, q_lora_rank={self.q_lora_rank}, n_heads={self.n_heads}, "
                f"pool_size={self.pool_size}, index_topk={self.index_topk}")


def _dequantize_block_fp8(sub: dict, prefix: str) -> dict:
    """Replace fp8 ``<name>.weight`` + ``<name>.weight_scale_inv`` (one scale per 128 x 128 block,
    ``[ceil(out/128), ceil(in/128)]``) by the dequantized fp32 weight; other tensors pass
    through. A key that is none of the indexer's, an fp8 weight without its scale or a scale
    without an fp8 weight, or a scale of the wrong shape, raises naming the key."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    scales = {k[: -len("_scale_inv")]: k for k in sub if k.endswith(".weight_scale_inv")}
    scales = {w: k for w, k in scales.items() if w in _NAMES}  # others: unknown keys below
    unknown = [k for k in sub if k not in _NAMES and k not in scales.values()]
    if unknown:
        raise KeyError(f"checkpoint has keys the indexer does not hold: {', '.join(prefix + k for k in unknown)}")
    out = {k: v for k, v in sub.items() if k not in scales.values()}
    for wkey, weight in list(out.items()):
        if (weight.dtype in fp8) != (wkey in scales):
            raise ValueError(f"{prefix}{wkey} is {weight.dtype}: "
                             + ("block-fp8 weights need their weight_scale_inv" if weight.dtype in fp8 else
                                f"{prefix}{scales[wkey]} scales block-fp8 weights only"))
        if weight.dtype not in fp8:
            continue
        scale = sub[scales[wkey]]
        rows, cols = weight.shape
        want = (cdiv(rows, FP8_BLOCK), cdiv(cols, FP8_BLOCK))
        if tuple(scale.shape) != want:
            raise ValueError(f"{prefix}{scales[wkey]} must have shape {list(want)} for a {list(weight.shape)} "
                             f"weight, got {list(scale.shape)}")
        s = scale.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
        out[wkey] = weight.float() * s
    return out
