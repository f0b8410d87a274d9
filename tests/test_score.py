"""paged_pool_topk: fused decode / verify scoring + selection (no logits row in memory).

Must equal ``select_pools(paged_pool_logits(...))`` bit for bit on every backend, and the
plain-torch composition of the reference: checked with verify rows of different lengths,
padding rows, rows at or under ``select_k`` pools, tied scores across chunks (duplicate
keys: ties to the lower id), bad pages (NaN, ranked last), both layouts and formats,
H in {16, 32, 64}, leaves small enough for 10-12 per row (threshold selection), and validation.
"""

import pytest
import torch
from kpool import reference
from kpool.layout import fp8_max, write_entries
from kpool.ops import score, topk
from kpool.ops.logits import paged_pool_logits
from kpool.ops.score import paged_pool_topk
from kpool.ops.topk import select_pools
from _util import GarbageTorch, GuardedTorch
from test_logits import make_cache, rand_codes, weights

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def run_case(device, *, batch, next_n, heads, page, pages_per, lens, select_k, fp8_dtype, layout="plain",
             seed=0, bad_page=False, duplicate=False, nan_codes=False, lens_after=None):
    num_pages = batch * pages_per + 1
    kv, codes, scales = make_cache(num_pages, page, fp8_dtype, seed, layout)
    if nan_codes:  # one NaN code in every 37th pool (a NaN key: its logit is NaN, ranked last)
        u8 = codes.view(torch.uint8).clone()
        bad = torch.arange(3, u8.shape[0], 37)
        u8[bad, (bad * 7) % 128] = 0x80 if fp8_dtype == torch.float8_e4m3fnuz else 0x7F
        write_entries(kv, bad, u8[bad], scales[bad], layout)
    if duplicate:  # every pool of page 1 a copy of page 0's: exact ties between pools of different chunks
        kv[1] = kv[0]
    g = torch.Generator().manual_seed(seed + 7)
    pt = torch.randperm(num_pages, generator=g)[: batch * pages_per].view(batch, pages_per).to(torch.int32)
    if duplicate:
        pt[:, 0], pt[:, -1] = 0, 1
    if bad_page:
        pt[0, 1] = -1
    q = rand_codes((batch, next_n, heads, 128), fp8_dtype, seed + 3)
    w = weights((batch, next_n, heads), seed + 4)
    lens = torch.as_tensor(lens, dtype=torch.int32).view(batch, next_n)
    args = [t.to(device) for t in (q, kv, w, lens, pt)]
    if lens_after is not None:  # pool_lens's storage holds one more count after the rows' (no row may read it)
        args[3] = torch.cat((args[3].view(-1), args[3].new_tensor([lens_after])))[:-1].view(batch, next_n)
    got = paged_pool_topk(*args, select_k, layout=layout).cpu()
    logits = reference.paged_pool_logits(q.view(torch.uint8), kv, w, lens, pt, layout, fp8_dtype, pages_per * page)
    want = reference.select_pools(logits, lens.view(-1), select_k)
    assert got.dtype == torch.int32 and got.shape == (batch * next_n, select_k)
    assert torch.equal(got, want), f"rows differ: {(got != want).any(1).nonzero().flatten().tolist()}"
    unfused = select_pools(paged_pool_logits(*args, layout=layout), args[3].view(-1), select_k).cpu()
    assert torch.equal(got, unfused)
    # expanded by the selection's kernels (P 4 or 16; natural width, default or explicit, or 61 more columns)
    p = 16 if seed % 2 else 4
    width = [None, select_k * p + p - 1, select_k * p + p + 60][seed % 3]
    rows = torch.arange(batch * next_n)
    seq = lens.view(-1).to(torch.int64) * p + (rows * 5) % p
    seq = torch.where((lens.view(-1) == 0) & (rows % 3 == 0), -1, seq)  # padding rows: no tail
    tokens = paged_pool_topk(*args, select_k, layout=layout, expand=(seq.to(device), p, width)).cpu()
    want_tokens = reference.expand_pools_and_append_tail(want, seq, p, width=width)
    assert tokens.dtype == torch.int32 and tokens.shape == want_tokens.shape
    assert torch.equal(tokens, want_tokens), f"rows differ: {(tokens != want_tokens).any(1).nonzero().flatten().tolist()}"
    return got, logits


@pytest.mark.parametrize("heads, fp8_dtype", [(16, FP8[0]), (32, FP8[1]), (64, FP8[0])])
def test_matches_logits_then_select(backend, device, heads, fp8_dtype):
    # verify rows (next_n = 3) see 1 more pool each; row 5 at select_k, row 2 padding
    got, _ = run_case(device, batch=2, next_n=3, heads=heads, page=64, pages_per=9,
                      lens=[540, 541, 0, 575, 576, 40], select_k=40, fp8_dtype=fp8_dtype, seed=heads)
    assert got[2].tolist() == [-1] * 40 and got[5].tolist() == list(range(40))


def test_leaves_ties_and_bad_page(backend, device, monkeypatch):
    """Leaves of 64 pools (one tile): 10-12 leaves per row (threshold selection); duplicated pages
    tie across leaves; NaN key codes and a bad page score NaN and rank after every other pool."""
    monkeypatch.setattr(topk, "MIN_CHUNK", 32)
    run_case(device, batch=2, next_n=1, heads=16, page=64, pages_per=12, lens=[768, 700],
             select_k=24, fp8_dtype=torch.float8_e4m3fn, seed=5, duplicate=True, nan_codes=True)
    _, logits_nan = run_case(device, batch=2, next_n=2, heads=16, page=64, pages_per=12,
                             lens=[740, 741, 127, 768], select_k=700, fp8_dtype=torch.float8_e4m3fn, seed=6,
                             bad_page=True)
    assert torch.isnan(logits_nan[0, 64:128]).all()


