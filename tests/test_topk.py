"""select_pools: deterministic top-k over pools (SPEC.md §5).

Both backends against a plain-Python oracle (sort by score descending, ties to the lower
id, NaN last, -0.0 == +0.0) and against ``kpool.reference``: exact ties on purpose,
all-visible rows in id order, -1 padding, rows longer than one kernel block, arbitrary
fp32 bit patterns, strided rows, validation.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from kpool import reference
from kpool.ops import topk
from kpool.ops.topk import LEAF_BASE, select_pools
from _util import GarbageTorch


def oracle(logits, pool_lens, select_k):
    """Python-only selection rule, row by row."""
    out = []
    for row, n in zip(logits.cpu().tolist(), pool_lens.cpu().tolist()):
        n = max(0, min(int(n), len(row)))
        if n <= select_k:
            ids = list(range(n))
        else:
            ids = sorted(range(n), key=lambda j: (math.isnan(row[j]), 0.0 if math.isnan(row[j]) else -row[j], j))
            ids = ids[:select_k]
        out.append(ids + [-1] * (select_k - len(ids)))
    return torch.tensor(out, dtype=torch.int32).reshape(len(out), select_k)


def check(logits, pool_lens, select_k, device):
    got = select_pools(logits.to(device), pool_lens.to(device), select_k)
    assert got.dtype == torch.int32 and got.shape == (logits.shape[0], select_k)
    want = oracle(logits, pool_lens, select_k)
    assert torch.equal(got.cpu(), want), f"first bad row: {(got.cpu() != want).any(1).nonzero()[0].item()}"
    assert torch.equal(reference.select_pools(logits.cpu(), pool_lens.cpu(), select_k), want)
    return got.cpu()


@pytest.mark.parametrize("select_k", [1, 7, 40])
def test_random_rows_with_many_ties(backend, device, select_k):
    g = torch.Generator().manual_seed(select_k)
    n = 2 * LEAF_BASE + 300  # several leaves: threshold selection
    logits = torch.randint(-6, 6, (6, n), generator=g).float() * 0.25  # many exact ties
    logits[1] = torch.randn(n, generator=g)  # no ties
    logits[2, ::3] = float("-inf")
    pool_lens = torch.tensor([n, n, 900, select_k, select_k + 1, 0], dtype=torch.int32)
    check(logits, pool_lens, select_k, device)


@pytest.mark.parametrize("bits,limit", [(3, 0), (topk.RADIX_BITS, 300), (topk.RADIX_BITS, None)])
@pytest.mark.parametrize("block", [64, 2048])
@pytest.mark.parametrize("select_k", [3, 16, 100])
def test_threshold_selection(backend, device, select_k, block, bits, limit, monkeypatch):
    """Rows of several small leaves (``threshold_select``): the survivor bound from wholly
    visible leaves and its loose fallbacks (no full leaf, every score tied); rows ranked by
    compares (up to ``limit`` survivors per row; ``None``: the default ``RANK_COMPARES``, 0:
    none) and the others by radix passes of ``bits`` bits (64 not a multiple of 3: a last digit of fewer
    bits), in one launch when ``limit`` is 300 (the tied rows keep every key); one or many
    blocks of ``block`` keys per step (rows of at most ``block`` survivors held in registers by
    the radix select, longer ones streamed), ranking slices past the survivors (compared with blocks of
    64 keys, or of ``rank_block``'s wide 256), and the whole 64-bit key range (NaN, -inf and
    +inf next to tiny scores)."""
    monkeypatch.setattr(topk, "MIN_CHUNK", 32)
    monkeypatch.setattr(topk, "SELECT_BLOCK", block)
    monkeypatch.setattr(topk, "SELECT_HELD_KEYS", block)
    monkeypatch.setattr(topk, "RADIX_BITS", bits)
    monkeypatch.setattr(topk, "SURVIVOR_KEYS", block)
    monkeypatch.setattr(topk, "RANK_BLOCK", min(block, topk.RANK_BLOCK))
    monkeypatch.setattr(topk, "RANK_WIDE_PROGRAMS", 1 if block > topk.RANK_BLOCK else 1 << 30)
    if limit is not None:
        monkeypatch.setattr(topk, "RANK_COMPARES", 8 * limit * limit)  # 8 rows
    counts = []
    real = topk.survivors

    def spy(cand, count, *args):
        surv = real(cand, count, *args)
        counts.append(count.clone())
        return surv

    monkeypatch.setattr(topk, "survivors", spy)
    g = torch.Generator().manual_seed(100 + select_k)
    leaf = max(32, topk.key_block(select_k))
    n = 20 * leaf
    logits = torch.randint(-20, 20, (7, n), generator=g).float()  # ties across leaves
    logits[1] = torch.randn(n, generator=g)
    logits[2] = 0.0  # one score everywhere: the ids decide
    logits[3, n // 2:] = float("nan")
    logits[4] = torch.randn(n, generator=g) * 1e-30
    logits[4, ::5] = float("inf")
    logits[4, 1::7] = float("-inf")
    logits[4, 2::11] = float("nan")
    logits[5] = -torch.rand(n, generator=g)
    # tight bound: each leaf of 32 holds exactly cdiv(select_k, n_leaves) high scores
    j = torch.arange(n)
    high = (j % 32) < -(-select_k // (n // 32))
    logits[6] = torch.where(high, 1.0 + j.float() * ((-1) ** (j // 32)), -1.0)
    pool_lens = torch.tensor([n, n - 7, n, n, n, 2 * leaf + 1, n, select_k + 1])
    logits = torch.cat([logits, logits[:1]])
    check(logits, pool_lens, select_k, device)
    if backend == "triton" and limit is not None:
        ranked = counts[0][pool_lens.to(device) > select_k] <= topk.rank_limit(8)
        assert not ranked.any() if limit == 0 else 0 < int(ranked.sum()) < ranked.numel()


@triton.jit
def _radix_select_rows(surv_ptr, n_surv, count_ptr, out_ptr, select_k, KB: tl.constexpr, BLOCK: tl.constexpr,
                       BITS: tl.constexpr, HELD: tl.constexpr):
    row = tl.program_id(0)
    cnt = tl.load(count_ptr + row)
    topk._radix_select(surv_ptr + row * n_surv, cnt, out_ptr + row * select_k, n_surv, select_k, KB, BLOCK, BITS,
                       HELD, 1, 1)  # rows of n_surv visible pools, cnt >= select_k of them survivors


@pytest.mark.parametrize("select_k", [5, 16])
def test_radix_select_at_its_tile_boundaries(device, select_k):
    """The threshold select's radix path on survivor counts at and one past each held tile
    (``HELD / 4``, ``HELD / 2``, ``HELD``; HELD 64, so 16 / 32 / 64) and streamed beyond it
    (blocks of 32): the ``select_k`` best of each row's unique keys, in any order in the
    survivor buffer, sorted, with exact score ties between pools."""
    held, block, n = 64, 32, 200
    counts = [max(select_k, 12), 16, 17, 32, 33, 64, 65, 150]
    g = torch.Generator().manual_seed(select_k)
    logits = torch.randint(-8, 8, (len(counts), n), generator=g).float() * 0.5  # exact ties
    keys = reference.pool_order_keys(logits)
    surv = torch.full((len(counts), n), topk.NO_KEY.value, dtype=torch.int64)
    want = torch.empty((len(counts), select_k), dtype=torch.int32)
    for r, c in enumerate(counts):
        pick = torch.randperm(n, generator=g)[:c]
        surv[r, :c] = keys[r, pick]
        want[r] = (2**32 - 1 - (keys[r, pick].sort(descending=True).values[:select_k] & (2**32 - 1))).int()
    count = torch.tensor(counts, dtype=torch.int32)
    out = torch.full((len(counts), select_k), -2, dtype=torch.int32, device=device)
    surv, count = surv.to(device), count.to(device)
    _radix_select_rows[(len(counts),)](surv, n, count, out, select_k, KB=topk.key_block(select_k), BLOCK=block,
                                       BITS=topk.RADIX_BITS, HELD=held)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("select_k", [16, 100])
def test_survivor_bound_is_tight(device, select_k, monkeypatch):
    """The survivors are exactly the listed keys (each leaf's ``KW = min(leaf, KB)`` best) at
    or above the smallest ``rank``-th best key of the wholly visible leaves (``rank =
    cdiv(select_k, full leaves)``), whatever the lists' order: sorted top-KB lists (select_k
    16: leaves of 32 > KB = 16) and lists that keep all their keys, unsorted after their
    ``HEAD`` best (select_k 100: leaves of 32, rank 2) or sorted (a row with 8 full leaves:
    rank 13 <= HEAD, unsorted; 4 full leaves: rank 25 > HEAD, sorted). Each leaf's best pools
    come last, so an unsorted list's order differs from the sorted one."""
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    monkeypatch.setattr(topk, "MIN_CHUNK", 32)
    seen = {}
    real = topk.threshold_select

    def spy(cand, count, chunk, lens, n_cols, k, out, refine=None, expand=None):
        seen.update(cand=cand.clone(), chunk=chunk, lens=lens, n_cols=n_cols)
        real(cand, count, chunk, lens, n_cols, k, out, refine, expand)

    monkeypatch.setattr(topk, "threshold_select", spy)
    g = torch.Generator().manual_seed(7 + select_k)
    n = 20 * max(32, topk.key_block(select_k))
    logits = torch.randn(4, n, generator=g).sort(dim=1).values  # ascending: each leaf's best last
    logits[1] = logits[1, torch.randperm(n, generator=g)]
    pool_lens = torch.tensor([n, n - 16, 8 * 32 + 5, 4 * 32 + 5])
    check(logits, pool_lens, select_k, device)
    leaf, kw = seen["chunk"], min(seen["chunk"], topk.key_block(select_k))
    assert leaf == 32
    count = torch.zeros(len(pool_lens), dtype=torch.int32, device=device)
    topk.survivors(seen["cand"], count, leaf, seen["lens"], seen["n_cols"], select_k)
    keys = reference.pool_order_keys(logits)  # [rows, n] int64
    for r, vis in enumerate(pool_lens.tolist()):
        full = vis // leaf
        rank = -(-select_k // full)
        listed = torch.cat([keys[r, i:min(i + leaf, vis)].sort(descending=True).values[:kw] for i in range(0, vis, leaf)])
        bound = keys[r, :full * leaf].view(full, leaf).sort(dim=1, descending=True).values[:, rank - 1].min()
        assert int(count[r]) == int((listed >= bound).sum()) >= select_k, f"row {r}"


def test_scratch_starts_as_garbage(device, monkeypatch):
    """The selection's scratch (leaf lists, survivor counters, survivors) is allocated with
    ``torch.empty`` and may hold anything (``GarbageTorch``: int64 keys above every real one),
    so a survivor counter the leaves did not zero (``clear_counts``) would rank stale keys
    among the survivors."""
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    monkeypatch.setattr(topk, "MIN_CHUNK", 32)
    monkeypatch.setattr(topk, "torch", GarbageTorch())
    g = torch.Generator().manual_seed(11)
    n = 20 * 32
    logits = torch.randn(3, n, generator=g)
    logits[1] = 0.0
    check(logits, torch.tensor([n, n - 5, 40]), 16, device)


def test_ties_resolve_to_lower_id(backend, device):
    logits = torch.zeros(3, 50)
    logits[0, [3, 9, 17, 30, 44]] = 5.0  # 5 tied winners, select 3 -> the 3 lowest ids
    logits[1] = 1.0  # everything tied -> 0, 1, 2, ...
    logits[2, [40, 41]] = 2.0
    logits[2, [7, 2, 33]] = 1.0  # ranked 40, 41 (score 2), then 2, 7 (score 1, lower ids first)
    got = check(logits, torch.tensor([50, 50, 50]), 4, device)
    assert got[0].tolist() == [3, 9, 17, 30]
    assert got[1].tolist() == [0, 1, 2, 3]
    assert got[2].tolist() == [40, 41, 2, 7]


def test_all_visible_in_order_and_padding(backend, device):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 20, generator=g)
    got = check(logits, torch.tensor([8, 0, -3, 20], dtype=torch.int64), 8, device)
    assert got[0].tolist() == list(range(8))  # exactly select_k visible: in id order, not by score
    assert got[1].tolist() == [-1] * 8 and got[2].tolist() == [-1] * 8
    assert logits[3, got[3].long()].tolist() == sorted(logits[3].tolist(), reverse=True)[:8]  # by score
    # fewer columns than select_k: every row in order, -1 padded
    got = check(logits[:, :5], torch.tensor([5, 3, 0, 5]), 8, device)
    assert got[0].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    got = check(logits[:, :0], torch.zeros(4, dtype=torch.int32), 8, device)  # no columns at all
    assert got.tolist() == [[-1] * 8] * 4
    # select_k past the smallest leaf (KB = 256 > topk.MIN_CHUNK): a one-leaf row of fewer pools
    wide = torch.randn(3, topk.MIN_CHUNK, generator=g)
    got = check(wide, torch.tensor([topk.MIN_CHUNK, 77, 0]), 200, device)
    assert got[0].tolist() == list(range(topk.MIN_CHUNK)) + [-1] * (200 - topk.MIN_CHUNK)


