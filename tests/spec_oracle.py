"""A second oracle written from SPEC.md alone, sharing no code with ``kpool.numerics`` or
``kpool.reference``: it checks the serving reference as much as the kernels.

* Pooling (SPEC §2) from the exact softmax (fp64) rounded to bf16. The serving bytes follow a
  fixed fp32 recipe instead, so a dim whose exact value lies within ``MIDPOINT_REL`` (relative
  to the magnitude of its softmax terms, which bounds the fp32 error under cancellation) of a
  bf16 rounding midpoint may round either way: a cache entry must equal the pooling of one of
  those roundings (at most ``MAX_AMBIGUOUS_DIMS`` such dims per pool).
* Queries: FWHT-128 butterflies in fp32 (strides 1..64, scale once), bf16, ue8m0 scale from the
  exponent (exact, ``torch.frexp``), fp8 by torch's round-to-nearest-even cast.
* Selection (SPEC §5) by rules on fp64 logits: the rows' structure (``check_row_structure``:
  whole pools, causality, tail, every visible pool in order when there are at most
  ``select_k``); else no left-out pool scores above a chosen
  one and the chosen are in non-increasing order, both within the fp32 logit's rounding
  (``LOGIT_REL`` of the heads' absolute sum); pools with identical entries (hence identical
  logits on any backend) must be ordered by id, inside the selection and across its edge.
"""

from __future__ import annotations

import itertools

import torch

D = 128
HADAMARD_SCALE = 0.08838834764831845
AMAX_FLOOR = 1e-4
MIDPOINT_REL = 2.0**-20
MAX_AMBIGUOUS_DIMS = 4
LOGIT_REL = 2.0**-20  # fp32 logits: per-head rounding plus a sum over <= 64 heads stay within 2^-21


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Sylvester-ordered Walsh-Hadamard of fp32 ``x [..., 128]``, stages of stride 1, 2, ..., 64."""
    lead = x.shape[:-1]
    h = 1
    while h < D:
        pairs = x.reshape(*lead, D // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, D)
        h *= 2
    return x


def ue8m0_quant(y: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16-exact fp32 ``y [..., 128]`` -> (fp8 values as fp64 ``[..., 128]``, fp32 scale ``[...]``)."""
    fmax = torch.finfo(fp8).max
    v = torch.clamp_min(y.abs().amax(-1), AMAX_FLOOR) * torch.tensor(1.0 / fmax, dtype=torch.float32)
    mant, exp = torch.frexp(v)  # v = mant * 2^exp, mant in [0.5, 1): ceil(log2 v) = exp - (mant == 0.5)
    scale = torch.ldexp(torch.ones_like(v), exp - (mant == 0.5).to(exp.dtype))
    q = torch.clamp(y / scale[..., None], -fmax, fmax).to(fp8).to(torch.float64)
    return q, scale


def rotate_quant(x: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``bf16(FWHT128(x) * 128^-0.5)`` of fp32 ``x [..., 128]``, quantized (``ue8m0_quant``)."""
    return ue8m0_quant(_bf16(fwht(x) * HADAMARD_SCALE), fp8)


def query_codes(q: torch.Tensor, weights: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``q [T, H, 128]``, fp32 ``weights [T, H]`` -> (fp8 values fp64 ``[T, H, 128]``,
    folded head weights fp64 ``[T, H]``: ``w * q_scale * 128^-0.5 * H^-0.5`` in fp32)."""
    heads = q.shape[1]
    codes, scale = rotate_quant(q.float(), fp8)
    w = weights.float() * scale * torch.tensor(D**-0.5 * heads**-0.5, dtype=torch.float32)
    return codes, w.double()


def _softmax_pool(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor):
    """bf16 ``[n, P, 128]`` keys / gates, fp32 ``ape [P, 128]`` -> exact pooled x and the
    magnitude of its terms, fp64 ``[n, 128]``."""
    logits = (gates.float() + ape.float()[None]).double()  # the fp32 sum of a bf16 and an fp32 is exact here
    e = torch.exp(logits - logits.amax(1, keepdim=True))
    terms = e * keys.double()
    total = e.sum(1)
    return terms.sum(1) / total, terms.abs().sum(1) / total


def check_pooled_keys(codes: torch.Tensor, scales: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor,
                      ape: torch.Tensor, pool_size: int, fp8: torch.dtype) -> int:
    """A request's stored entries (``KPoolCache.pooled_keys``: uint8 ``[n, 128]``, fp32 ``[n]``)
    against its committed tokens' keys / gates (bf16 ``[>= n P, 128]``); returns the number of
    pools that matched only through a midpoint dim's other rounding."""
    n = codes.shape[0]
    assert keys.shape[0] >= n * pool_size
    got_q = codes.cpu().view(fp8).to(torch.float64)
    got_s = scales.cpu().float()
    x, mag = _softmax_pool(keys[: n * pool_size].cpu().view(n, pool_size, D),
                           gates[: n * pool_size].cpu().view(n, pool_size, D), ape.cpu())
    xb = _bf16(x.float())
    want_q, want_s = rotate_quant(xb, fp8)
    ambiguous = 0
    for j in torch.nonzero((got_q != want_q).any(1) | (got_s != want_s)).flatten().tolist():
        exact = x[j]
        half_ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-300))) - 8)
        dist = torch.abs(torch.remainder(exact / half_ulp, 2.0) - 1.0) * half_ulp  # to the nearest midpoint
        dims = torch.nonzero(dist < MIDPOINT_REL * mag[j]).flatten().tolist()
        assert 0 < len(dims) <= MAX_AMBIGUOUS_DIMS, f"pool {j}: entry differs from the SPEC pooling"
        matched = False
        for flips in itertools.product((False, True), repeat=len(dims)):
            alt = xb[j].clone()
            for d, flip in zip(dims, flips):
                if flip:  # the other bf16 neighbour of the exact value: one step of the bits
                    away = bool((exact[d].abs() > xb[j, d].abs()))
                    bits = xb[j, d].to(torch.bfloat16).view(torch.int16) + (1 if away else -1)
                    alt[d] = bits.view(torch.bfloat16).float()
            q, s = rotate_quant(alt[None], fp8)
            matched |= bool(torch.equal(q[0], got_q[j]) and torch.equal(s, got_s[j:j + 1]))
        assert matched, f"pool {j}: entry matches neither rounding of its midpoint dims {dims}"
        ambiguous += 1
    return ambiguous


