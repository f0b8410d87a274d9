"""Decode / speculative-verify update under CUDA-graph replay.

Every request sits at a random position ``pos0`` and sends ``next_n`` tokens
``pos0 .. pos0 + next_n - 1``; its tail block is a random one of ``B`` blocks, its tail
slots ``block*RING + pos % RING``; ``slot_mapping`` holds a random free cache slot on the
tokens that complete a pool (``(pos + 1) % P == 0``) and -1 elsewhere (int32 mappings, as
the seed documents).

* ``ours``: the smallest ring ours accepts for the step, ``layout.ring_size(P, next_n - 1)``
  (``RING >= P + next_n - 1`` keeps the entries a redo after rejected drafts needs): RING = P
  at next_n = 1, 2P at next_n = 2 and 4 (P = 4 and 16). ``metadata_ready=True``: the step's
  index tensors are built before timing, as an engine builds them at the step's start (and
  ``KPoolCache`` passes it); under PDL the kernel loads them before its wait.
* ``seed``: RING = P at every next_n (the seed's kernel requires ``tail.shape[2] == P``).
* ``ours_ring2P``: ours with RING = 2P (room for speculative drafts; what ``KPoolCache``
  allocates for up to P drafts); compared with the seed at RING = P. Run only where it differs
  from ``ours``'s ring (next_n = 1): at next_n = 2 and 4 ``ours`` already runs at 2P.
* ``torch``: ``kpool.reference.decode_update`` is a per-token Python loop with host syncs;
  it is timed at batch 1 only (eager events), and not graph-captured. Same ring as ``ours``.
* ``movement``: a reference point, not an implementation: the step's data movement without
  any pool work (each token's key and gate rows and its three mappings read, the rows
  stored at their ring slots; no completion, no cache write), one program per request.
  What ``ours`` costs above it is the completions (ring reads, pooling, encode, entry
  writes). Same ring as ``ours``; its bytes are the ones it moves.

``$KPOOL_BENCH_DECODE_STEPS`` adds cases to every mode's, as comma-separated ``P:B:NEXT_N``, e.g.
``KPOOL_BENCH_DECODE_STEPS=4:8:1,16:8:1`` for batches between the grid's (for ``benchmarks/ab.py``).

Bytes: per token its key + gate read (512 B), three int32 mappings, its ring stash
written (512 B); per completing token one 132-byte entry written plus the ring entries
its pool reads from before the step (512 B each); ``ape`` once. Computed from set 0.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kpool.layout import cdiv, next_pow2, ring_size
from kpool.ops import _pdl

OP = "decode"
TITLE = "decode / verify update (graph replay)"
PAGE = 64
HEAD = 128
FP8 = torch.float8_e4m3fn
_HEAD = tl.constexpr(HEAD)  # for @triton.jit code (a plain global is rejected by the compiler)
TORCH_MAX_BATCH = 1
CHECK_MAX_BATCH = 64
EXTRA_STEPS = os.environ.get("KPOOL_BENCH_DECODE_STEPS", "")  # module docstring


def cases(mode):
    if mode == "dry":
        grid = [(b, nn, p) for p in (4, 16) for b, nn in ((1, 1), (3, 3))]
    elif mode == "quick":
        grid = [(b, nn, p) for p in (4, 16) for b in (1, 1024) for nn in (1, 4)]
    else:
        grid = [(b, nn, p) for p in (4, 16) for b in (1, 64, 256, 1024) for nn in (1, 2, 4)]
    grid += [(b, nn, p) for p, b, nn in extra_steps(EXTRA_STEPS)]
    return [{"label": f"P={p} B={b} next_n={nn}", "P": p, "batch": b, "next_n": nn, "page": PAGE}
            for b, nn, p in grid]


def extra_steps(spec: str) -> list:
    """``(P, B, NEXT_N)`` of each ``P:B:NEXT_N`` in the comma-separated ``spec``."""
    out = []
    for item in filter(None, (t.strip() for t in spec.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts) or int(parts[0]) not in (4, 16):
            raise ValueError(f"KPOOL_BENCH_DECODE_STEPS takes P:B:NEXT_N items (P 4 or 16, positive ints), "
                             f"got {item!r}")
        out.append(tuple(int(x) for x in parts))
    return out


def impls(case):
    p, nn = case["P"], case["next_n"]
    out = ["ours"] + (["ours_ring2P"] if ring_size(p, nn - 1) != 2 * p else []) + ["seed", "movement"]
    if case["batch"] <= TORCH_MAX_BATCH:
        out.append("torch")
    return out


def targets(case):
    t = [{"impl": i, "kind": "max_vs_seed", "value": 1.0, "text": "<= seed"} for i in impls(case) if i.startswith("ours")]
    if case["batch"] == 1024 and case["next_n"] == 4:
        t.append({"impl": "ours", "kind": "max_us", "value": 3.0, "text": "<= 3 us"})
    return t


def make_inputs(ctx, b, nn, p, ring, i):
    base = 7919 * i + 31 * p + nn
    dev = ctx.device
    pos0 = ctx.randint(4 * p, 1 << 20, (b,), base + 1)
    positions = pos0[:, None] + torch.arange(nn, device=dev)
    blocks = ctx.randperm(b, base + 2)
    tslot = blocks[:, None] * ring + positions % ring
    complete = (positions + 1) % p == 0
    num_pages = cdiv(b * nn, PAGE) + 1
    slots = ctx.randperm(num_pages * PAGE, base + 3)[: b * nn].view(b, nn)
    slot_mapping = torch.where(complete, slots, -1)
    return (ctx.rand_bytes((num_pages, PAGE, HEAD + 4), base + 4),
            ctx.randn((b, 2, ring, HEAD), base + 5),
            tslot.to(torch.int32),
            ctx.randn((b, nn, HEAD), base + 6),
            ctx.randn((b, nn, HEAD), base + 7),
            ctx.randn((p, HEAD), base + 8, dtype=torch.float32, scale=0.5),
            slot_mapping.to(torch.int32),
            positions.to(torch.int32))


def count_bytes(inputs, p):
    positions, slot_mapping = inputs[7].to(torch.int64).cpu(), inputs[6].cpu()
    b, nn = positions.shape
    complete = (slot_mapping >= 0) & ((positions + 1) % p == 0)
    pos0 = positions[:, :1]
    ring_reads = (pos0 - (positions - (p - 1))).clamp(0, p - 1)
    n_done = int(complete.sum())
    n_ring = int(ring_reads[complete].sum())
    return b * nn * (2 * 2 * HEAD * 2 + 12) + n_done * (HEAD + 4) + n_ring * 4 * HEAD + p * HEAD * 4, n_done


@triton.jit
def _movement_kernel(tail_ptr, tail_block_stride, tail_head, ts_ptr, loc_ptr, pos_ptr, key_ptr, g_ptr, next_n,
                     NB: tl.constexpr, RING: tl.constexpr, PDL: tl.constexpr):
    # One program per request: its tokens' mappings and rows in, the rows to ring slot
    # pos % RING of block ts // RING out (where ts, pos >= 0). The pool slot is read as ours
    # reads it; only a slot below -1 (none in these inputs) would skip a token.
    _pdl.grid_dependency_sync(PDL)
    j = tl.arange(0, NB)
    live = j < next_n
    row = tl.program_id(0).to(tl.int64) * next_n + j
    ts = tl.load(ts_ptr + row, mask=live, other=-1).to(tl.int64)
    loc = tl.load(loc_ptr + row, mask=live, other=-1)
    pos = tl.load(pos_ptr + row, mask=live, other=-1).to(tl.int64)
    d = tl.arange(0, _HEAD)
    k = tl.load(key_ptr + row[:, None] * _HEAD + d[None, :], mask=live[:, None], other=0.0)
    g = tl.load(g_ptr + row[:, None] * _HEAD + d[None, :], mask=live[:, None], other=0.0)
    ok = (live & (ts >= 0) & (pos >= 0) & (loc >= -1))[:, None]
    dst = tail_ptr + (tl.maximum(ts, 0) // RING) * tail_block_stride + (tl.maximum(pos, 0) % RING) * _HEAD
    tl.store(dst[:, None] + d[None, :], k, mask=ok)
    tl.store((dst + tail_head)[:, None] + d[None, :], g, mask=ok)


def movement(kv_cache, tail, tslot, key, gate, ape, slot_mapping, positions, p):
    """``movement``: the data movement of a step without pool work (module doc); the
    arguments of ``kpool_decode_update_and_maybe_write_cache_batched`` (``key``/``gate``
    contiguous, as ``make_inputs`` builds them)."""
    from kpool._backend import backend_for, pdl_launch
    b, nn = positions.shape
    ring = tail.shape[2]
    if backend_for(key.device) == "torch":
        ts, pos = tslot.reshape(-1).long(), positions.reshape(-1).long()
        ok = (ts >= 0) & (pos >= 0) & (slot_mapping.reshape(-1) >= -1)
        blk, at = (ts // ring)[ok], (pos % ring)[ok]
        tail[blk, 0, at] = key.reshape(-1, HEAD)[ok]
        tail[blk, 1, at] = gate.reshape(-1, HEAD)[ok]
        return
    _movement_kernel[(b,)](tail, tail.stride(0), tail.stride(1), tslot, slot_mapping, positions, key, gate, nn,
                           NB=next_pow2(nn), RING=ring, num_warps=1, **pdl_launch(key.device))


def bench(ctx, case, impl):
    import kpool
    from kpool import reference
    p, b, nn = case["P"], case["batch"], case["next_n"]
    ring = {"ours_ring2P": 2 * p, "seed": p}.get(impl, ring_size(p, nn - 1))
    if impl in ("ours", "ours_ring2P"):
        def fn(*a):
            kpool.kpool_decode_update_and_maybe_write_cache_batched(*a, p, layout="plain", fp8_dtype=FP8,
                                                                    metadata_ready=True)
    elif impl == "seed":
        seed = ctx.require_seed()

        def fn(*a):
            seed.kpool_decode_update_and_maybe_write_cache_batched(*a, p)
    elif impl == "torch":
        def fn(*a):
            reference.decode_update(*a, p, FP8, "plain")
    elif impl == "movement":
        def fn(*a):
            movement(*a, p)
    else:
        raise ValueError(impl)
    extra = {"ring": ring, "layout": "preshuffle" if impl == "seed" else "plain"}
    if impl == "torch":
        extra["note"] = "per-token python loop reference, eager; timed at small batch only"
    if impl.startswith("ours") and ctx.check and (b <= CHECK_MAX_BATCH or ctx.mode == "dry"):
        a = make_inputs(ctx, b, nn, p, ring, 99)
        ref = ctx.cpu(*a)
        fn(*a)
        reference.decode_update(*ref, p, FP8, "plain")
        dk, dt = int((a[0].cpu() != ref[0]).sum()), int((a[1].cpu() != ref[1]).sum())
        extra.update(exact=dk == 0 and dt == 0,
                     exact_note=f"cache and ring vs the torch reference on the CPU: {dk} cache bytes, "
                                f"{dt} ring elements differ")
    first = make_inputs(ctx, b, nn, p, ring, 0)
    nbytes, n_done = count_bytes(first, p)
    if impl == "movement":
        nbytes, n_done = b * nn * (2 * 2 * HEAD * 2 + 12), 0
    alloc = sum(t.numel() * t.element_size() for t in first)
    del first
    extra["completions_per_call"] = n_done
    return ctx.run(fn, lambda i: make_inputs(ctx, b, nn, p, ring, i), bytes=nbytes, alloc_bytes=alloc, graph=impl != "torch", **extra)