def test_nan_last_inf_and_signed_zero(backend, device):
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan, -inf, -0.0, 0.0, -1.0, nan, inf, -0.0, 3.0, nan],
                           [nan, nan, nan, nan, nan, -inf, nan, nan, nan, nan]])
    got = check(logits, torch.tensor([10, 10]), 8, device)
    # inf, 3, then the zeros (-0.0 == +0.0: id order), -1, -inf, then NaNs by id
    assert got[0].tolist() == [6, 8, 2, 3, 7, 4, 1, 0]
    assert got[1].tolist() == [5, 0, 1, 2, 3, 4, 6, 7]


def test_arbitrary_bit_patterns(backend, device):
    """Random fp32 bit patterns (denormals, huge values, infinities, NaN payloads)."""
    g = torch.Generator().manual_seed(9)
    bits = torch.randint(-2**31, 2**31, (3, 300), generator=g, dtype=torch.int64).to(torch.int32)
    logits = bits.view(torch.float32).clone()
    logits[1, :150] = logits[1, 150:]  # every value twice
    check(logits, torch.tensor([300, 300, 123]), 33, device)


def test_strided_rows_and_selection_property(backend, device):
    g = torch.Generator().manual_seed(11)
    wide = torch.randint(0, 40, (5, 256), generator=g).float()
    logits = wide[:, 16:216]  # row stride 256
    pool_lens = torch.tensor([200, 150, 64, 65, 199], dtype=torch.int32)
    got = check(logits, pool_lens, 64, device)
    for r in range(5):  # every chosen pool scores >= every visible pool left out
        n = int(pool_lens[r])
        if n <= 64:
            continue
        chosen = got[r].long()
        rest = torch.ones(n, dtype=torch.bool)
        rest[chosen] = False
        assert float(logits[r, chosen].min()) >= float(logits[r, :n][rest].max())