def pool_scores(q: torch.Tensor, weights: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 logits ``[S, n]`` of queries (bf16 ``[S, H, 128]``, fp32 ``[S, H]``) over stored
    entries (uint8 ``[n, 128]``, fp32 ``[n]``), and the sums of their heads' absolute terms."""
    q8, w = query_codes(q.cpu(), weights.cpu(), fp8)
    k8 = codes.cpu().view(fp8).to(torch.float64)
    dots = torch.relu(torch.einsum("shd,nd->shn", q8, k8) * scales.cpu().double())
    terms = dots * w[:, :, None]
    return terms.sum(1), terms.abs().sum(1)


def check_row_structure(rows: torch.Tensor, positions: torch.Tensor, pool_size: int, select_k: int,
                        width: int | None = None) -> list:
    """Structure of ``topk_indices`` rows (int32 ``[S, width]``) at ``positions [S]``: no index
    above the position, ``min(select_k, visible)`` whole, distinct, visible pools (every visible
    pool in order when there are at most ``select_k``) then ``P`` x -1 groups, the tail
    ``[(p+1)//P*P, p]``, -1 padding to ``width``. Returns each row's picked pool ids."""
    natural = select_k * pool_size + pool_size - 1
    out = []
    for row, p in zip(rows.cpu().tolist(), positions.cpu().tolist()):
        assert width is None or len(row) == width, f"pos {p}: {len(row)} columns, {width} expected"
        vis = (p + 1) // pool_size
        assert all(t <= p for t in row), f"pos {p}: index above the position: {max(row)}"
        picks = []
        for c in range(select_k):
            grp = row[c * pool_size:(c + 1) * pool_size]
            if c >= min(select_k, vis):
                assert grp == [-1] * pool_size, f"pos {p}: column group {c} should be padding: {grp}"
                continue
            j = grp[0] // pool_size
            assert grp == [j * pool_size + o for o in range(pool_size)], f"pos {p}: not a whole pool: {grp}"
            assert 0 <= j < vis, f"pos {p}: pool {j} not visible ({vis} visible)"
            picks.append(j)
        assert len(set(picks)) == len(picks), f"pos {p}: a pool picked twice"
        if vis <= select_k:
            assert picks == list(range(vis)), f"pos {p}: every visible pool in order expected, got {picks}"
        tail = list(range(vis * pool_size, p + 1))
        assert row[select_k * pool_size:natural] == tail + [-1] * (pool_size - 1 - len(tail)), f"pos {p}: tail"
        assert row[natural:] == [-1] * (len(row) - natural), f"pos {p}: padding after the tail"
        out.append(picks)
    return out


def check_rows(rows: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, weights: torch.Tensor,
               codes: torch.Tensor, scales: torch.Tensor, pool_size: int, select_k: int, fp8: torch.dtype) -> None:
    """One request's ``topk_indices`` rows (int32 ``[S, width]``) at ``positions [S]``, from its
    queries (bf16 ``[S, H, 128]``, fp32 ``[S, H]``) and its stored entries, by SPEC §5's rules."""
    picks_per_row = check_row_structure(rows, positions, pool_size, select_k)
    scores, magnitudes = pool_scores(q, weights, codes, scales, fp8)
    entry = torch.cat((codes.cpu(), scales.cpu().view(torch.uint8).reshape(-1, 4)), 1)
    for r, (p, picks) in enumerate(zip(positions.tolist(), picks_per_row)):
        vis = (p + 1) // pool_size
        assert vis <= codes.shape[0], f"pos {p}: {vis} pools visible, {codes.shape[0]} stored"
        if vis <= select_k:
            continue
        score = scores[r, :vis]
        tol = LOGIT_REL * float(magnitudes[r, :vis].max())
        chosen = torch.tensor(picks)
        left = torch.ones(vis, dtype=torch.bool)
        left[chosen] = False
        assert float(score[left].max()) <= float(score[chosen].min()) + tol, f"pos {p}: a left-out pool scores higher"
        assert bool((score[chosen][1:] <= score[chosen][:-1] + tol).all()), f"pos {p}: not in score order"
        same = (entry[picks][:, None, :] == entry[None, :vis, :]).all(-1)  # [picks, vis]: identical entries
        for i, j in enumerate(picks):
            twins = torch.nonzero(same[i]).flatten()
            lower_left = twins[(twins < j) & left[twins]]
            assert lower_left.numel() == 0, f"pos {p}: pool {j} chosen over its identical lower pool"
            later = [k for k in picks[i + 1:] if bool(same[i, k])]
            assert all(k > j for k in later), f"pos {p}: identical pools {j}, {later} out of id order"