@pytest.mark.parametrize("max_rows", [2, 4])
def test_rows_per_program(backend, device, max_rows, monkeypatch):
    """Verify steps of 5 rows scored ``max_rows`` at a time (the last program partly past the
    step): rows of one program see different pool counts, out of order, at or under
    ``select_k`` next to long rows, none; one leaf per row (ids written by the leaf) and
    several (threshold selection). The selection's scratch starts as garbage: the leaf programs
    zero the survivor counters of their live rows."""
    monkeypatch.setattr(score, "MAX_ROWS", max_rows)
    monkeypatch.setattr(topk, "torch", GarbageTorch())
    run_case(device, batch=2, next_n=5, heads=32, page=64, pages_per=8,
             lens=[300, 17, 0, 450, 16, 449, 448, 5, 120, 64], select_k=16, fp8_dtype=torch.float8_e4m3fn, seed=11)
    run_case(device, batch=2, next_n=5, heads=16, page=64, pages_per=2,
             lens=[100, 17, 128, 0, 16, 127, 3, 90, 91, 40], select_k=16, fp8_dtype=torch.float8_e4m3fnuz, seed=12)


def test_partial_row_group_stays_inside_its_step(device, monkeypatch):
    """next_n = 3 scored 2 rows at a time: the last program's row past the step stays dead (no write past count)."""
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    guarded = GuardedTorch()  # scratch followed by guards: a dead row past the batch zeroes its counter there
    monkeypatch.setattr(topk, "torch", guarded)
    monkeypatch.setattr(score, "torch", guarded)
    assert score.query_rows(3) == 2  # each step's last program: one live row, one past the step
    assert score.wide_plan(6, 256, 16, torch.device(device))[1] > 1  # several leaves: survivor counters
    run_case(device, batch=2, next_n=3, heads=16, page=64, pages_per=4, lens=[200, 201, 202, 150, 17, 151],
             select_k=16, fp8_dtype=torch.float8_e4m3fn, seed=13, lens_after=256)
    guarded.check("paged_pool_topk's scratch")


def test_wide_plan_counts_the_leaf_programs_of_a_verify_step(device, monkeypatch):
    """The fused selection plans its leaves with the launch's query-row groups and head count: a
    verify step of next_n = 3 scored 2 rows at a time has batch x 2 leaf programs per leaf, not
    batch x 3."""
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    real, seen = score.wide_plan, []
    monkeypatch.setattr(score, "wide_plan",
                        lambda *a, **kw: seen.append((kw.get("groups"), kw.get("heads"))) or real(*a, **kw))
    run_case(device, batch=2, next_n=3, heads=16, page=64, pages_per=4, lens=[200, 201, 202, 150, 17, 151],
             select_k=16, fp8_dtype=torch.float8_e4m3fn, seed=14, lens_after=256)
    assert seen and set(seen) == {(2 * 2, 16)}, seen  # every selection of the case (ids, then tokens)


@pytest.mark.parametrize("layout", ["plain", "preshuffle"])
def test_layouts_small_pages(backend, device, layout):
    run_case(device, batch=3, next_n=2, heads=32, page=32, pages_per=5, lens=[150, 151, 160, 10, 0, 99],
             select_k=16, fp8_dtype=torch.float8_e4m3fnuz, layout=layout, seed=9)


def test_no_rows(backend, device):
    """A batch of no requests: ``[0, select_k]`` ids, or ``[0, width]`` tokens with ``expand``."""
    fp8 = torch.float8_e4m3fn
    kv, _, _ = make_cache(2, 64, fp8, seed=9, device=device)
    q = rand_codes((0, 2, 32, 128), fp8, seed=10).to(device)
    w = weights((0, 2, 32), seed=11).to(device)
    lens = torch.zeros((0, 2), dtype=torch.int32, device=device)
    pt = torch.zeros((0, 2), dtype=torch.int32, device=device)
    ids = paged_pool_topk(q, kv, w, lens, pt, 16)
    assert ids.shape == (0, 16) and ids.dtype == torch.int32
    toks = paged_pool_topk(q, kv, w, lens, pt, 16, expand=(torch.zeros((0,), dtype=torch.int32, device=device), 4, 128))
    assert toks.shape == (0, 128) and toks.dtype == torch.int32