def test_deterministic(backend, device):
    g = torch.Generator().manual_seed(13)
    logits = torch.randint(0, 3, (2, 700), generator=g).float().to(device)
    lens = torch.full((2,), 700, dtype=torch.int32, device=device)
    a = select_pools(logits, lens, 100)
    b = select_pools(logits, lens, 100)
    assert torch.equal(a, b)


def test_pool_lens_past_n(backend, device, monkeypatch):
    logits = torch.arange(12.0).reshape(2, 6).to(device)
    with pytest.raises(ValueError, match="pool_lens"):
        select_pools(logits, torch.tensor([7, 6], device=device), 3)
    monkeypatch.setenv("KPOOL_CHECK", "0")  # unchecked: clamped to N on the device
    got = select_pools(logits, torch.tensor([7, 6], device=device), 3).cpu()
    assert got.tolist() == [[5, 4, 3], [5, 4, 3]]


def test_validation(backend, device):
    logits = torch.zeros(2, 6, device=device)
    lens = torch.tensor([3, 4], device=device)
    with pytest.raises(TypeError, match="logits"):
        select_pools(logits.double(), lens, 2)
    with pytest.raises(ValueError, match="logits"):
        select_pools(logits[0], lens, 2)
    with pytest.raises(ValueError, match="logits"):
        select_pools(torch.zeros(6, 2, device=device).t(), lens, 2)
    with pytest.raises(ValueError, match="pool_lens"):
        select_pools(logits, lens[:1], 2)
    with pytest.raises(TypeError, match="pool_lens"):
        select_pools(logits, lens.float(), 2)
    for bad, error in ((0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="select_k"):
            select_pools(logits, lens, bad)
    with pytest.raises(ValueError, match="select_k must be at most 2147483647, got 1099511627776"):
        select_pools(logits, lens, 2**40)  # named before any allocation of the [R, select_k] ids


def test_survivor_count_limit():
    """A row whose leaves keep ``MAX_SURVIVORS`` candidate keys or more (the radix passes pack
    counts in 27 bits) is refused before any launch (meta tensors: nothing is allocated)."""
    chunk, kb = 128, topk.key_block(512)
    n_lists = topk.MAX_SURVIVORS // min(chunk, kb)
    cand = torch.empty((1, n_lists, topk.list_size(chunk, kb)), dtype=torch.int64, device="meta")
    lens = torch.empty((1,), dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="n_cols"):
        topk.survivors(cand, lens.to(torch.int32), chunk, lens, n_lists * chunk, 512)


def test_no_rows(backend, device):
    check(torch.zeros((0, 300)), torch.zeros((0,), dtype=torch.int32), 7, device)
