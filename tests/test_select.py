"""Pool -> token selection ops (kpool.ops.select): both backends against plain-Python oracles.

The oracles below are written element by element from SPEC §5 / the seed's docstrings, not
from ``kpool.reference``; every test runs under ``KPOOL_BACKEND=torch`` and ``=triton``
(the ``backend`` fixture), so the two backends are compared through the same oracle.
"""

import pytest
import torch

from kpool.ops import select as sel

from _util import ReadBacks

# --- plain-Python oracles -------------------------------------------------------------------


def _map(t, valid, r, page_table, offsets):
    """One token id of row ``r`` -> output value (SPEC §5 mapping; -1 when not valid)."""
    if not valid:
        return -1
    if page_table is not None:
        row = page_table[r]
        return row[min(max(t, 0), len(row) - 1)]
    if offsets is not None:
        return t + offsets[r]
    return t


def oracle_expand_append(pool_ids, seq_lens, p, width=None, page_table=None):
    out = []
    for r, (ids, seq) in enumerate(zip(pool_ids, seq_lens)):
        row = []
        for pid in ids:
            for o in range(p):
                row.append(_map(pid * p + o, pid >= 0, r, page_table, None))
        seq = max(seq, 0)
        start = seq // p * p
        for j in range(p - 1):
            row.append(_map(start + j, start + j < seq, r, page_table, None))
        n = len(ids) * p + p - 1 if width is None else width
        out.append(row + [-1] * (n - len(row)))
    return out


def oracle_expand_to_tokens(group_ids, group_valid, p, page_table=None, offsets=None):
    return [[_map(g * p + o, v, r, page_table, offsets) for g, v in zip(ids, vals) for o in range(p)]
            for r, (ids, vals) in enumerate(zip(group_ids, group_valid))]


def oracle_append_tail(topk_result, seq_lens, pool_lens, p, page_table=None, offsets=None):
    out = []
    for r, hist in enumerate(topk_result):
        seq, start = max(seq_lens[r], 0), max(pool_lens[r], 0) * p
        tail = [_map(start + j, j < seq - start, r, page_table, offsets) for j in range(p - 1)]
        out.append(list(hist) + tail)
    return out