def test_validation(backend, device):
    q = torch.zeros(1, 1, 16, 128, dtype=torch.uint8, device=device)
    kv = torch.zeros(2, 64, 132, dtype=torch.uint8, device=device)
    w = torch.zeros(1, 1, 16, device=device)
    lens = torch.tensor([[10]], device=device)
    pt = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="select_k"):
        paged_pool_topk(q, kv, w, lens, pt, 0)
    with pytest.raises(ValueError, match="select_k must be at most 2147483647"):
        paged_pool_topk(q, kv, w, lens, pt, 2**40)
    with pytest.raises(ValueError, match="pool_lens"):
        paged_pool_topk(q, kv, w, torch.tensor([[200]], device=device), pt, 4)
    with pytest.raises(ValueError, match="q_fp8"):
        paged_pool_topk(q[..., :64], kv, w, lens, pt, 4)
    with pytest.raises(ValueError, match="page_table"):
        paged_pool_topk(q, kv, w, lens, torch.tensor([[0, 5]], dtype=torch.int32, device=device), 4)
    seq = torch.tensor([43], device=device)
    with pytest.raises(TypeError, match="expand"):
        paged_pool_topk(q, kv, w, lens, pt, 4, expand=[seq, 4, None])
    with pytest.raises(ValueError, match="seq_lens"):
        paged_pool_topk(q, kv, w, lens, pt, 4, expand=(seq.repeat(2), 4, None))
    with pytest.raises(TypeError, match="seq_lens"):
        paged_pool_topk(q, kv, w, lens, pt, 4, expand=(seq.float(), 4, None))
    with pytest.raises(ValueError, match="pool_size"):
        paged_pool_topk(q, kv, w, lens, pt, 4, expand=(seq, 0, None))
    with pytest.raises(ValueError, match="width"):
        paged_pool_topk(q, kv, w, lens, pt, 4, expand=(seq, 4, 18))


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("layout", ["plain", "preshuffle"])
def test_exactness_run_scoring_check(device, fp8_dtype, layout):
    """``kpool.exactness.check_scores`` (the GPU run's scoring case) at a small size: several
    leaves per row, some rows with at most ``select_k`` pools; nothing differs."""
    from kpool import exactness
    gen = torch.Generator().manual_seed(5)
    diff, total, filtered = exactness.check_scores(4, 700, 16, 16, fp8_dtype, layout, device, gen)
    assert total == 4 * 700 + 4 * 16 and diff == 0 and not filtered  # leaves of 128: exact


def test_exactness_run_reports_filtering(device, monkeypatch):
    """``check_scores`` says when the fused selection's leaves filtered (here: leaves of 128
    allowed to, 18 leaves per row at select_k 128) and the ids still match."""
    from kpool import exactness
    monkeypatch.setattr(score, "FILTER_MIN_CHUNK", 0)
    monkeypatch.delenv(score.SCORER_ENV, raising=False)
    diff, total, filtered = exactness.check_scores(2, 2304, 16, 128, torch.float8_e4m3fn, "plain", device,
                                                   torch.Generator().manual_seed(8))
    assert filtered and diff == 0 and total == 2 * 2304 + 2 * 128


def test_exactness_run_picks_ops(device, capsys):
    """``python -m kpool.exactness --ops``: ``run_checks`` runs exactly the chosen kinds, in
    order (compress at 8 pools, then the scoring cases), every one exact here; an unknown name
    is an argparse error naming ``--ops``."""
    from kpool import exactness
    lines = []
    rows, bad = exactness.run_checks(("score", "compress"), 8, 64, ((2, 600),), (16,), device,
                                     torch.Generator().manual_seed(7), log=lines.append)
    assert bad == 0 and [r["op"] for r in rows] == ["compress"] * 8 + ["score"] * 4 and len(lines) == 12
    assert all(r["differing_bytes"] == 0 for r in rows[:8]) and all(r["H"] == 16 for r in rows[8:])
    assert all(r["filtered"] is False for r in rows[8:]) and "exact leaves" in lines[-1]
    with pytest.raises(SystemExit):
        exactness.main(["--ops", "compress,bogus"])
    assert "--ops takes a comma list" in capsys.readouterr().err
    assert exactness._shape_list("32x16384, 2x32768") == ((32, 16384), (2, 32768))
    for bad_shapes in ("32", "2x0", "ax3", "2x3x4", ","):
        with pytest.raises(SystemExit):
            exactness.main(["--score-shapes", bad_shapes])
        assert "--score-shapes takes a comma list" in capsys.readouterr().err


def test_exactness_run_decode_cases(device):
    """The GPU run's decode cases (``exactness.decode_cases``: plain decode, verify steps of 4
    and of P + 1 tokens, each at a ring the writer accepts) at 3 requests: every byte exact."""
    from kpool import exactness
    rows, bad = exactness.run_checks(("decode",), 8, 3, ((2, 600),), (16,), device, torch.Generator().manual_seed(9),
                                     log=lambda line: None)
    assert bad == 0 and len(rows) == 2 * 2 * len(exactness.decode_cases(4, 3))
    assert {(r["P"], r["ring"], r["next_n"]) for r in rows} >= {(4, 4, 1), (4, 8, 5), (16, 32, 17)}


def test_exactness_run_selection_cases(device, monkeypatch):
    """``check_selection`` at a size that filters (leaves of 128 allowed to): verify rows, exact
    ties from duplicated entries, the fused expansion at a rounded width; then random cases
    through ``run_checks``. Nothing differs, and a changed id is counted."""
    import kpool
    from kpool import exactness
    monkeypatch.setattr(score, "FILTER_MIN_CHUNK", 0)
    monkeypatch.delenv(score.SCORER_ENV, raising=False)
    case = dict(requests=2, next_n=3, pools=2304, heads=16, select_k=128, dup_every=3, expand=True,
                round_width=True, fp8_dtype=torch.float8_e4m3fn, layout="plain")
    gen = torch.Generator().manual_seed(9)
    diff, total, filtered = exactness.check_selection(case, device, gen)
    assert filtered and diff == 0 and total == 6 * 128 + 6 * 640
    lines = []
    rows, bad = exactness.run_checks(("select",), 8, 64, ((2, 600),), (16,), device, torch.Generator().manual_seed(3),
                                     log=lines.append, select_cases=3, select_size=1500)
    assert bad == 0 and [r["op"] for r in rows] == ["select"] * 3 and len(lines) == 3
    real = kpool.paged_pool_topk

    def off_by_one(*args, **kw):
        ids = real(*args, **kw)
        ids[-1, 0] += 1
        return ids

    monkeypatch.setattr(kpool, "paged_pool_topk", off_by_one)
    case.update(expand=False, pools=300)
    assert exactness.check_selection(case, device, gen)[0] == 1


