"""The SPEC-only oracle (``spec_oracle.py``) against kpool, and proof that it can fail.

* Queries: kpool's rotation, ue8m0 fp8 codes and folded head weights equal the oracle's bit
  for bit (both fp8 formats).
* Pooled entries written by ``KPoolCache`` (torch backend; the Triton paths equal it byte for
  byte elsewhere) match the exact fp64 pooling, up to a bf16 rounding midpoint, on inputs with
  heavy cancellation; such pools are rare.
* Mutations the oracle must reject: a flipped code, a non-midpoint dim rounded the other way,
  a swapped selection order, a worse pool picked, an identical higher-id pool picked, a
  shifted tail.
"""

from __future__ import annotations

import pytest
import torch

import spec_oracle
from kpool import KPoolCache

D = 128
FP8S = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


def _cache(pool, fp8, ape, pages=64):
    return KPoolCache(pages, page_size=16, pool_size=pool, max_requests=2, max_spec_tokens=1, ape=ape,
                      device="cpu", fp8_dtype=fp8)


@pytest.mark.parametrize("fp8", FP8S, ids=["e4m3fn", "e4m3fnuz"])
def test_query_side_matches_kpool(fp8, monkeypatch):
    import kpool
    monkeypatch.setenv("KPOOL_BACKEND", "torch")
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(512, 32, D, generator=g) * torch.rand(512, 32, 1, generator=g) * 8).to(torch.bfloat16)
    w = torch.randn(512, 32, generator=g)
    codes, _, folded = kpool.quantize_queries(q, w, fp8_dtype=fp8)
    want_codes, want_w = spec_oracle.query_codes(q, w, fp8)
    assert torch.equal(codes.view(fp8).double().reshape(want_codes.shape), want_codes)
    assert torch.equal(folded.double().reshape(want_w.shape), want_w)