def oracle_write_locs(page_table_64, pool_ids, p):
    def one(i):
        row = (i // 64) * p
        return page_table_64[row] * 64 + i % 64 if i >= 0 and row < len(page_table_64) else -1
    return [one(i) for i in pool_ids]


# --- helpers ---------------------------------------------------------------------------------


def rand(lo, hi, shape, seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def seq_lens_all_residues(rows, p, seed):
    """Token lengths hitting every value mod P, 0, and negative (padding) rows."""
    base = rand(0, 40, (rows,), seed) * p
    res = torch.arange(rows) % p
    seq = base + res
    seq[0], seq[1 % rows] = 0, -1
    if rows > 2:
        seq[2] = -p - 1
    return seq


def check(got, want, dtype=torch.int32):
    assert got.dtype == dtype, got.dtype
    assert got.tolist() == want


# --- expand_pools_and_append_tail ------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 4, 16, 3])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_expand_pools_and_append_tail(backend, device, p, id_dtype):
    rows, n_pools = 9, 70  # rows not a multiple of the kernel's rows per program; 2 pool tiles at P=16
    ids = rand(-1, 300, (rows, n_pools), seed=p, dtype=id_dtype)
    ids[0, :] = -1  # an all-empty pick
    seq = seq_lens_all_residues(rows, p, seed=p + 1).to(torch.int32 if id_dtype == torch.int64 else torch.int64)
    got = sel.expand_pools_and_append_tail(ids.to(device), seq.to(device), p)
    assert got.shape == (rows, n_pools * p + p - 1)
    check(got.cpu(), oracle_expand_append(ids.tolist(), seq.tolist(), p))


@pytest.mark.parametrize("p", [4, 16])
def test_expand_pools_and_append_tail_page_table_and_width(backend, device, p):
    rows, n_pools, w_pt = 6, 12, 50 * p
    ids = rand(-1, 60, (rows, n_pools), seed=7)  # some ids past the page table: clamped
    seq = seq_lens_all_residues(rows, p, seed=8)
    # the page table is a view into a wider buffer whose extra columns hold a sentinel:
    # a gather that ignored the clamp would return it.
    buf = torch.full((rows + 2, w_pt + 5), 999_999, dtype=torch.int32)
    buf[:, :w_pt] = rand(0, 10**6, (rows + 2, w_pt), seed=9, dtype=torch.int32)
    pt = buf[:, :w_pt]
    width = ((n_pools * p + p - 1 + 127) // 128) * 128
    args = (ids.to(device), seq.to(device), p)
    for kw in ({"page_table": pt.to(device)}, {"width": width}, {"width": width, "page_table": pt.to(device)},
               {"width": n_pools * p + p - 1}):
        got = sel.expand_pools_and_append_tail(*args, **kw).cpu()
        ptl = pt.tolist() if "page_table" in kw else None
        check(got, oracle_expand_append(ids.tolist(), seq.tolist(), p, kw.get("width"), ptl))
        assert 999_999 not in got.tolist()


def test_width_rounded_to_128_glm_shape(backend, device):
    """GLM-5.3-Flash: topk 2048, P=4 -> natural width 2051, rounded width 2176, extra columns -1."""
    p, n_pools, rows = 4, 512, 3
    ids = rand(-1, 4000, (rows, n_pools), seed=11, dtype=torch.int32)
    seq = torch.tensor([4001, 4000, 2], dtype=torch.int32)
    got = sel.expand_pools_and_append_tail(ids.to(device), seq.to(device), p, width=2176).cpu()
    assert got.shape == (rows, 2176)
    natural = sel.expand_pools_and_append_tail(ids.to(device), seq.to(device), p).cpu()
    assert natural.shape == (rows, 2051)
    assert torch.equal(got[:, :2051], natural)
    assert (got[:, 2051:] == -1).all()
    check(got, oracle_expand_append(ids.tolist(), seq.tolist(), p, 2176))


def test_expand_pools_and_append_tail_strided_inputs(backend, device):
    p, rows, n_pools = 4, 5, 8
    big = rand(-1, 100, (rows * 2, n_pools * 3), seed=12)
    ids = big[::2, 1::3]  # row stride and inner stride != 1
    seq_buf = rand(0, 300, (rows * 3,), seed=13)
    seq = seq_buf[::3]
    got = sel.expand_pools_and_append_tail(ids.to(device), seq.to(device), p).cpu()
    check(got, oracle_expand_append(ids.tolist(), seq.tolist(), p))
    # a row-strided (padded) input with unit inner stride goes to the kernel as is
    ids2 = big[:, :n_pools]
    seq2 = rand(0, 300, (rows * 2,), seed=14)
    got2 = sel.expand_pools_and_append_tail(ids2.to(device), seq2.to(device), p).cpu()
    check(got2, oracle_expand_append(ids2.tolist(), seq2.tolist(), p))


def test_expand_pools_and_append_tail_empty(backend, device):
    ids = torch.zeros((0, 8), dtype=torch.int32, device=device)
    seq = torch.zeros((0,), dtype=torch.int32, device=device)
    assert sel.expand_pools_and_append_tail(ids, seq, 4).shape == (0, 35)
    no_pools = torch.zeros((3, 0), dtype=torch.int32, device=device)
    seq3 = torch.tensor([5, 4, 7], dtype=torch.int32, device=device)
    got = sel.expand_pools_and_append_tail(no_pools, seq3, 4, width=8).cpu()
    check(got, oracle_expand_append([[], [], []], [5, 4, 7], 4, 8))


# --- expand_pools_to_tokens ------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 4, 16])
@pytest.mark.parametrize("mapping", ["none", "page_table32", "page_table64", "offsets", "offsets2d"])
def test_expand_pools_to_tokens(backend, device, p, mapping):
    rows, n_pools = 7, 10
    gids = rand(-2, 40, (rows, n_pools), seed=20 + p)  # negative ids with valid=True stay (seed semantics)
    valid = rand(0, 4, (rows, n_pools), seed=21 + p) > 0
    pt = offs = None
    if mapping.startswith("page_table"):
        pt = rand(0, 10**6, (rows, 30 * p), seed=22, dtype=torch.int32 if mapping == "page_table32" else torch.int64)
    elif mapping.startswith("offsets"):
        offs = rand(0, 10**5, (rows,), seed=23)
    kw = {}
    if pt is not None:
        kw["page_table"] = pt.to(device)
    if offs is not None:
        kw["topk_offsets"] = (offs[:, None] if mapping == "offsets2d" else offs).to(device)
    got = sel.expand_pools_to_tokens(gids.to(device), valid.to(device), n_pools * p, p, **kw).cpu()
    assert got.shape == (rows, n_pools * p)
    want = oracle_expand_to_tokens(gids.tolist(), valid.tolist(), p, pt.tolist() if pt is not None else None,
                                   offs.tolist() if offs is not None else None)
    check(got, want)


@pytest.mark.parametrize("p", [4, 16])
def test_topk_offsets_strided_column(backend, device, p):
    """``topk_offsets [rows, 1]`` may be a column of a wider tensor (row stride != 1): every
    row must read its own offset, in expand_pools_to_tokens and append_tail_to_topk."""
    rows, n_pools = 7, 5
    gids = rand(0, 40, (rows, n_pools), seed=60 + p)
    valid = rand(0, 4, (rows, n_pools), seed=61 + p) > 0
    table = rand(0, 10**5, (rows, 3), seed=62)
    offs = table[:, 1:2]  # [rows, 1], stride(0) == 3
    assert offs.stride(0) == 3
    got = sel.expand_pools_to_tokens(gids.to(device), valid.to(device), n_pools * p, p,
                                     topk_offsets=offs.to(device)).cpu()
    want = oracle_expand_to_tokens(gids.tolist(), valid.tolist(), p, None, offs[:, 0].tolist())
    check(got, want)
    hist = rand(-1, 1000, (rows, 9), seed=63, dtype=torch.int32)
    seq = seq_lens_all_residues(rows, p, seed=64)
    pool_lens = torch.div(seq, p, rounding_mode="floor")
    got = sel.append_tail_to_topk(hist.to(device), seq.to(device), pool_lens.to(device), p,
                                  topk_offsets=offs.to(device)).cpu()
    check(got, oracle_append_tail(hist.tolist(), seq.tolist(), pool_lens.tolist(), p, None, offs[:, 0].tolist()))


# --- append_tail_to_topk ---------------------------------------------------------------------


@pytest.mark.parametrize("p", [4, 16])
@pytest.mark.parametrize("mapping", ["none", "page_table", "offsets"])
def test_append_tail_to_topk(backend, device, p, mapping):
    rows, n_cols = 9, 37
    hist = rand(-1, 1000, (rows, n_cols), seed=30, dtype=torch.int32)
    seq = seq_lens_all_residues(rows, p, seed=31)
    pool_lens = torch.div(seq, p, rounding_mode="floor")
    pool_lens[3] = seq[3] // p - 2  # inconsistent: more than P-1 tail tokens -> capped at P-1
    pool_lens[4] = seq[4] // p + 1  # inconsistent: negative count -> empty tail
    kw, pt, offs = {}, None, None
    if mapping == "page_table":
        pt = rand(0, 10**6, (rows + 1, 41 * p), seed=32, dtype=torch.int32)
        kw["page_table"] = pt.to(device)
    elif mapping == "offsets":
        offs = rand(0, 10**5, (rows,), seed=33, dtype=torch.int32)
        kw["topk_offsets"] = offs.to(device)
    got = sel.append_tail_to_topk(hist.to(device), seq.to(device), pool_lens.to(device), p, **kw).cpu()
    want = oracle_append_tail(hist.tolist(), seq.tolist(), pool_lens.tolist(), p,
                              pt.tolist() if pt is not None else None, offs.tolist() if offs is not None else None)
    check(got, want)


def test_append_tail_p1_returns_input(backend, device):
    hist = rand(-1, 100, (3, 5), seed=34, dtype=torch.int32).to(device)
    seq = torch.tensor([7, 0, -1], device=device)
    assert sel.append_tail_to_topk(hist, seq, seq, 1) is hist


def test_gather_index_per_row_not_row0(backend, device):
    """SPEC §6: a ``[1, cols]`` gather index makes every row read row 0's history. Each row
    here has a distinct history (row 0's is empty), tail and page-table row."""
    p, rows, n_pools = 4, 6, 5
    pool_ids = torch.full((rows, n_pools), -1, dtype=torch.int32)
    for r in range(1, rows):
        pool_ids[r, :r] = torch.arange(r) * 3 + r  # row r picks r pools of its own
    seq = torch.tensor([1, 22, 35, 47, 61, 80], dtype=torch.int32)
    pt = torch.arange(rows * 100, dtype=torch.int32).reshape(rows, 100) * 10  # distinct per row
    for kw in ({}, {"page_table": pt.to(device)}):
        fused = sel.expand_pools_and_append_tail(pool_ids.to(device), seq.to(device), p, **kw).cpu()
        ptl = pt.tolist() if kw else None
        check(fused, oracle_expand_append(pool_ids.tolist(), seq.tolist(), p, page_table=ptl))
        assert len({tuple(r) for r in fused.tolist()}) == rows
        # the two-step path (expand, then append the tail) gives the same rows
        tokens = sel.expand_pools_to_tokens(pool_ids.to(device), (pool_ids >= 0).to(device), n_pools * p, p,
                                            **kw)
        two_step = sel.append_tail_to_topk(tokens, seq.to(device), (seq // p).to(device), p, **kw).cpu()
        assert torch.equal(two_step, fused)
        for r in range(rows):
            hist = two_step[r, : n_pools * p].tolist()
            assert hist == fused[r, : n_pools * p].tolist()
            assert (hist.count(-1) == (n_pools - r) * p)  # row r kept its own r pools


# --- build_pooled_page_table / compute_pooled_write_locs / budget -------------------------------


@pytest.mark.parametrize("p", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_build_pooled_page_table(backend, device, p, dtype):
    for shape in [(64,), (5, 32), (2, 3, 16 * p)]:
        pt = rand(-1, 10**6, shape, seed=40, dtype=dtype).to(device)
        got = sel.build_pooled_page_table(pt, p)
        assert got.dtype == dtype and got.is_contiguous() and got.data_ptr() != pt.data_ptr()
        assert got.cpu().tolist() == pt.cpu()[..., ::p].tolist()
    wide = rand(0, 10**6, (6, 64), seed=41, dtype=dtype)
    strided = wide.t()[:, :3] if p == 1 else wide[::2, :]  # non-contiguous input
    got = sel.build_pooled_page_table(strided.to(device), p).cpu()
    assert got.is_contiguous() and got.tolist() == strided[..., ::p].tolist()


@pytest.mark.parametrize("p", [1, 4, 16])
def test_compute_pooled_write_locs(backend, device, p):
    pt64 = rand(0, 5000, (37,), seed=50)
    n_ok = ((37 + p - 1) // p) * 64  # ids below this have a page row inside the table
    ids = rand(-3, n_ok, (4, 29), seed=51, dtype=torch.int32)
    got = sel.compute_pooled_write_locs(pt64.to(device), ids.to(device), p).cpu()
    assert got.shape == ids.shape and got.dtype == torch.int64
    want = [oracle_write_locs(pt64.tolist(), row, p) for row in ids.tolist()]
    assert got.tolist() == want


def test_compute_pooled_write_locs_out_of_range(backend, device, monkeypatch):
    p, pt64 = 4, torch.arange(9, dtype=torch.int32) + 100  # rows 0, 4, 8 -> ids < 192
    ids = torch.tensor([0, 191, 192, -1, 500])
    with pytest.raises(ValueError, match="pool_ids"):
        sel.compute_pooled_write_locs(pt64.to(device), ids.to(device), p)
    big = torch.tensor([2**58, 1 << 57, (1 << 57) - 1, -1])  # entry * 64 + 63 must fit in int64
    for entry in (2**58, 1 << 57):
        with pytest.raises(ValueError, match=f"page_table_64 holds {entry}"):
            sel.compute_pooled_write_locs(big[big == entry].to(device), torch.tensor([0, 63]).to(device), 1)
    top = sel.compute_pooled_write_locs(big[2:].to(device), torch.tensor([63, 0]).to(device), 1).cpu()
    assert top.tolist() == [2**63 - 1, 2**63 - 64]
    monkeypatch.setenv("KPOOL_CHECK", "0")  # unchecked: the kernel still never reads past the table
    got = sel.compute_pooled_write_locs(pt64.to(device), ids.to(device), p).cpu().tolist()
    assert got == oracle_write_locs(pt64.tolist(), ids.tolist(), p) == [100 * 64, 108 * 64 + 63, -1, -1, -1]


def test_compute_pooled_write_locs_page_row_at_the_table_end(backend, device, monkeypatch):
    """Unchecked, ids whose page row is exactly the table's length (8 rows, P=4: ids 128..191)
    are -1 although the memory after the table is readable (a view of a longer table)."""
    p, full = 4, torch.arange(16, dtype=torch.int32) + 100
    pt64, ids = full[:8], torch.tensor([0, 127, 128, 191, 192])
    monkeypatch.setenv("KPOOL_CHECK", "0")
    got = sel.compute_pooled_write_locs(pt64.to(device), ids.to(device), p).cpu().tolist()
    assert got == oracle_write_locs(pt64.tolist(), ids.tolist(), p) == [100 * 64, 104 * 64 + 63, -1, -1, -1]


@pytest.mark.parametrize("p", [4, 16])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_visible_counts(backend, device, p, dtype):
    """Tokens (``pos + 1``) and complete pools (``(pos + 1) // P``) per row, 0 for padding
    rows (any negative position), every pool-boundary class, rows past one program's block."""
    pos = torch.cat([torch.arange(-3, 3 * p + 2), torch.tensor([-(2 ** 31), 2 ** 31 - 2])]).to(dtype)
    pos = torch.cat([pos, torch.randint(0, 1 << 20, (2500,), generator=torch.Generator().manual_seed(p)).to(dtype)])
    grid = pos[: pos.numel() // 3 * 3].reshape(-1, 3)  # [B, n] as the decode step passes it
    seq, lens = sel.visible_counts(grid.to(device), p)
    want = [max(x + 1, 0) for x in grid.reshape(-1).tolist()]
    assert seq.dtype == lens.dtype == torch.int64 and seq.shape == lens.shape == (grid.numel(),)
    assert seq.cpu().tolist() == want
    assert lens.cpu().tolist() == [x // p for x in want]
    with pytest.raises(TypeError, match="positions"):
        sel.visible_counts(grid.float(), p)
    with pytest.raises(ValueError, match="pool_size"):
        sel.visible_counts(grid, 0)


def test_history_group_budget_for_topk():
    assert sel.history_group_budget_for_topk(2048, 4) == 512
    assert sel.history_group_budget_for_topk(2048, 16) == 128
    with pytest.raises(ValueError, match="topk"):
        sel.history_group_budget_for_topk(2050, 4)
    with pytest.raises(ValueError, match="topk must be >= 4"):  # no pool to select
        sel.history_group_budget_for_topk(0, 4)
    with pytest.raises(ValueError, match="pool_size"):
        sel.history_group_budget_for_topk(2048, 0)


# --- validation --------------------------------------------------------------------------------


def _with(t, value):
    """A copy of ``t`` holding ``value`` at its first element."""
    t = t.clone()
    t.view(-1)[0] = value
    return t


def _bad_calls():
    i32 = torch.int32
    ids = torch.zeros((3, 4), dtype=i32)
    seq = torch.zeros((3,), dtype=i32)
    pt = torch.zeros((3, 64), dtype=i32)
    ok = torch.ones((3, 4), dtype=torch.bool)
    hist = torch.zeros((3, 16), dtype=i32)
    E = sel.expand_pools_and_append_tail
    X = sel.expand_pools_to_tokens
    A = sel.append_tail_to_topk
    return [
        (E, (ids.float(), seq, 4), {}, TypeError, "pool_ids"),
        (E, (ids[0], seq, 4), {}, ValueError, "pool_ids"),
        (E, (ids, seq[:2], 4), {}, ValueError, "seq_lens"),
        (E, (ids, seq.float(), 4), {}, TypeError, "seq_lens"),
        (E, (ids, seq, 0), {}, ValueError, "pool_size"),
        (E, (ids, seq, 4), {"width": 18}, ValueError, "width"),
        (E, (ids, seq, 4), {"width": 128.0}, TypeError, "width"),
        (E, (ids, seq, 4), {"width": -1}, ValueError, "width"),
        (E, (ids, seq, 4), {"page_table": pt[:2]}, ValueError, "page_table"),
        (E, (ids, seq, 4), {"page_table": pt.float()}, TypeError, "page_table"),
        (E, (ids, seq, 4), {"page_table": pt[:, :0]}, ValueError, "page_table"),
        (E, (ids, seq, 4), {"page_table": pt[0]}, ValueError, "page_table"),
        (X, (ids, ok, 16, 4), {"page_table": pt, "topk_offsets": seq}, ValueError, "topk_offsets"),
        (X, (ids, ok, 18, 4), {}, ValueError, "topk"),
        (X, (ids, ok, 20, 4), {}, ValueError, "group_ids"),
        (X, (ids, ok.int(), 16, 4), {}, TypeError, "group_valid"),
        (X, (ids, ok[:, :3], 16, 4), {}, ValueError, "group_valid"),
        (X, (ids, ok, 16, 4), {"topk_offsets": seq[:, None].expand(3, 2)}, ValueError, "topk_offsets"),
        (X, (ids, ok, 16, 4), {"topk_offsets": seq.float()}, TypeError, "topk_offsets"),
        (A, (hist.long(), seq, seq, 4), {}, TypeError, "topk_result"),
        (A, (hist, seq, seq[:1], 4), {}, ValueError, "pool_lens"),
        (A, (hist, seq[:, None], seq, 4), {}, ValueError, "seq_lens"),
        (A, (hist, seq, seq, 4), {"page_table": pt, "topk_offsets": seq}, ValueError, "topk_offsets"),
        # int32 outputs: token ids (pool * P + o, + offsets) and mapped ids past 2^31 - 1 are rejected, not wrapped
        (E, (_with(ids.long(), 2**29), seq, 4), {}, ValueError, "pool_ids holds 536870912"),
        (E, (ids, _with(seq.long(), 2**31), 4), {}, ValueError, "seq_lens holds 2147483648"),
        (E, (ids, seq, 4), {"page_table": _with(pt.long(), 2**31)}, ValueError, "page_table holds"),
        (X, (_with(ids.long(), 2**31), ok, 16, 4), {}, ValueError, "group_ids"),
        (X, (ids, ok, 16, 4), {"topk_offsets": _with(seq.long(), 2**31 - 3)}, ValueError, "topk_offsets maps"),
        (A, (hist, _with(seq.long(), 2**31), seq, 4), {}, ValueError, "seq_lens"),
        (A, (hist, seq + 5, seq, 4), {"topk_offsets": _with(seq.long(), 2**31 - 4)}, ValueError, "topk_offsets"),
        (X, (ids, ok, 16, 4), {"topk_offsets": _with(seq.long(), -3)}, ValueError, "topk_offsets holds -3"),
        # output columns past 2^31 - 1 (int32 column ids) are named before anything is allocated
        (E, (ids, seq, 4), {"width": 2**31}, ValueError, "width must be at most 2147483647"),
        (E, (ids[:, :1].expand(3, 2**29), seq, 4), {}, ValueError, "536870912 pools per row .* 2147483651 output"),
        (X, (ids, ok, 2**31, 4), {}, ValueError, "topk must be at most 2147483647"),
        (A, (hist[:, :1].expand(3, 2**31 - 3), seq, seq, 4), {}, ValueError, "2147483648 output columns"),
        (A, (hist, seq + 5, seq, 4), {"topk_offsets": _with(seq.long(), -1)}, ValueError, "topk_offsets holds -1"),
        (sel.build_pooled_page_table, (pt[:, :62], 4), {}, ValueError, "page_table"),
        (sel.build_pooled_page_table, (pt.float(), 4), {}, TypeError, "page_table"),
        (sel.build_pooled_page_table, (pt[0, 0], 4), {}, ValueError, "page_table"),
        (sel.compute_pooled_write_locs, (pt, seq, 4), {}, ValueError, "page_table_64"),
        (sel.compute_pooled_write_locs, (pt[0], seq.float(), 4), {}, TypeError, "pool_ids"),
        (sel.compute_pooled_write_locs, (pt[0], seq, -1), {}, ValueError, "pool_size"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_validation_errors_name_the_argument(backend, case):
    fn, args, kwargs, exc, match = _bad_calls()[case]
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize("op", ["expand_pools_and_append_tail", "expand_pools_to_tokens", "append_tail_to_topk"])
def test_value_checks_read_back_once(op, device, monkeypatch):
    """An expansion's value checks (ids, lengths, page table or offsets) cost the host one
    read-back together: counted up to the expansion, which is stubbed out."""
    monkeypatch.setenv("KPOOL_BACKEND", "torch")
    calls = []
    monkeypatch.setattr(sel.reference, op, lambda *a, **k: calls.append(a))
    ids = torch.zeros((3, 4), dtype=torch.int64, device=device)
    seq = torch.full((3,), 5, dtype=torch.int64, device=device)
    pt = torch.zeros((3, 64), dtype=torch.int32, device=device)
    args, kwargs = {
        "expand_pools_and_append_tail": ((ids, seq, 4), {"page_table": pt}),
        "expand_pools_to_tokens": ((ids, ids >= 0, 16, 4), {"topk_offsets": seq}),
        "append_tail_to_topk": ((ids.int(), seq, seq // 4, 4), {"topk_offsets": seq}),
    }[op]
    with ReadBacks() as mode:
        getattr(sel, op)(*args, **kwargs)
    assert mode.reads == ["tolist"] and len(calls) == 1


def test_int32_range_edges(backend, device):
    """The largest pool id, length and offset whose token ids fit int32 are accepted, and
    invalid pools (``group_valid`` False) may hold any id."""
    top = 2**31 // 4 - 1
    rows = sel.expand_pools_and_append_tail(torch.tensor([[top]], device=device), torch.tensor([2**31 - 1], device=device), 4)
    assert rows.tolist() == [[4 * top + o for o in range(4)] + [2**31 - 4, 2**31 - 3, 2**31 - 2]]
    out = sel.expand_pools_to_tokens(torch.tensor([[1, 2**40]], device=device),
                                     torch.tensor([[True, False]], device=device), 8, 4,
                                     topk_offsets=torch.tensor([2**31 - 8], device=device))
    assert out.tolist() == [[2**31 - 4, 2**31 - 3, 2**31 - 2, 2**31 - 1, -1, -1, -1, -1]]


def test_validation_device_mismatch(backend):
    meta = torch.zeros((3,), dtype=torch.int32, device="meta")
    ids = torch.zeros((3, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens"):
        sel.expand_pools_and_append_tail(ids, meta, 4)


def test_selection_helpers_take_empty_inputs(backend, device):
    """Zero rows / ids / page-table columns: correctly shaped empty results, nothing launched."""
    i32 = dict(dtype=torch.int32, device=device)
    got = sel.append_tail_to_topk(torch.zeros((0, 8), **i32), torch.zeros((0,), **i32), torch.zeros((0,), **i32), 4)
    assert got.shape == (0, 11) and got.dtype == torch.int32
    pt = torch.zeros((3, 0), dtype=torch.int64, device=device)
    got = sel.build_pooled_page_table(pt, 4)
    assert got.shape == (3, 0) and got.dtype == torch.int64
    table = torch.arange(8, dtype=torch.int64, device=device)
    for shape in ((0,), (2, 0)):
        got = sel.compute_pooled_write_locs(table, torch.zeros(shape, **i32), 4)
        assert got.shape == shape and got.dtype == torch.int64