def test_exactness_run_scoring_check_counts_differences(device, monkeypatch):
    """The check is not vacuous: a selection with one id changed is one differing value."""
    import kpool
    from kpool import exactness
    real = kpool.paged_pool_topk

    def off_by_one(*args, **kw):
        ids = real(*args, **kw)
        ids[0, 0] += 1
        return ids

    monkeypatch.setattr(kpool, "paged_pool_topk", off_by_one)
    gen = torch.Generator().manual_seed(6)
    diff, _, _ = exactness.check_scores(2, 300, 16, 16, torch.float8_e4m3fn, "plain", device, gen)
    assert diff == 1


# --------------------------------------------------------------------------------------------
# filter and refine (score.filters): approximate leaves, exact rescoring of the survivors
# --------------------------------------------------------------------------------------------

# leaves of 128 pools that keep all their keys (select_k 128), up to 18 per row; row lengths:
# two long rows (bound rank at most HEAD), a short one whose bound rank exceeds POSITION_KEYS
# (every pool survives), padding, one of 5 full leaves (rank 26: their position keys bound it),
# one at select_k
FILTER_CASE = dict(batch=2, next_n=3, page=64, pages_per=36, select_k=128,
                   lens=[2304, 2303, 200, 0, 700, 128])


@pytest.fixture
def filter_choices(monkeypatch):
    """Whether each leaf launch of several leaves filters (``score.wide_plan``'s FILTER:
    ``exactness.filter_decisions``); leaves of any size may filter (the CPU lanes and small GPU
    cases use leaves of 128 pools, below ``FILTER_MIN_CHUNK``)."""
    from kpool import exactness
    monkeypatch.setattr(score, "FILTER_MIN_CHUNK", 0)
    with exactness.filter_decisions() as used:
        yield used


@pytest.mark.parametrize("heads, fp8_dtype, layout, next_n", [(16, FP8[0], "plain", 3), (32, FP8[1], "preshuffle", 3),
                                                              (64, FP8[0], "plain", 3), (64, FP8[1], "plain", 1)])