@pytest.mark.parametrize("fp8", FP8S, ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("pool", [4, 16])
def test_pooled_entries_match_exact_pooling(pool, fp8, monkeypatch):
    monkeypatch.setenv("KPOOL_BACKEND", "torch")
    g = torch.Generator().manual_seed(pool)
    ape = torch.randn(pool, D, generator=g) * 2
    n_pools = 4096 // pool
    keys = (torch.randn(n_pools * pool, D, generator=g) * 4).to(torch.bfloat16)
    gates = (torch.randn(n_pools * pool, D, generator=g) * 3).to(torch.bfloat16)
    keys[::2] = -keys[1::2]  # opposite neighbours: pooled values cancel
    cache = _cache(pool, fp8, ape)
    cache.prefill(["r"], [keys], [gates])
    codes, scales = cache.pooled_keys("r")
    ambiguous = spec_oracle.check_pooled_keys(codes, scales, keys, gates, ape, pool, fp8)
    assert ambiguous <= n_pools // 50


def _midpoint_pool():
    """One P=4 pool whose dim 0 is exactly the bf16 midpoint 1 + 2^-8 (equal softmax weights
    there); its other dims have random weights, far from any midpoint."""
    g = torch.Generator().manual_seed(5)
    ape = torch.randn(4, D, generator=g)
    gates = torch.randn(4, D, generator=g).to(torch.bfloat16)
    keys = torch.randn(4, D, generator=g).to(torch.bfloat16)
    ape[:, 0], gates[:, 0] = ape[0, 0], gates[0, 0]
    keys[:, 0] = torch.tensor([1.0, 1.0 + 2**-7, 1.0, 1.0 + 2**-7]).to(torch.bfloat16)
    return keys, gates, ape


@pytest.mark.parametrize("fp8", FP8S, ids=["e4m3fn", "e4m3fnuz"])
def test_midpoint_dims_accept_either_rounding_and_nothing_else(fp8):
    keys, gates, ape = _midpoint_pool()
    x, _ = spec_oracle._softmax_pool(keys[None], gates[None], ape)
    assert float(x[0, 0]) == 1.0 + 2**-8
    xb = spec_oracle._bf16(x.float())
    codes, scale = spec_oracle.rotate_quant(xb, fp8)
    as_stored = lambda q: q.to(fp8).view(torch.uint8)  # noqa: E731
    assert spec_oracle.check_pooled_keys(as_stored(codes), scale, keys, gates, ape, 4, fp8) == 0
    for dim, ok in ((0, True), (1, False)):
        alt = xb.clone()
        alt[0, dim] = (alt[0, dim].to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float()
        alt_codes, alt_scale = spec_oracle.rotate_quant(alt, fp8)
        if ok:
            assert spec_oracle.check_pooled_keys(as_stored(alt_codes), alt_scale, keys, gates, ape, 4, fp8) == 1
        else:
            with pytest.raises(AssertionError):
                spec_oracle.check_pooled_keys(as_stored(alt_codes), alt_scale, keys, gates, ape, 4, fp8)


def test_flipped_code_is_rejected(monkeypatch):
    monkeypatch.setenv("KPOOL_BACKEND", "torch")
    g = torch.Generator().manual_seed(2)
    ape = torch.randn(4, D, generator=g)
    keys = torch.randn(64, D, generator=g).to(torch.bfloat16)
    gates = torch.randn(64, D, generator=g).to(torch.bfloat16)
    cache = _cache(4, torch.float8_e4m3fn, ape)
    cache.prefill(["r"], [keys], [gates])
    codes, scales = cache.pooled_keys("r")
    codes = codes.clone()
    codes[7, 33] ^= 1
    with pytest.raises(AssertionError, match="pool 7"):
        spec_oracle.check_pooled_keys(codes, scales, keys, gates, ape, 4, torch.float8_e4m3fn)


def _scored_rows(monkeypatch, twins):
    """Two decode rows over 40 pools (select_k 4), kpool's rows and everything the oracle needs."""
    monkeypatch.setenv("KPOOL_BACKEND", "torch")
    g = torch.Generator().manual_seed(3)
    ape = torch.randn(4, D, generator=g)
    keys = torch.randn(162, D, generator=g).to(torch.bfloat16)
    gates = torch.randn(162, D, generator=g).to(torch.bfloat16)
    if twins:  # every pool built from the same four tokens: identical entries
        keys[:160], gates[:160] = keys[:4].repeat(40, 1), gates[:4].repeat(40, 1)
    cache = _cache(4, torch.float8_e4m3fn, ape)
    cache.prefill(["r"], [keys[:160]], [gates[:160]])
    cache.decode(["r"], keys[None, 160:], gates[None, 160:])
    q = (torch.randn(2, 16, D, generator=g) * 2).to(torch.bfloat16)
    w = torch.randn(2, 16, generator=g)
    rows = cache.topk_indices(["r"], q, w, index_topk=16)
    codes, scales = cache.pooled_keys("r")
    return rows, (torch.tensor([160, 161]), q, w, codes, scales, 4, 4, torch.float8_e4m3fn)


def _pools(row):
    return [t // 4 for t in row[:16:4].tolist()]


def _set_pools(row, pools):
    row[:16] = torch.tensor([j * 4 + o for j in pools for o in range(4)], dtype=row.dtype)


@pytest.mark.parametrize("mutation", ["swap_order", "worse_pool", "shift_tail", "higher_twin"])
def test_mutated_rows_are_rejected(mutation, monkeypatch):
    rows, args = _scored_rows(monkeypatch, twins=mutation == "higher_twin")
    spec_oracle.check_rows(rows, *args)  # kpool's own rows pass
    bad = rows.clone()
    picks = _pools(bad[0])
    if mutation == "swap_order":
        _set_pools(bad[0], [picks[1], picks[0]] + picks[2:])
    elif mutation == "worse_pool":
        scores, _ = spec_oracle.pool_scores(args[1][:1], args[2][:1], args[3], args[4], args[7])
        _set_pools(bad[0], picks[:3] + [int(scores[0].argmin())])  # the worst pool instead of the 4th best
    elif mutation == "shift_tail":
        bad[1, 16] += 1
    else:
        assert picks == [0, 1, 2, 3]
        _set_pools(bad[0], [0, 1, 2, 7])
    with pytest.raises(AssertionError):
        spec_oracle.check_rows(bad, *args)