def test_filter_selects_exactly(device, heads, fp8_dtype, layout, next_n, monkeypatch, filter_choices):
    """Long rows are filtered (one fp16 MMA per tile, lower and upper keys) and their survivors
    rescored exactly: the same ids as the exact reference, with a bad page and NaN key codes
    (NaN: always a survivor, ranked last) and pages repeated across leaves (exact ties); four
    query rows per program and one (64 heads: ``score.max_regs``' own cap on CUDA)."""
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    monkeypatch.setenv(score.SCORER_ENV, "filter")
    used = filter_choices
    run_case(device, heads=heads, fp8_dtype=fp8_dtype, layout=layout, seed=heads + next_n, bad_page=True,
             duplicate=True, nan_codes=True, **dict(FILTER_CASE, batch=6 // next_n, next_n=next_n))
    assert used == [True] * 2  # ids, then tokens


def test_filter_bounds_hold_under_the_whole_error_budget(device, monkeypatch, filter_choices):
    """With a budget of 1/8 of each head's dot magnitude and every approximate logit moved by
    0.9 of its bound (``FILTER_SHAKE``), the selection is still exact: the row bound comes from
    lower keys, every pool whose upper key reaches it is rescored. A filter that took the bound
    from upper keys, or bounds without the margin, fails here."""
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    monkeypatch.setenv(score.SCORER_ENV, "filter")
    monkeypatch.setattr(score, "FILTER_ERROR", 2.0**-3)
    monkeypatch.setattr(score, "FILTER_SHAKE", 0.9)
    used = filter_choices
    for seed in (21, 22):
        run_case(device, heads=16, fp8_dtype=FP8[0], seed=seed, **FILTER_CASE)
    assert used == [True] * 4  # two cases, ids and tokens each


def test_filter_bounds_with_unusual_key_scales_and_weights(device, monkeypatch, filter_choices):
    """Entries the writers never store and rows of absurdly small weights still select exactly:
    a key scale that is negative, above 2^32 or below 2^-32 makes the pool a survivor
    (``approx_block_logits`` sums a pool's heads before scaling them, which such scales would
    take out of the error budget; row 0: filtering them like other pools picks wrong ids), and
    so does every pool of a row whose error scale is under 2^-80 (row 1: subnormal weights, where
    fp32 underflow, not the MMA, sets the error; its selection is then the exact one of all pools)."""
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    monkeypatch.setenv(score.SCORER_ENV, "filter")
    used = filter_choices
    fp8, page, n_pools, select_k = FP8[0], 64, 384, 128
    g = torch.Generator().manual_seed(0)
    kv = torch.zeros(2 * n_pools // page, page, 132, dtype=torch.uint8)
    scales = torch.full((2 * n_pools,), 2.0**-8)
    scales[::5] *= -1
    scales[1::7], scales[2::7] = 2.0**40, 2.0**-40
    write_entries(kv, torch.arange(2 * n_pools),
                  (torch.randn(2 * n_pools, 128, generator=g) * 8).to(fp8).view(torch.uint8), scales, "plain")
    q = (torch.randn(2, 1, 16, 128, generator=g) * 8).to(fp8)
    w = torch.rand(2, 1, 16, generator=g)  # row 0: a negative scale's pool scores relu(-dot), often among the best
    w[1] *= 2.0**-146  # row 1: subnormal weights, the logits a few units of 2^-149
    pt = torch.randperm(2 * n_pools // page, generator=g).view(2, -1).int()
    lens = torch.tensor([[n_pools], [n_pools]], dtype=torch.int32)
    args = [t.to(device) for t in (q, kv, w, lens, pt)]
    got = paged_pool_topk(*args, select_k, layout="plain").cpu()
    logits = reference.paged_pool_logits(q.view(torch.uint8), kv, w, lens, pt, "plain", fp8, n_pools)
    assert used == [True] and torch.equal(got, reference.select_pools(logits, lens.view(-1), select_k))


def test_filter_rows_whose_error_bound_underflows_keep_every_pool(device, monkeypatch, filter_choices):
    """A row whose error scale is under 2^-80 keeps every pool (``logits.logit_error_scale``'s
    guard): here ``e * kscale`` underflows to 0 in fp32 while the approximate logits are ~150
    units of 2^-149, whose roundings (one after the head sum) differ from the exact ones (one
    per head) by a few units, so bounds without a margin would drop pools of the exact selection
    (13 ids differ with the guard removed)."""
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    monkeypatch.setenv(score.SCORER_ENV, "filter")
    used = filter_choices
    fp8, page, n_pools, select_k, kscale = FP8[0], 64, 2048, 128, 2.0**-30
    g = torch.Generator().manual_seed(1)
    kv = torch.zeros(2 * n_pools // page, page, 132, dtype=torch.uint8)
    codes = (torch.randn(2 * n_pools, 128, generator=g) * 200).clamp(-448, 448).to(fp8).view(torch.uint8)
    write_entries(kv, torch.arange(2 * n_pools), codes, torch.full((2 * n_pools,), kscale), "plain")
    q = (torch.randn(2, 1, 16, 128, generator=g) * 8).to(fp8)
    w = torch.rand(2, 1, 16, generator=g) * 2.0**-129
    pt = torch.randperm(2 * n_pools // page, generator=g).view(2, -1).int()
    lens = torch.tensor([[n_pools], [n_pools]], dtype=torch.int32)
    err = (w * q.float().abs().sum(-1)).sum(-1) * (fp8_max(fp8) * score.FILTER_ERROR)
    assert bool((err < 2.0**-80).all()) and bool((err * kscale == 0).all())  # the margin underflows
    got = paged_pool_topk(*[t.to(device) for t in (q, kv, w, lens, pt)], select_k, layout="plain").cpu()
    logits = reference.paged_pool_logits(q.view(torch.uint8), kv, w, lens, pt, "plain", fp8, n_pools)
    assert logits.max() > 100 * 2.0**-149  # the approximate logits do not underflow
    assert used == [True] and torch.equal(got, reference.select_pools(logits, lens.view(-1), select_k))


@pytest.mark.parametrize("heads_in", ["registers", "streamed", "wide leaves", "short rows"])
def test_filter_survivors_reach_the_union_of_the_leaf_heads(device, monkeypatch, filter_choices, heads_in):
    """A filtered row's survivors are exactly its pools whose upper bound (the leaves' int32
    codes, ids from the list positions) reaches its bound: a key at most the ``select_k``-th
    best of the ``HEAD`` lower keys all its wholly visible leaves wrote and above the next one
    (``_union_bound_kernel``'s radix stops at the floor of the bucket that holds exactly the
    keys still needed; its heads held in registers, or streamed 64 at a time; or of leaves of
    2 x KB pools, ``score.wide_plan``); of their ``POSITION_KEYS`` position keys when the bound
    rank exceeds ``HEAD``; a row whose bound rank exceeds ``POSITION_KEYS`` keeps every visible
    pool. Each leaf's heads (``store_leaf_bounds``) are sorted, from pools of the leaf at
    distinct tile positions, each at or below the pool's exact key; its position keys are one
    per tile position. Short rows: 7 lists, rows bounded by their position keys on registers
    (filling over half the 8 lists' tile: 7, 6 and 5 full leaves) or streamed (4)."""
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    monkeypatch.setenv(score.SCORER_ENV, "filter")
    case = dict(FILTER_CASE, pages_per=14, lens=[896, 895, 640, 520, 0, 128]) if heads_in == "short rows" else FILTER_CASE
    if heads_in == "streamed":
        monkeypatch.setattr(topk, "UNION_RESIDENT_KEYS", 0)
        monkeypatch.setattr(topk, "SELECT_BLOCK", 64)
    if heads_in == "wide leaves":  # as on a GPU of one SM, with leaves of KB = 128 planned and doubled
        monkeypatch.setattr(topk, "_sm_count", lambda device: 1)
        monkeypatch.setattr(topk, "LEAF_BASE", 0)
        monkeypatch.setattr(score, "FILTER_WIDE_HEADS", 1)
    seen = []
    real = topk.survivors

    def spy(cand, count, chunk, lens, n_cols, select_k, filtered=False):
        surv = real(cand, count, chunk, lens, n_cols, select_k, filtered)
        seen.append((cand.clone().cpu(), count.clone().cpu(), surv.clone().cpu(), chunk, lens.cpu(), n_cols, select_k,
                     filtered))
        return surv

    monkeypatch.setattr(topk, "survivors", spy)
    _, logits = run_case(device, heads=16, fp8_dtype=FP8[0], seed=23, bad_page=True, nan_codes=True, **case)
    exact = reference.pool_order_keys(logits)
    cand, count, surv, chunk, lens, n_cols, select_k, filtered = seen[0]  # the fused scorer's, not the check's
    wide = heads_in == "wide leaves"
    assert filtered and filter_choices == [True] * 2 and chunk == 128 * (1 + wide)  # ids, tokens
    head, no_upper, no_key = (int(getattr(c, "value", c)) for c in (topk.HEAD, topk.NO_UPPER, topk.NO_KEY))
    pk = topk.POSITION_KEYS
    assert cand.shape[2] == topk.list_size(chunk, topk.key_block(select_k), True)
    codes = cand.view(torch.int32)[..., 2 * (head + pk): 2 * (head + pk) + chunk].to(torch.int64)  # [rows, lists, chunk]
    ids = torch.arange(codes.shape[1] * chunk).view(codes.shape[1], chunk)
    upper = torch.where(codes == no_upper, no_key, codes * 2**32 + (2**32 - 1 - ids))
    checked = []
    for r, vis in enumerate(lens.clamp(0, n_cols).tolist()):
        if vis <= select_k:
            continue
        full = vis // chunk
        rank = -(-select_k // max(full, 1))
        keys = upper[r].flatten()[:vis]
        if rank <= pk and full * pk >= select_k:
            n = head if rank <= head else pk
            heads = cand[r, :full, :head] if rank <= head else cand[r, :full, head:head + pk]
            if rank <= head:
                assert torch.equal(heads, heads.sort(dim=1, descending=True).values), f"row {r}"
            pools = 2**32 - 1 - (heads & (2**32 - 1))
            assert torch.equal(pools // chunk, torch.arange(full)[:, None].expand(-1, n)), f"row {r}"
            tile_pos = (pools % score.BLOCK_POOLS).sort(dim=1).values
            assert (tile_pos[:, 1:] > tile_pos[:, :-1]).all(), f"row {r}"  # all positions, for the position keys
            assert (heads <= exact[r, pools]).all(), f"row {r}"
            best = heads.flatten().sort(descending=True).values
            low = best[select_k] if best.numel() > select_k else no_key  # the radix bound: in (low, best[k - 1]]
            checked.append("heads" if rank <= head else "positions")
        else:
            best, low = None, no_key  # every visible pool survives
        kept = surv[r, :int(count[r])]
        assert kept.unique().numel() == kept.numel(), f"row {r}"
        floor = int(kept.min()) if best is not None else no_key + 1
        assert set(kept.tolist()) == set(keys[keys >= floor].tolist()) and floor > low, f"row {r}"
        if best is not None:  # with the pools of the select_k best heads (their upper keys are above them)
            assert set(keys[keys >= best[select_k - 1]].tolist()) <= set(kept.tolist()), f"row {r}"
    # rows of 18, 17 and 5 full leaves (rank 8, 8, 26), and 1 (rank 128: every pool survives);
    # wide: 9, 8 and 2 (rank 15, 16, 64), and none; short rows: 7, 6, 5, 4 (rank 19-32) and 1
    assert checked == ["positions"] * 4 if heads_in == "short rows" else ["heads", "heads", "positions"]


def test_wide_plan_doubles_filtering_leaves_of_long_rows(monkeypatch):
    """On a GPU of 132 SMs at select_k 512: 128 rows of 262,144 pools (256 leaves of 1,024, 8 x
    select_k heads) get leaves of 2 x KB; 32 rows of 32,768 (32 x 16 heads = select_k) keep
    KB; so does every row under the exact scorer."""
    monkeypatch.setattr(topk, "_sm_count", lambda device: 132)
    monkeypatch.delenv(score.SCORER_ENV, raising=False)
    assert score.wide_plan(128, 262144, 512, "cuda") == (1024, 256, True)
    assert score.wide_plan(32, 32768, 512, "cuda") == (512, 64, True)
    monkeypatch.setenv(score.SCORER_ENV, "exact")
    assert score.wide_plan(128, 262144, 512, "cuda") == (512, 512, False)


def test_wide_plan_doubles_exact_leaves_of_few_long_rows(monkeypatch):
    """On a GPU of 132 SMs at select_k 512, grids planned as exact leaves of 128 pools whose rows
    hold more of them than one uncapped wave (2 x 132): long enough for filtering leaves of 256
    with a bound rank of at most FILTER_SMALL_RANK, they get those (2 x 128K tokens, a 2-row
    verify step, 1 x 256K, 4 x 64K); at higher ranks (8 x 32K: 16, 16 x 16K: 32, 32 x 8K, 64 x
    4K) and under the exact scorer, exact leaves of 256 in one wave. One wave (1 x 128K, 2 x 64K)
    keeps its leaves of 128, and so does a grid whose doubled leaves would take two waves (where
    plan_leaves aims at 4 programs per SM: 12 x 32K doubled is 384 programs) or would not keep
    all their keys (select_k 128)."""
    monkeypatch.setattr(topk, "_sm_count", lambda device: 132)
    monkeypatch.delenv(score.SCORER_ENV, raising=False)
    for rows, n_cols in ((2, 32768), (1, 65536), (4, 16384)):
        assert score.wide_plan(rows, n_cols, 512, "cuda") == (256, n_cols // 256, True), (rows, n_cols)
    for rows, n_cols in ((8, 8192), (16, 4096), (32, 2048), (64, 1024)):
        assert score.wide_plan(rows, n_cols, 512, "cuda") == (256, n_cols // 256, False), (rows, n_cols)
    for rows, n_cols in ((1, 32768), (2, 16384)):
        assert score.wide_plan(rows, n_cols, 512, "cuda") == (128, n_cols // 128, False), (rows, n_cols)
    assert score.filters(256, 512, 32, 8192, 512)  # 8 x 32K could filter: the rank rule keeps it exact
    monkeypatch.setattr(score, "FILTER_SMALL_RANK", 16)
    assert score.wide_plan(8, 8192, 512, "cuda") == (256, 32, True)
    monkeypatch.setenv(score.SCORER_ENV, "exact")
    assert score.wide_plan(2, 32768, 512, "cuda") == (256, 128, False)
    # counted in leaf programs (groups): a verify step of 16 x 8K tokens x 2 rows, 2 rows a program,
    # already fits one wave of leaves of 128 (16 x 16 programs); 8 x 10K x 3 (2 groups a request)
    # takes two (16 x 20), so its leaves are doubled
    assert score.wide_plan(32, 2048, 512, "cuda", groups=16) == (128, 16, False)
    assert score.wide_plan(24, 2560, 512, "cuda", groups=16) == (256, 10, False)
    monkeypatch.setattr(topk, "PROGRAMS_PER_SM", 4)
    assert score.wide_plan(8, 8192, 512, "cuda") == (256, 32, False)
    assert score.wide_plan(12, 8192, 512, "cuda") == (128, 64, False)
    assert score.wide_plan(8, 8192, 128, "cuda") == (128, 64, False)


def test_wide_plan_keeps_small_grids_of_loose_bounds_exact(monkeypatch):
    """On a GPU of 132 SMs at select_k 512, filtering leaves of 256 (under KB) in a grid of at
    most FILTER_UNCAPPED_PER_SM programs per SM filter only at a bound rank of at most
    FILTER_SMALL_RANK, FILTER_SMALL_RANK_ROWS1 for one-row programs: verify steps of 32 x 8K, 16 x
    16K and 8 x 32K x 2 (2 rows a program: 256 programs; rank 64, 32, 16) and 64 x 8K tokens (8
    leaves: rank 64) go exact, decode steps of 16 x 32K and 32 x 16K (rank 16, 32) keep filtering.
    Leaves of KB keep filtering (8 x 64K x 2, 16 x 32K x 2, rank 16), and so do long rows (1 x 128K
    x 2: leaves of 256 at rank 4; 4 x 128K x 2: of 512 at rank 8) and large grids (128 x 16K: 2,048
    programs at rank 32; a prefill chunk of 8,192 rows)."""
    monkeypatch.setattr(topk, "_sm_count", lambda device: 132)
    monkeypatch.delenv(score.SCORER_ENV, raising=False)
    assert score.filters(256, 512, 8, 2048, 512)  # the launch rule alone would filter these
    assert score.wide_plan(64, 2048, 512, "cuda") == (256, 8, False)
    assert score.wide_plan(16, 8192, 512, "cuda") == (256, 32, True)
    assert score.wide_plan(32, 4096, 512, "cuda") == (256, 16, True)
    for batch, n_cols in ((32, 2048), (16, 4096), (8, 8192)):
        plan = score.wide_plan(2 * batch, n_cols, 512, "cuda", groups=batch)
        assert plan == (256, n_cols // 256, False), (batch, n_cols)
    for batch, n_cols in ((8, 16384), (16, 8192)):
        assert score.wide_plan(2 * batch, n_cols, 512, "cuda", groups=batch) == (512, n_cols // 512, True)
    assert score.wide_plan(2, 32768, 512, "cuda", groups=1) == (256, 128, True)
    assert score.wide_plan(8, 32768, 512, "cuda", groups=4) == (512, 64, True)
    assert score.wide_plan(128, 4096, 512, "cuda") == (256, 16, True)
    assert score.wide_plan(8192, 4096, 512, "cuda", groups=4096) == (256, 16, True)
    monkeypatch.setattr(score, "FILTER_SMALL_RANK_ROWS1", 16)
    assert score.wide_plan(16, 8192, 512, "cuda") == (256, 32, True)
    assert score.wide_plan(32, 4096, 512, "cuda") == (256, 16, False)
    monkeypatch.setattr(score, "FILTER_SMALL_RANK_ROWS1", 64)
    assert score.wide_plan(64, 2048, 512, "cuda") == (256, 8, True)
    assert score.wide_plan(64, 2048, 512, "cuda", groups=32) == (256, 8, False)  # 2 rows a program
    monkeypatch.setattr(score, "FILTER_SMALL_RANK", 64)
    assert score.wide_plan(64, 2048, 512, "cuda", groups=32) == (256, 8, True)


def test_wide_plan_splits_exact_leaves_of_short_grids(monkeypatch):
    """On a GPU of 132 SMs at select_k 512 and up to 32 heads, exact leaves of 512 whose grid is
    under EXACT_PROGRAMS_PER_SM (4) programs per SM become leaves of 256 (decode 128 x 8K, 256 x
    4K; verify 64 x 8K x 2, 32 x 8K x 3 and x 4, rows counted as ``plan_leaves`` counts them); at
    64 heads only where the split grid's query-row groups x leaves hold at most
    EXACT_WIDE_HEADS_PER_SM (4) programs per SM (the verify steps, not 128 x 8K's 1,024); for
    filtering plans, one-leaf plans, leaves of 256 already and grids that hold 4 per SM, the plan
    is ``shaped_plan``'s; leaves over KB (select_k 64) are not split."""
    monkeypatch.setattr(topk, "_sm_count", lambda device: 132)
    monkeypatch.delenv(score.SCORER_ENV, raising=False)
    for rows, n_cols, groups in ((128, 2048, 128), (256, 1024, 256), (128, 2048, 64), (96, 2048, 64),
                                 (128, 2048, 32)):
        assert score.shaped_plan(rows, n_cols, 512, "cuda", groups) == (512, n_cols // 512, False)
        for heads in (16, 32):
            assert score.wide_plan(rows, n_cols, 512, "cuda", groups, heads) == (256, n_cols // 256, False)
        split = groups * (n_cols // 256) <= 4 * 132  # 64 heads: (128, 2048, 64) and (128, 2048, 32)
        assert score.wide_plan(rows, n_cols, 512, "cuda", groups, 64) == ((256, n_cols // 256, False) if split
                                                                         else (512, n_cols // 512, False))
    assert [score.wide_plan(128, 2048, 512, "cuda", g, 64)[0] for g in (128, 67, 66, 64)] == [512, 512, 256, 256]
    monkeypatch.setattr(score, "EXACT_WIDE_HEADS_PER_SM", 0)
    assert score.wide_plan(128, 2048, 512, "cuda", 32, 64) == (512, 4, False)
    monkeypatch.setattr(score, "EXACT_WIDE_HEADS_PER_SM", 4)
    for args in ((64, 2048, 512, "cuda"), (16, 8192, 512, "cuda"), (300, 512, 512, "cuda"),
                 (1024, 2048, 512, "cuda"), (128, 8192, 64, "cuda")):
        assert score.wide_plan(*args) == score.shaped_plan(*args), args
    assert score.shaped_plan(64, 2048, 512, "cuda") == (256, 8, False)  # already 256
    assert score.shaped_plan(16, 8192, 512, "cuda")[2]  # filtering
    assert score.shaped_plan(300, 512, 512, "cuda") == (512, 1, False)  # one leaf, which 4 per SM would split
    assert score.shaped_plan(1024, 2048, 512, "cuda") == (512, 4, False)  # already 4,096 programs
    assert score.shaped_plan(128, 8192, 64, "cuda") == (512, 16, False)  # exact leaves over KB = 64
    monkeypatch.setattr(score, "EXACT_MIN_CHUNK", 512)
    assert score.wide_plan(128, 2048, 512, "cuda") == (512, 4, False)


def test_wide_plan_halves_filtering_leaves_of_rows_with_few(monkeypatch):
    """On a GPU of 132 SMs at select_k 512, a prefill chunk of 8,192 rows: leaves of 512 are
    halved to 256 while the longest row has 8-12 of them (their position keys, 64 each, at
    most 1.5 x select_k); 13 and more keep 512; rows of 4 leaves do not filter and keep 512;
    so does every row under the exact scorer."""
    monkeypatch.setattr(topk, "_sm_count", lambda device: 132)
    monkeypatch.delenv(score.SCORER_ENV, raising=False)
    for n_cols in (4096, 4608, 6143, 6144, 6655):
        assert score.wide_plan(8192, n_cols, 512, "cuda") == (256, -(-n_cols // 256), True), n_cols
    for n_cols in (2048, 6656, 8192):
        assert score.wide_plan(8192, n_cols, 512, "cuda")[:2] == (512, -(-n_cols // 512)), n_cols
    monkeypatch.setenv(score.SCORER_ENV, "exact")
    assert score.wide_plan(8192, 4096, 512, "cuda") == (512, 8, False)
    # halving stops at the smallest leaf plan_leaves makes (one tile), whatever FILTER_MIN_CHUNK and
    # MIN_CHUNK say (at 0 and 16 a 76-pool verify grid at select_k 64 went to leaves of 32: no tile)
    monkeypatch.setenv(score.SCORER_ENV, "filter")
    monkeypatch.setattr(topk, "_sm_count", lambda device: 1)
    monkeypatch.setattr(score, "FILTER_MIN_CHUNK", 0)
    monkeypatch.setattr(topk, "MIN_CHUNK", 16)
    monkeypatch.setattr(topk, "LEAF_BASE", 0)
    assert score.wide_plan(6, 76, 64, "cuda") == (score.BLOCK_POOLS, 2, True)


def test_scorer_switch(device, monkeypatch, filter_choices):
    """``$KPOOL_SCORER``: filter by default (and when set so), exact on request, else an error."""
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    monkeypatch.delenv(score.SCORER_ENV, raising=False)
    used = filter_choices
    run_case(device, heads=16, fp8_dtype=FP8[0], seed=22, **FILTER_CASE)
    monkeypatch.setenv(score.SCORER_ENV, "exact")
    run_case(device, heads=16, fp8_dtype=FP8[0], seed=22, **FILTER_CASE)
    assert used == [True, True, False, False]  # ids and tokens of each
    monkeypatch.setenv(score.SCORER_ENV, "fast")
    with pytest.raises(ValueError, match=score.SCORER_ENV):
        score.scorer()


@pytest.mark.parametrize("chunk, n_chunks, n_cols, scorer, want", [
    (512, 64, 32768, "filter", True),      # 32 x 128K at select 512: leaves of 512
    (256, 128, 32768, "filter", True),
    (128, 256, 32768, "filter", False),    # 1 x 128K: leaves of 128 (slower filtered on the H200)
    (512, 16, 8192, "filter", True),       # 32 x 32K: 16 leaves, bound rank 32 (the position keys bound it)
    (512, 8, 4096, "filter", True),        # 8 leaves: bound rank 64 = POSITION_KEYS
    (512, 8, 4095, "filter", False),       # 7 full leaves: bound rank 74
    (512, 64, 32768, "exact", False),
    (1024, 32, 32768, "filter", False),    # leaves beyond KB drop keys: no bounds for them
])
def test_filter_rule(chunk, n_chunks, n_cols, scorer, want, monkeypatch):
    """Which leaf launches filter (``score.filters``) at select_k 512 (KB 512)."""
    monkeypatch.setenv(score.SCORER_ENV, scorer)
    assert score.filters(chunk, topk.key_block(512), n_chunks, n_cols, 512) is want
