"""Ahead-of-time compile matrix: every Triton kernel of kpool for every GPU target, on a CPU.

No GPU is needed: ``triton.compile(ASTSource(...), target=GPUTarget(...))`` runs the whole
pipeline on the CPU with the tools shipped in the triton wheel (``ptxas`` /
``ptxas-blackwell`` for cubins, the built-in LLD for hsaco), so each job goes all the way
to the binary: ``ttir -> ttgir -> llir -> ptx -> cubin`` (cuda) or ``ttir -> ttgir ->
llir -> amdgcn -> hsaco`` (hip). A job also fails when the kernel needs more shared memory
than the target has (it would compile, then fail to load).

Kernels are discovered, not listed: every ``triton.jit`` function named ``_*_kernel`` in a
module of the package (every ``kpool.ops`` module, and any other whose source mentions
``triton.jit``) must have a spec (``SPECS`` below, or a module-level ``AOT_SPECS`` dict next
to the kernel) or an entry in ``EXCLUDED`` with the reason; a kernel without one, or a spec
without its kernel, is an error.

Spec (``KernelSpec``): the argument types plus the constexpr cases to compile.

* ``ptrs``: ``{arg: "*u8" | "*bf16" | "*fp32" | "*i64" | ...}`` for every pointer argument
  (a leading ``*`` may be omitted). Other runtime arguments are ``i32`` unless a case says
  otherwise.
* ``cross`` / ``cycle``: axes, each a list of dicts (one dict = values of one or more
  parameters). ``cross`` axes are multiplied out; ``cycle`` axes are spread over those cases
  so that every value of every axis appears on every target, and as many value pairs as the
  cases allow (greedy pairwise cover). A case value may set any parameter: a constexpr's
  value, a runtime argument's type (``"*i64"``, ``"i64"``), or an int for a runtime
  argument the JIT specializes to a constant (Triton turns an int argument equal to 1 into a
  constexpr).
* ``fixed``: constexprs common to every case; ``derive``: ``case -> dict`` of parameters the
  launcher computes from others (e.g. the tile size from P; reuse the launcher's own helpers
  and constants); ``options``: the launcher's compile options (``num_warps``,
  ``enable_fp_fusion=False``); a case key ``_opt_<name>`` sets option ``<name>`` for that
  case. Keys starting with ``_`` are dropped after ``derive``.
* ``target_derive``: ``(case, target name) -> dict`` of parameters the launcher takes from
  the device, applied per target after ``derive`` (shown in the job's label). The fp8
  writers and scorers use ``native_fp8_param``: ``NATIVE_FP8`` as ``_backend.native_fp8``
  chooses by default (``KPOOL_FP8_ENCODER=auto``), from the same table (``_backend.native_fp8_mode``).

fp8 check: a job's TTIR holds fp8 element types exactly when it is compiled with
a non-zero ``NATIVE_FP8`` (the native conversion); any other job with fp8 types fails (it would
rely on a conversion sm_80, or CUDA for e4m3fnuz, lacks), and so does a job with a non-zero ``NATIVE_FP8``
but without them (the flag would not reach the encoder or decoder). The summary lists, per target,
the kernels that use a native conversion and for which format.

PDL: a kernel with a ``PDL`` constexpr (programmatic dependent launch, ``ops._pdl``) is
compiled with it set as ``_backend.pdl_launch`` sets it on the target (CUDA sm_90+); on CUDA
targets a job fails unless its PTX waits on the previous grid (``griddepcontrol.wait``)
exactly when ``PDL`` is set.
* Tiers: ``full`` multiplies every ``cross`` axis (the product the launchers can reach);
  ``ci`` (default) multiplies the first ``ci_cross`` of them and spreads the others like
  ``cycle`` axes (CI runs on two CPU cores).

One more cycled axis, ``_hints``, gives the alignment facts the JIT may know: ``aligned``
(every pointer and int divisible by 16, and on hip every pointer within 2 GB: buffer ops)
or ``none``; every kernel meets both on every target.

Compilation runs in worker processes, each compiling the jobs of one target, with
``TRITON_INTERPRET`` off, a fresh ``TRITON_CACHE_DIR`` (real compiles, nothing reused) and
``TRITON_ALLOW_NON_CONSTEXPR_GLOBALS`` removed, so the calling process may itself run
under the interpreter. ``compile_matrix()`` returns one ``AotResult`` per job;
``python -m kpool.aot`` prints the table and exits non-zero when a job fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import inspect
import itertools
import json
import os
import pkgutil
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

__all__ = ["TARGETS", "KernelSpec", "AotJob", "AotResult", "AotSpecError", "SPECS", "EXCLUDED", "native_fp8_param",
           "kernel_module_names", "discover_kernels",
           "registered_specs", "check_registry", "build_jobs", "compile_source", "compile_job", "compile_matrix",
           "format_results",
           "main"]

# name -> (backend, arch, warp size, shared memory per block in bytes)
TARGETS = {
    "sm_80": ("cuda", 80, 32, 166912),       # A100: 163 KiB opt-in
    "sm_90": ("cuda", 90, 32, 232448),       # H100/H200: 227 KiB
    "sm_100": ("cuda", 100, 32, 232448),     # B200: 227 KiB
    "gfx942": ("hip", "gfx942", 64, 65536),  # MI300: 64 KiB LDS
    "gfx950": ("hip", "gfx950", 64, 163840),  # MI350: 160 KiB LDS
}
TIERS = ("ci", "full")
HINTS = ("aligned", "none")
_MARK = "KPOOL-AOT "  # prefix of the worker's protocol lines on stdout
_FP8_IR = re.compile(r"f8E\dM\d")  # MLIR fp8 element types (f8E4M3FN, f8E4M3FNUZ, f8E5M2, ...)


class AotSpecError(RuntimeError):
    """The kernel registry and the package disagree (a kernel without a spec, a bad spec...)."""


# ----------------------------------------------------------------------------------------------
# Spec format and shared axes
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KernelSpec:
    ptrs: dict
    cross: tuple = ()
    cycle: tuple = ()
    fixed: dict = dataclasses.field(default_factory=dict)
    options: dict = dataclasses.field(default_factory=dict)
    ci_cross: int = 1
    derive: object = None  # optional case -> dict of more parameters (launcher-computed constexprs)
    target_derive: object = None  # optional (case, target name) -> dict of parameters that follow the target


def axis(name, values):
    """``[{name: v} for v in values]``."""
    return [{name: v} for v in values]


def flag(name):
    return axis(name, (False, True))


def _pool_sizes():
    return (4, 16)


def pool_axis():
    """P in {4, 16}."""
    return axis("P", _pool_sizes())


def pool_ring_axis():
    """(P, RING) with RING = P and RING > P (``layout.ring_size(P, 1)``, one speculative token)."""
    from .layout import ring_size
    return [dict(P=p, RING=r) for p in _pool_sizes() for r in sorted({ring_size(p), ring_size(p, 1)})]


def layout_axis():
    """PRESHUFFLE over ``layout.LAYOUTS``."""
    from .layout import LAYOUTS
    return axis("PRESHUFFLE", [name == "preshuffle" for name in LAYOUTS])


def fp8_axis(*keys):
    """One dict per fp8 format of ``layout.FP8_DTYPES``, restricted to ``keys`` among
    ``FP8_MAX`` and ``FNUZ``.

    Every target takes both formats: fp8 is encoded (writers) and decoded (scorers) with
    integer ops or a table unless the target has the native conversion for the format
    (``NATIVE_FP8``, set per target by ``native_fp8_param``); each result records whether
    fp8 types reached the IR.
    """
    import torch

    from .layout import FP8_DTYPES, fp8_max
    out = []
    for dt in FP8_DTYPES:
        vals = dict(FP8_MAX=fp8_max(dt), FNUZ=dt == torch.float8_e4m3fnuz)
        out.append({k: vals[k] for k in keys})
    return out


def native_fp8_param(case, target):
    """``target_derive`` of the fp8 writers: ``NATIVE_FP8`` for the case's format (``FNUZ``)
    on ``target``, as ``_backend.native_fp8`` chooses it by default (``native_fp8_mode``)."""
    import torch

    from ._backend import native_fp8_mode
    backend, arch = TARGETS[target][:2]
    fp8_dtype = torch.float8_e4m3fnuz if case["FNUZ"] else torch.float8_e4m3fn
    return dict(NATIVE_FP8=native_fp8_mode(backend, arch, fp8_dtype))


def ring_writer_params(case, target):
    """``target_derive`` of the ring-fed writers: ``native_fp8_param`` and ``ROW_SELECT`` (on
    CUDA targets, as ``_backend.row_select`` chooses it on a CUDA build of torch)."""
    return dict(native_fp8_param(case, target), ROW_SELECT=TARGETS[target][0] == "cuda")


def int_ptr_axis(*names):
    """Index tensors accepted as int32 or int64 (``_checks.INT_DTYPES``): both pointer types."""
    return [{n: t for n in names} for t in ("*i32", "*i64")]


# ----------------------------------------------------------------------------------------------
# Specs of the kernels (module short name -> builder(module) -> {kernel name: KernelSpec})
# ----------------------------------------------------------------------------------------------

_PAGE = axis("PAGE", (64, 32))  # SPEC.md: PAGE is 32 or 64 in practice


def _compress_specs(m):
    return {"_compress_kernel": KernelSpec(
        ptrs=dict(kv_ptr="u8", kv_f32_ptr="fp32", k_ptr="bf16", g_ptr="bf16", ape_ptr="fp32", loc_ptr="i64",
                  mask_ptr="i1", codes_ptr="u8", scale_ptr="fp32"),
        cross=(pool_axis(), layout_axis(), fp8_axis("FP8_MAX", "FNUZ")),
        cycle=(flag("ROUND_SCALE"), flag("HAS_MASK"), _PAGE,
               [dict(WRITE_CACHE=True, RETURN_COMPRESSED=False), dict(WRITE_CACHE=False, RETURN_COMPRESSED=True),
                dict(WRITE_CACHE=True, RETURN_COMPRESSED=True)]),
        derive=lambda c: dict(BN=m.BLOCK_POOLS.get(c["P"], 1)),  # as launch_compress on a GPU
        target_derive=native_fp8_param,
        options=dict(enable_fp_fusion=False, num_warps=m.NUM_WARPS))}


def _prefill_specs(m):
    from .ops.compress import BLOCK_POOLS
    return {"_prefill_kernel": KernelSpec(
        ptrs=dict(kv_ptr="u8", kv_f32_ptr="fp32", tail_ptr="bf16", key_ptr="bf16", g_ptr="bf16", ape_ptr="fp32",
                  pool_ptr="i64", req_ptr="i64"),
        cross=(pool_ring_axis(), layout_axis(), fp8_axis("FP8_MAX", "FNUZ")),
        cycle=(flag("ROUND_SCALE"), _PAGE),
        derive=lambda c: dict(BN=BLOCK_POOLS.get(c["P"], 1), KEEP=c["P"],  # as write_prefill on a GPU
                              **({"_opt_maxnreg": m.MAX_REGS[c["P"]]} if c["P"] in m.MAX_REGS else {})),
        target_derive=ring_writer_params,
        options=dict(enable_fp_fusion=False, num_warps=m.NUM_WARPS))}


def decode_step_axis():
    """(P, RING, next_n, NB) the launcher accepts: next_n = 1 (specialized by the JIT) at
    ``pool_ring_axis``' rings; verify steps of up to NB = next_pow2(next_n) tokens at the smallest
    ring that holds their drafts, ``layout.ring_size(P, NB - 1)`` (RING >= P + next_n - 1)."""
    from .layout import ring_size
    steps = [dict(pr, next_n=1, NB=1) for pr in pool_ring_axis()]
    return steps + [dict(P=p, RING=ring_size(p, nb - 1), next_n="i32", NB=nb)
                    for p in _pool_sizes() for nb in (2, 4, 8)]


def _decode_specs(m):
    return {"_decode_update_kernel": KernelSpec(
        ptrs=dict(kv_ptr="u8", kv_f32_ptr="fp32", tail_ptr="bf16", key_ptr="bf16", g_ptr="bf16", ape_ptr="fp32",
                  ts_ptr="i64", loc_ptr="i64", pos_ptr="i64"),
        cross=(decode_step_axis(), layout_axis(), fp8_axis("FP8_MAX", "FNUZ")),
        cycle=(flag("ROUND_SCALE"), flag("META_FIRST"), flag("WALK_STASH_FIRST"), _PAGE,
               int_ptr_axis("ts_ptr", "loc_ptr", "pos_ptr"),
               axis("_opt_num_warps", sorted({m.decode_warps(b, n) for b in (1, 1 << 20) for n in (1, 4)}))),
        derive=lambda c: _decode_derive(m, c), target_derive=ring_writer_params,
        options=dict(enable_fp_fusion=False))}


def _decode_derive(m, c):
    """NC and the register cap of a decode job, as the launcher sets them (``decode_options``;
    NB = 1 exactly for one-token steps)."""
    cap = m.step_max_regs(c["NB"], c["P"], c["_opt_num_warps"])
    return dict(NC=m.step_tiles(c["NB"], c["P"])["NC"], **({"_opt_maxnreg": cap} if cap else {}))


def _tail_specs(m):
    return {
        "_seed_tail_kernel": KernelSpec(
            ptrs=dict(tail_ptr="bf16", key_ptr="bf16", g_ptr="bf16", ts_ptr="i64", rank_ptr="i64"),
            cross=([dict(KPOOL=pr["P"], RING=pr["RING"]) for pr in pool_ring_axis()],),
            cycle=(int_ptr_axis("ts_ptr"),), fixed=dict(BT=m.BLOCK_TOKENS, W=m.WINDOW)),
        "_seed_requests_kernel": KernelSpec(
            ptrs=dict(tail_ptr="bf16", key_ptr="bf16", g_ptr="bf16", meta_ptr="i64"),
            cross=([dict(RING=pr["RING"], KEEP=pr["P"]) for pr in pool_ring_axis()],)),
    }


def _quant_specs(m):
    return {"_fwht_quant_kernel": KernelSpec(
        ptrs=dict(q_ptr="bf16", codes_ptr="u8", scale_ptr="fp32", w_ptr="fp32", w_out_ptr="fp32", pos_ptr="i32",
                  counts_ptr="i64"),
        # P: the visible counts of quantize_queries_and_counts (with FOLD), or none (0)
        cross=(fp8_axis("FP8_MAX", "FNUZ"),), cycle=(flag("ROUND_SCALE"), flag("FOLD"), axis("P", (0, 4, 16)),
                                                     int_ptr_axis("pos_ptr")),
        fixed=dict(BR=m.BLOCK_ROWS), target_derive=native_fp8_param, options=dict(enable_fp_fusion=False))}


def _logits_specs(m):
    heads = axis("H", m.SUPPORTED_HEADS)
    fp8 = fp8_axis("FNUZ")
    return {
        "_paged_logits_kernel": KernelSpec(
            ptrs=dict(q_ptr="u8", w_ptr="fp32", lens_ptr="i64", pt_ptr="i32", kv_ptr="u8", kv_f32_ptr="fp32",
                      out_ptr="fp32", lut_ptr="i32"),
            cross=(layout_axis(), fp8, heads),
            cycle=(_PAGE, axis("next_n", (1, "i32")), int_ptr_axis("lens_ptr", "pt_ptr")),
            fixed=dict(BN=m.BLOCK_POOLS), target_derive=native_fp8_param, options=dict(enable_fp_fusion=False)),
        "_ragged_logits_kernel": KernelSpec(
            ptrs=dict(q_ptr="u8", w_ptr="fp32", k_ptr="u8", ksc_ptr="fp32", ks_ptr="i64", ke_ptr="i64",
                      out_ptr="fp32", lut_ptr="i32"),
            cross=(fp8, heads), cycle=(int_ptr_axis("ks_ptr", "ke_ptr"),),
            fixed=dict(BN=m.RAGGED_TILE, NT=m.RAGGED_TILES), target_derive=native_fp8_param,
            options=dict(enable_fp_fusion=False)),
    }


def _select_specs(m):
    maps = axis("MAP", (m.MAP_NONE, m.MAP_PAGE_TABLE, m.MAP_OFFSETS))
    tail_blocks = axis("TAIL_BLOCK", (4, 16, m.TAIL_MAX_BLOCK))
    return {
        "_expand_pools_kernel": KernelSpec(
            ptrs=dict(ids_ptr="i32", valid_ptr="i1", seq_ptr="i32", out_ptr="i32", map_ptr="i32"),
            cross=([dict(P=p, PB=p) for p in _pool_sizes()], maps),
            # BLOCK_POOLS: few pools (16) or a full tile (launch_expand_pools' cap TILE_ELEMS // PB)
            cycle=(flag("HAS_VALID"), flag("HAS_TAIL"), axis("_tile", ("small", "full")), tail_blocks,
                   int_ptr_axis("ids_ptr", "seq_ptr", "map_ptr")),
            derive=lambda c: dict(BLOCK_POOLS=16 if c["_tile"] == "small" else max(1, m.TILE_ELEMS // c["PB"])),
            fixed=dict(ROWS=m.ROWS_PER_PROG), options=dict(num_warps=m.EXPAND_WARPS)),
        "_append_tail_kernel": KernelSpec(
            ptrs=dict(src_ptr="i32", seq_ptr="i32", plen_ptr="i32", out_ptr="i32", map_ptr="i32"),
            cross=(pool_axis(), maps),
            cycle=(axis("BLOCK_COLS", (64, m.TILE_ELEMS)), int_ptr_axis("seq_ptr", "plen_ptr", "map_ptr")),
            derive=lambda c: dict(TAIL_BLOCK=m.tail_block(c["P"] - 1)),  # n_tail = P - 1
            fixed=dict(ROWS=m.ROWS_PER_PROG)),
        "_pooled_page_table_kernel": KernelSpec(
            ptrs=dict(src_ptr="i32", out_ptr="i32"),
            cross=(pool_axis(),),
            cycle=(axis("BLOCK", (16, m.FLAT_BLOCK)), int_ptr_axis("src_ptr", "out_ptr"), axis("src_s1", (1, "i32")))),
        "_pooled_write_locs_kernel": KernelSpec(
            ptrs=dict(pt_ptr="i32", ids_ptr="i32", out_ptr="i64"),
            cross=(pool_axis(),),
            cycle=(int_ptr_axis("pt_ptr", "ids_ptr"), axis("pt_s0", (1, "i32"))), fixed=dict(BLOCK=m.FLAT_BLOCK)),
        "_visible_counts_kernel": KernelSpec(
            ptrs=dict(pos_ptr="i32", out_ptr="i64"),
            cross=(pool_axis(),), cycle=(int_ptr_axis("pos_ptr"),), fixed=dict(BLOCK=m.FLAT_BLOCK)),
    }


_KBS = (128, 512)  # KB = next_pow2(select_k) for select_k = index_topk // P = 2048 // {16, 4}


def _expand_axis():
    """``topk.expansion_args``: pool ids (P 1), or tokens with the tail of natural width (P - 1
    columns) or of one rounded up to a multiple of 128 (the largest ``TAIL_BLOCK``)."""
    from .ops.select import TAIL_MAX_BLOCK, tail_block
    ids = [dict(P=1, PB=1, TAIL=False, TAIL_BLOCK=1)]
    return ids + [dict(P=p, PB=p, TAIL=True, TAIL_BLOCK=tb) for p in _pool_sizes()
                  for tb in (tail_block(p - 1), TAIL_MAX_BLOCK)]


def _kb_axis():
    return axis("KB", _KBS)


def _leaf_axis(granule=1, key="CHUNK"):
    """(KB, leaf size under ``key``) at the ends of ``topk.plan_leaves``' range: the smallest
    leaf (``max(MIN_CHUNK, granule)``, below KB: its list keeps all its keys) and the largest
    (``max(KB, LEAF_BASE, granule)``: the top-k path), and ``2 * KB`` (``score.wide_plan``'s
    filtering leaves)."""
    from .ops import topk
    out = []
    for kb in _KBS:
        for chunk in (max(topk.MIN_CHUNK, granule), max(kb, topk.LEAF_BASE, granule), 2 * kb):
            if {"KB": kb, key: chunk} not in out:
                out.append({"KB": kb, key: chunk})
    return out


def _leaf_final_axis(granule=1, key="CHUNK"):
    """``_leaf_axis`` with FINAL (one leaf per row): several leaves of each size, one leaf only
    from KB pools up (a one-leaf launch below KB sees at most select_k pools per row: its rows
    are emitted in order, nothing is scored or selected)."""
    return [dict(leaf, FINAL=final) for leaf in _leaf_axis(granule, key) for final in (False, True)
            if not final or leaf[key] >= leaf["KB"]]


def _survivor_axis(m):
    """(CHUNK, KW) of ``topk.threshold_select`` (``m.survivor_block``) over the leaf range, KB as ``_kb``."""
    return [dict(CHUNK=c["CHUNK"], KW=m.survivor_block(c["CHUNK"], c["KB"])[0], _kb=c["KB"]) for c in _leaf_axis()]



def _survivor_derive(m, c):
    """FILTER and LG of ``_survivors_kernel`` as ``topk.survivors`` sets them."""
    filt = c["_filter"] and c["KW"] <= c["CHUNK"] <= 2 * c["KW"]
    return dict(FILTER=filt, LG=m.survivor_block(c["CHUNK"], c["_kb"], filt)[1])


def _topk_specs(m):
    return {
        "_chunk_topk_kernel": KernelSpec(
            ptrs=dict(x_ptr="fp32", lens_ptr="i32", cand_ptr="i64", count_ptr="i32", out_ptr="i32"),
            cross=(_leaf_final_axis(),),
            cycle=(int_ptr_axis("lens_ptr"), axis("lens_stride", (1, "i32")))),
        "_survivors_kernel": KernelSpec(
            ptrs=dict(cand_ptr="i64", lens_ptr="i32", surv_ptr="i64", count_ptr="i32", bound_ptr="i64"),
            cross=(_survivor_axis(m), axis("LB", (2, 256))),  # LB = next_pow2(leaves per row)
            cycle=(int_ptr_axis("lens_ptr"), axis("lens_stride", (1, "i32")), flag("_filter")),
            # filtering lists from leaves of up to 2 x KB pools (score.filters)
            derive=lambda c: _survivor_derive(m, c)),
        "_union_bound_kernel": KernelSpec(
            ptrs=dict(cand_ptr="i64", lens_ptr="i32", bound_ptr="i64"),
            # filtering leaves of 256 and 512 pools, and wide ones of 1,024 (KB 512); heads in registers up to LB
            # 512, position keys up to 128
            cross=([dict(CHUNK=256, KW=256), dict(CHUNK=512, KW=512), dict(CHUNK=1024, KW=512)],
                   axis("LB", (2, 512, 1024))),
            cycle=(int_ptr_axis("lens_ptr"), axis("lens_stride", (1, "i32"))),
            derive=lambda c: dict(zip(("BLOCK", "RESIDENT", "PK_RESIDENT"), m.union_block(c["LB"]))),
            fixed=dict(BITS=m.RADIX_BITS), options=dict(num_warps=m.SELECT_WARPS)),
        "_threshold_select_kernel": KernelSpec(
            ptrs=dict(surv_ptr="i64", count_ptr="i32", lens_ptr="i32", out_ptr="i32", seq_ptr="i64"),
            cross=(_kb_axis(),), cycle=(int_ptr_axis("lens_ptr", "seq_ptr"), axis("lens_stride", (1, "i32")),
                                        _expand_axis(), axis("RANK_BLOCK", (m.rank_block(1), m.rank_block(1 << 30)))),
            fixed=dict(BLOCK=m.SELECT_BLOCK, BITS=m.RADIX_BITS, HELD=m.SELECT_HELD_KEYS, SLICE=m.RANK_SLICE),
            options=dict(num_warps=m.SELECT_WARPS)),
    }


def _scorer_leaf_axis(m):
    """The fused scorer's leaves (``_leaf_final_axis`` with its tile granule, and the smallest
    filtering leaf, ``FILTER_MIN_CHUNK`` pools, at every KB: ``score.wide_plan`` launches it),
    each that can filter (several leaves of at most 2 x KB pools: ``score.filters``) both
    filtering and exact."""
    leaves = _leaf_final_axis(m.BLOCK_POOLS, "_chunk")
    smallest = max(m.FILTER_MIN_CHUNK, m.BLOCK_POOLS)
    leaves += [leaf for leaf in ({"KB": kb, "_chunk": smallest, "FINAL": False} for kb in _KBS) if leaf not in leaves]
    return [dict(leaf, _filter=f) for leaf in leaves
            for f in ((True, False) if not leaf["FINAL"] and leaf["_chunk"] <= 2 * leaf["KB"] else (False,))]


def _filter_derive(m, c):
    """NT, FILTER (``_scorer_leaf_axis``' ``_filter``: only where ``score.filters`` can choose
    it), and the pipeline stages and register cap (``score.pipeline_stages``,
    ``score.max_regs``; uncapped in ``_small`` cases, as a small grid's) that launch gets."""
    filt = c["_filter"]
    return dict(NT=c["_chunk"] // m.BLOCK_POOLS, FILTER=filt, STAGES=m.pipeline_stages(filt),
                _opt_maxnreg=m.max_regs(filt, c["ROWS"], c["H"], c["_small"]))


def _score_specs(m):
    from .ops.logits import SUPPORTED_HEADS
    options = dict(enable_fp_fusion=False, num_warps=m.NUM_WARPS, maxnreg=m.MAX_REGS)
    return {"_paged_topk_kernel": KernelSpec(
        ptrs=dict(q_ptr="u8", w_ptr="fp32", lens_ptr="i64", pt_ptr="i32", kv_ptr="u8", kv_f32_ptr="fp32",
                  cand_ptr="i64", count_ptr="i32", out_ptr="i32", lut_ptr="i32", seq_ptr="i64"),
        cross=(layout_axis(), fp8_axis("FP8_MAX", "FNUZ"), axis("H", SUPPORTED_HEADS)),
        # _small (an uncapped leaf) last, so that the greedy cover keeps the other axes' pairs
        cycle=(_scorer_leaf_axis(m), _PAGE, axis("next_n", (1, "i32")), axis("ROWS", (1, m.MAX_ROWS)),
               int_ptr_axis("lens_ptr", "pt_ptr", "seq_ptr"), _expand_axis(), axis("_small", (False, False, True))),
        derive=lambda c: _filter_derive(m, c),
        fixed=dict(BN=m.BLOCK_POOLS, ERROR=m.FILTER_ERROR, SHAKE=m.FILTER_SHAKE), target_derive=native_fp8_param,
        options=options),
        "_refine_kernel": KernelSpec(
            ptrs=dict(q_ptr="u8", w_ptr="fp32", pt_ptr="i32", kv_ptr="u8", kv_f32_ptr="fp32", surv_ptr="i64",
                      count_ptr="i32", lut_ptr="i32"),
            cross=(layout_axis(), fp8_axis("FNUZ"), axis("H", SUPPORTED_HEADS)),
            cycle=(_PAGE, axis("next_n", (1, "i32")), int_ptr_axis("pt_ptr")),
            fixed=dict(BN=m.BLOCK_POOLS), target_derive=native_fp8_param, options=options)}


SPECS = {  # module (relative to kpool) -> builder
    "ops.compress": _compress_specs,
    "ops.prefill": _prefill_specs,
    "ops.decode": _decode_specs,
    "ops.tail": _tail_specs,
    "ops.quant": _quant_specs,
    "ops.logits": _logits_specs,
    "ops.select": _select_specs,
    "ops.topk": _topk_specs,
    "ops.score": _score_specs,
}

# Kernels the package never launches on a GPU: acknowledged here instead of compiled.
EXCLUDED = {
    "_downcast_selftest_kernel": "kpool._interpreter's self-test of the patched interpreter (runs under "
                                 "TRITON_INTERPRET=1 only; uses native fp8 conversions on purpose)",
}


# ----------------------------------------------------------------------------------------------
# Discovery and registry
# ----------------------------------------------------------------------------------------------

def _is_triton_fn(obj) -> bool:
    """A ``@triton.jit`` function, compiled (JITFunction) or interpreted (InterpretedFunction)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    return isinstance(obj, (JITFunction, InterpretedFunction))


def kernel_module_names():
    """Modules of the kpool package whose source mentions ``triton.jit`` (every ``kpool.ops``
    module and any other), found by reading the files: nothing else gets imported."""
    root = os.path.dirname(os.path.abspath(__file__))
    names = []
    for info in pkgutil.walk_packages([root], prefix=__package__ + "."):
        if info.name == __name__ or info.ispkg:
            continue
        path = os.path.join(root, *info.name.split(".")[1:]) + ".py"
        if os.path.exists(path) and "triton.jit" in open(path, encoding="utf-8").read():
            names.append(info.name)
    return sorted(names)


def _modules(modules):
    return [importlib.import_module(m) if isinstance(m, str) else m for m in (modules or kernel_module_names())]


def discover_kernels(modules=None):
    """``{kernel name: (module, function)}`` of every ``triton.jit`` function named ``_*_kernel``
    defined in ``modules`` (module objects or names; default: ``kernel_module_names()``)."""
    mods = _modules(modules)
    found = {}
    for mod in mods:
        for name, obj in vars(mod).items():
            if not (name.startswith("_") and name.endswith("_kernel") and _is_triton_fn(obj)):
                continue
            if getattr(getattr(obj, "fn", None), "__module__", mod.__name__) != mod.__name__:
                continue  # imported from elsewhere: counted where it is defined
            if name in found and found[name][1] is not obj:
                raise AotSpecError(f"two kernels named {name}: in {found[name][0].__name__} and {mod.__name__}")
            found[name] = (mod, obj)
    return found


def registered_specs(modules=None):
    """``{kernel name: KernelSpec}`` from ``SPECS`` (for the modules present) and from any
    module-level ``AOT_SPECS`` of ``modules``."""
    mods = _modules(modules)
    specs = {}

    def add(name, spec, where):
        if not isinstance(spec, KernelSpec):
            raise AotSpecError(f"{where}: spec of {name} is {type(spec).__name__}, not KernelSpec")
        if name in specs:
            raise AotSpecError(f"{where}: {name} already has a spec")
        specs[name] = spec

    for mod in mods:
        short = mod.__name__[len(__package__) + 1:] if mod.__name__.startswith(__package__ + ".") else None
        if short in SPECS:
            try:
                built = SPECS[short](mod)
            except Exception as e:  # noqa: BLE001 - re-raised with the module named
                raise AotSpecError(f"kpool.aot.SPECS[{short!r}] cannot build its specs: {type(e).__name__}: {e}") from e
            for name, spec in built.items():
                add(name, spec, f"kpool.aot.SPECS[{short!r}]")
        for name, spec in getattr(mod, "AOT_SPECS", {}).items():
            add(name, spec, f"{mod.__name__}.AOT_SPECS")
    return specs


def check_registry(modules=None):
    """``{name: (module, fn, spec)}`` for every kernel not in ``EXCLUDED``; ``AotSpecError``
    naming each kernel without a spec and each spec without a kernel."""
    kernels = {k: v for k, v in discover_kernels(modules).items() if k not in EXCLUDED}
    specs = registered_specs(modules)
    problems = [f"kernel {name} ({mod.__name__}) has no AOT spec: add one to kpool.aot.SPECS or to "
                f"{mod.__name__}.AOT_SPECS" for name, (mod, _) in sorted(kernels.items()) if name not in specs]
    problems += [f"AOT spec for {name} names no kernel of the package" for name in sorted(specs) if name not in kernels]
    if problems:
        raise AotSpecError("; ".join(problems))
    return {name: (mod, fn, specs[name]) for name, (mod, fn) in kernels.items()}


# ----------------------------------------------------------------------------------------------
# Jobs
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AotJob:
    kernel: str
    module: str
    target: str
    signature: dict      # every parameter -> triton type or "constexpr"
    constexprs: dict     # parameter -> value
    hints: str           # "aligned" or "none"
    options: dict
    label: str           # the case, for humans

    def to_json(self):
        return dataclasses.asdict(self)


@dataclasses.dataclass
class AotResult:
    kernel: str
    target: str
    label: str
    ok: bool
    stages: list = dataclasses.field(default_factory=list)  # IR stages produced, in order
    seconds: float = 0.0  # wall
    cpu_seconds: float = 0.0  # this process + its children (ptxas): independent of machine load
    shared: int | None = None  # shared memory / LDS bytes per program
    native_fp8: bool | None = None  # fp8 element types in the TTIR (a native fp8 conversion or load)
    error: str = ""
    worker: int = 0  # pid of the process that compiled the job

    def describe(self):
        head = f"{self.kernel} for {self.target} [{self.label}]"
        return f"{head}: ok ({'>'.join(self.stages)})" if self.ok else f"{head}: FAILED: {self.error}"


def _params(fn):
    """[(name, is_constexpr)] of a JITFunction or InterpretedFunction."""
    pyfn = fn.fn if hasattr(fn, "fn") else fn
    out = []
    for p in inspect.signature(pyfn).parameters.values():
        ann = p.annotation
        is_cx = ann is not inspect.Parameter.empty and (
            (isinstance(ann, str) and ann.split(".")[-1] == "constexpr") or getattr(ann, "__name__", "") == "constexpr")
        out.append((p.name, is_cx))
    return out


def _cover(bases, axes):
    """One choice per base case (dict) from each axis (list of dicts): every axis value at
    least once, then as many (value, value) pairs (with base values too) as possible, greedily."""
    if not axes:
        return [dict(b) for b in bases]
    n = max(len(bases), max(len(a) for a in axes))
    bases = [bases[i % len(bases)] for i in range(n)]
    singles, pairs, rows = set(), set(), []
    combos = list(itertools.product(*[range(len(a)) for a in axes]))
    for base in bases:
        base_items = [("b", k, repr(v)) for k, v in sorted(base.items())]

        def score(combo):
            items = [("a", i, c) for i, c in enumerate(combo)]
            new1 = sum(it not in singles for it in items)
            new2 = sum(p not in pairs for p in itertools.combinations(items, 2))
            new2 += sum((b, it) not in pairs for b in base_items for it in items)
            return new1, new2

        best = max(combos, key=score)  # first maximum: deterministic
        items = [("a", i, c) for i, c in enumerate(best)]
        singles.update(items)
        pairs.update(itertools.combinations(items, 2))
        pairs.update((b, it) for b in base_items for it in items)
        row = dict(base)
        for i, c in enumerate(best):
            row.update(axes[i][c])
        rows.append(row)
    return rows


def _cases(spec, tier, name):
    cross = [list(a) for a in spec.cross]
    cycle = [list(a) for a in spec.cycle] + [axis("_hints", HINTS)]
    seen = set(spec.fixed)
    for ax in cross + cycle:
        keys = set().union(*ax) if ax else set()
        if not ax or keys & seen:
            raise AotSpecError(f"AOT spec of {name}: axis {ax} is empty or sets {sorted(keys & seen)} again")
        seen |= keys
    if tier == "ci":
        cross, cycle = cross[:spec.ci_cross], cross[spec.ci_cross:] + cycle
    bases = [dict(itertools.chain.from_iterable(d.items() for d in combo)) for combo in itertools.product(*cross)]
    return _cover(bases or [{}], cycle)


def _ptr_type(t):
    return t if t.startswith("*") else "*" + t


def _label(case):
    def short(v):
        return int(v) if isinstance(v, bool) else v
    return " ".join(f"{k.lstrip('_')}={short(v)}" for k, v in case.items())


def _jobs_for(name, mod, fn, spec, targets, tier):
    params = _params(fn)
    names = [p for p, _ in params]
    for p in spec.ptrs:
        if p not in names:
            raise AotSpecError(f"AOT spec of {name}: ptrs names {p!r}, not an argument of the kernel")

    def more_params(fn_, args, case, label, what):
        try:
            more = dict(fn_(*args))
        except Exception as e:  # noqa: BLE001 - re-raised with the kernel named
            raise AotSpecError(f"AOT spec of {name}: {what} failed on {label}: {type(e).__name__}: {e}") from e
        if set(more) & set(case):
            raise AotSpecError(f"AOT spec of {name}: {what} sets {sorted(set(more) & set(case))} again")
        return more

    def case_label(case, hints):
        return _label({k: v for k, v in case.items() if k not in spec.fixed} | {"_hints": hints})

    jobs = []
    for case in _cases(spec, tier, name):
        case = {**spec.fixed, **case}
        hints = case.pop("_hints")
        label = case_label(case, hints)
        if spec.derive is not None:
            case.update(more_params(spec.derive, (case,), case, label, "derive"))
            label = case_label(case, hints)
        options = dict(spec.options, **{k[len("_opt_"):]: v for k, v in case.items() if k.startswith("_opt_")})
        case = {k: v for k, v in case.items() if not k.startswith("_")}
        for target in targets:
            t_case, t_label = case, label
            if spec.target_derive is not None:
                more = more_params(spec.target_derive, (case, target), case, f"{label} for {target}", "target_derive")
                t_case = {**case, **more}
                t_label = case_label(t_case, hints)
            if "PDL" in names:  # as _backend.pdl_launch on the target
                from ._backend import has_pdl
                t_case = {**t_case, "PDL": has_pdl(*TARGETS[target][:2])}
                t_label = case_label(t_case, hints)
            signature, constexprs = _signature(name, params, spec, t_case)
            jobs.append(AotJob(name, mod.__name__, target, signature, constexprs, hints, options, t_label))
    return jobs


def _signature(name, params, spec, case):
    """(signature, constexprs) of one case: every parameter -> triton type or ``"constexpr"``."""
    bad = {k: v for k, v in case.items() if not isinstance(v, (bool, int, float, str))}
    if bad:
        raise AotSpecError(f"AOT spec of {name}: values must be bool/int/float/str, got {bad}")
    unknown = [k for k in case if k not in {p for p, _ in params}]
    if unknown:
        raise AotSpecError(f"AOT spec of {name}: {unknown} are not arguments of the kernel")
    signature, constexprs = {}, {}
    for p, is_cx in params:
        if is_cx:
            if p not in case:
                raise AotSpecError(f"AOT spec of {name}: no value for constexpr {p} in case {_label(case)}")
            signature[p], constexprs[p] = "constexpr", case[p]
        elif isinstance(case.get(p), int) and not isinstance(case.get(p), bool):
            signature[p], constexprs[p] = "constexpr", case[p]  # the JIT's specialization of an int == 1
        elif p in case:
            signature[p] = _ptr_type(case[p]) if p in spec.ptrs or p.endswith("_ptr") else case[p]
        elif p in spec.ptrs:
            signature[p] = _ptr_type(spec.ptrs[p])
        elif p.endswith("_ptr"):
            raise AotSpecError(f"AOT spec of {name}: pointer argument {p} has no type (add it to ptrs)")
        else:
            signature[p] = "i32"
    return signature, constexprs


def build_jobs(targets=None, tier="ci", kernels=None, modules=None):
    """Every (kernel, case, target) job, heaviest first (cases with the largest constexprs)."""
    targets = list(targets or TARGETS)
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ValueError(f"unknown targets {bad}; known: {list(TARGETS)}")
    targets = [t for t in TARGETS if t in targets]  # canonical order: the workers rebuild the same list
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    registry = check_registry(modules)
    if kernels:
        missing = [k for k in kernels if k not in registry]
        if missing:
            raise ValueError(f"unknown kernels {missing}; known: {sorted(registry)}")
    jobs = []
    for name in sorted(registry):
        if kernels and name not in kernels:
            continue
        mod, fn, spec = registry[name]
        jobs += _jobs_for(name, mod, fn, spec, targets, tier)
    # heavy cases first (the pool size, or the top-k width, drives compile time), stable otherwise
    return sorted(jobs, key=lambda j: (-int(j.constexprs.get("P", 0)), -int(j.constexprs.get("KB", 0))))


def _jobs_digest(jobs):
    return hashlib.sha256(json.dumps([j.to_json() for j in jobs], sort_keys=True, default=str).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# Compiling (worker side: TRITON_INTERPRET off)
# ----------------------------------------------------------------------------------------------

def compile_source(job: AotJob, fn=None):
    """``triton.compile`` of one job in this process (which must not be interpreting): the
    ``CompiledKernel`` (``.asm`` by stage, ``.metadata``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if fn is None:
        fn = getattr(importlib.import_module(job.module), job.kernel)
    if not isinstance(fn, JITFunction):
        raise RuntimeError(f"{job.kernel} is a {type(fn).__name__}: compile with TRITON_INTERPRET unset")
    backend, arch, warp, _ = TARGETS[job.target]
    attrs = {}
    if job.hints == "aligned":
        for i, p in enumerate(fn.arg_names):
            ty = job.signature[p]
            if ty == "constexpr" or ty == "i1":
                continue
            attr = [["tt.divisibility", 16]]
            if backend == "hip" and ty.startswith("*"):
                attr.append(["tt.pointer_range", 32])
            attrs[(i,)] = attr
    src = ASTSource(fn=fn, signature=dict(job.signature), constexprs=dict(job.constexprs), attrs=attrs)
    return triton.compile(src, target=GPUTarget(backend, arch, warp), options=dict(job.options))


def compile_job(job: AotJob, fn=None) -> AotResult:
    """Compile one job in this process (which must not be interpreting)."""
    t0, c0 = time.perf_counter(), _cpu_time()
    res = AotResult(job.kernel, job.target, job.label, ok=False, worker=os.getpid())
    try:
        backend, _, _, smem = TARGETS[job.target]
        compiled = compile_source(job, fn)
        res.stages = [k for k in compiled.asm if k != "source"]
        res.native_fp8 = bool(_FP8_IR.search(compiled.asm.get("ttir", "")))
        res.shared = int(getattr(compiled.metadata, "shared", 0) or 0)
        binary = "cubin" if backend == "cuda" else "hsaco"
        native = bool(job.constexprs.get("NATIVE_FP8"))
        if binary not in compiled.asm or not compiled.asm[binary]:
            res.error = f"no {binary} produced (stages: {res.stages})"
        elif res.native_fp8 and not native:
            res.error = ("fp8 types in the TTIR with NATIVE_FP8=0: the kernel relies on a native fp8 "
                         "conversion, which sm_80 (e4m3fn) and CUDA (e4m3fnuz) lack; encode with _jit.fp8_encode "
                         "or take the encoder from _backend.native_fp8")
        elif native and not res.native_fp8:
            res.error = "NATIVE_FP8 set but no fp8 type in the TTIR: the flag does not reach the fp8 conversion"
        elif backend == "cuda" and ("griddepcontrol.wait" in compiled.asm.get("ptx", "")) != bool(
                job.constexprs.get("PDL")):
            res.error = ("griddepcontrol.wait in the PTX exactly when PDL is set: a kernel launched with "
                         "launch_pdl must wait first (ops._pdl.grid_dependency_sync(PDL))")
        elif res.shared > smem:
            res.error = f"needs {res.shared} bytes of shared memory, {job.target} has {smem}"
        else:
            res.ok = True
    except Exception as e:  # noqa: BLE001 - the failure is the result
        res.error = _error_text(e)
    res.seconds = round(time.perf_counter() - t0, 2)
    res.cpu_seconds = round(_cpu_time() - c0, 2)
    return res


def _cpu_time():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _error_text(e, limit=4000):
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    text = "\n  caused by ".join(parts)
    return text if len(text) <= limit else text[:limit // 2] + "\n  ...\n" + text[-limit // 2:]


def _worker(args):
    """``--worker``: claim jobs one by one (exclusive files in ``--claims``) and print results;
    only jobs of the first claimed job's target, then exit (the parent starts another worker
    while jobs are left). One target per process: Triton keeps per-process backend state that
    one target's compile can leave wrong for another's (triton 3.6: an fp8 kernel for gfx942
    after a gfx950 job fails an assertion in its e4m3fnuz lowering)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("kpool.aot worker needs TRITON_INTERPRET unset or 0")
    jobs = build_jobs(args.targets, args.tier, args.kernels, args.modules)
    if _jobs_digest(jobs) != args.digest:
        raise SystemExit("kpool.aot worker: job list differs from the parent's")
    out, target = sys.stdout, None
    for i, job in enumerate(jobs):
        if target not in (None, job.target):
            continue
        try:
            os.close(os.open(os.path.join(args.claims, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        target = job.target
        out.write(_MARK + json.dumps({"start": i}) + "\n")
        out.flush()
        res = compile_job(job)
        out.write(_MARK + json.dumps({"done": i, "result": dataclasses.asdict(res)}) + "\n")
        out.flush()


# ----------------------------------------------------------------------------------------------
# Orchestration (any process, interpreting or not)
# ----------------------------------------------------------------------------------------------

def _worker_env(cache_dir):
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0"
    env["TRITON_CACHE_DIR"] = cache_dir
    env["TRITON_ALWAYS_COMPILE"] = "1"
    env.pop("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", None)  # the real compiler's rule must hold
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the dir holding kpool
    paths = [here] + [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def compile_matrix(targets=None, progress=True, *, tier=None, jobs=None, kernels=None, modules=None,
                   job_timeout=600.0, stream=None):
    """Compile every kernel of the package for ``targets`` (default: all of ``TARGETS``).

    Returns a list of ``AotResult`` (one per job, in job order); failures are results with
    ``ok=False`` and the error. Raises ``AotSpecError`` when a kernel has no spec.
    ``tier``: ``"ci"`` or ``"full"`` (default: ``KPOOL_AOT_TIER`` or ``"ci"``). ``jobs``
    worker processes compile in parallel (default: ``KPOOL_AOT_JOBS`` or the CPU count, at
    most 8), all in one fresh Triton cache directory that is deleted afterwards.
    """
    tier = tier or os.environ.get("KPOOL_AOT_TIER", "ci")
    jobs = jobs or int(os.environ.get("KPOOL_AOT_JOBS", "0")) or max(1, min(os.cpu_count() or 1, 8))
    job_list = build_jobs(targets, tier, kernels, modules)
    targets = sorted({j.target for j in job_list}, key=list(TARGETS).index)
    stream = stream or sys.stderr
    results = [None] * len(job_list)
    work = tempfile.mkdtemp(prefix="kpool-aot-")
    claims, cache = os.path.join(work, "claims"), os.path.join(work, "cache")
    os.makedirs(claims)
    cmd = [sys.executable, "-m", "kpool.aot", "--worker", "--claims", claims, "--tier", tier,
           "--digest", _jobs_digest(job_list), "--targets", ",".join(targets)]
    if kernels:
        cmd += ["--kernels", ",".join(kernels)]
    if modules:
        cmd += ["--modules", ",".join(m if isinstance(m, str) else m.__name__ for m in modules)]
    env = _worker_env(cache)
    events = queue.Queue()
    workers = {}  # id -> dict(proc, current, since, stderr)
    t_start = time.perf_counter()
    done = 0

    def spawn(wid):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        w = dict(proc=proc, current=None, since=None, stderr=[])

        def read_out():
            for line in proc.stdout:
                if line.startswith(_MARK):
                    events.put((wid, json.loads(line[len(_MARK):])))
            events.put((wid, None))

        def read_err():
            for line in proc.stderr:
                w["stderr"].append(line)
                del w["stderr"][:-200]

        threading.Thread(target=read_out, daemon=True).start()
        threading.Thread(target=read_err, daemon=True).start()
        workers[wid] = w

    def finish(i, res):
        nonlocal done
        results[i] = res
        done += 1
        if progress:
            status = "ok  " if res.ok else "FAIL"
            print(f"[{done:4d}/{len(job_list)}] {status} {res.target:7s} {res.kernel} [{res.label}] {res.seconds:.1f}s "
                  f"({res.cpu_seconds:.1f}s CPU)"
                  + ("" if res.ok else f"\n    {res.error.splitlines()[0] if res.error else ''}"),
                  file=stream, flush=True)

    try:
        n_workers = max(1, min(jobs, len(job_list)))
        next_id = 0
        for _ in range(n_workers):
            spawn(next_id)
            next_id += 1
        respawns = 0
        while workers:
            try:
                wid, msg = events.get(timeout=1.0)
            except queue.Empty:
                wid, msg = None, None
            now = time.perf_counter()
            for w_id, w in list(workers.items()):  # a job past its time limit: kill that worker
                if w["current"] is not None and now - w["since"] > job_timeout:
                    os.killpg(w["proc"].pid, signal.SIGKILL)
                    w["timed_out"] = True
            if wid is None:
                continue
            w = workers[wid]
            if msg is None:  # the worker's stdout closed: it exited
                rc = w["proc"].wait()
                del workers[wid]
                if w["current"] is not None:
                    i = w["current"]
                    job = job_list[i]
                    why = (f"timed out after {job_timeout:.0f}s" if w.get("timed_out")
                           else f"compiler process died (exit code {rc})")
                    finish(i, AotResult(job.kernel, job.target, job.label, ok=False, seconds=round(now - w["since"], 2),
                                        error=why + ": " + "".join(w["stderr"][-20:]).strip()))
                elif rc != 0:  # failed outside any job (import, environment): fatal
                    tail = "".join(w["stderr"][-30:]).strip()
                    raise RuntimeError(f"kpool.aot worker failed (exit code {rc}):\n{tail}")
                unclaimed = len(os.listdir(claims)) < len(job_list)
                if unclaimed and respawns < len(job_list):
                    respawns += 1
                    spawn(next_id)
                    next_id += 1
                continue
            if "start" in msg:
                w["current"], w["since"] = msg["start"], now
            else:
                w["current"] = None
                finish(msg["done"], AotResult(**msg["result"]))
    finally:
        for w in workers.values():
            if w["proc"].poll() is None:
                os.killpg(w["proc"].pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    for i, res in enumerate(results):
        if res is None:
            job = job_list[i]
            results[i] = AotResult(job.kernel, job.target, job.label, ok=False, error="never compiled (workers gone)")
    if progress:
        print(f"kpool.aot: {sum(r.ok for r in results)}/{len(results)} jobs ok, "
              f"{time.perf_counter() - t_start:.1f}s wall with {n_workers} workers", file=stream, flush=True)
    return results


def format_results(results):
    """Per kernel and target: jobs ok / total and CPU seconds; stages reached; the failures."""
    targets = [t for t in TARGETS if any(r.target == t for r in results)]
    kernels = sorted({r.kernel for r in results})
    width = max([len(k) for k in kernels] + [6])
    lines = [f"{'kernel':{width}s} " + " ".join(f"{t:>14s}" for t in targets)]
    for k in kernels:
        cells = []
        for t in targets:
            rs = [r for r in results if r.kernel == k and r.target == t]
            ok = sum(r.ok for r in rs)
            cells.append(f"{ok}/{len(rs)} {sum(r.cpu_seconds for r in rs):6.1f}s".rjust(14) if rs else " " * 14)
        lines.append(f"{k:{width}s} " + " ".join(cells))
    for t in targets:
        stages = sorted({">".join(r.stages) for r in results if r.target == t and r.ok})
        lines.append(f"stages {t}: {', '.join(stages) or '-'}")
    lines.append("kernels with fp8 types in their TTIR "
                 "(a native fp8 conversion; expected exactly where NATIVE_FP8 != 0):")
    for t in targets:
        fp8 = {}
        for r in results:
            if r.target == t and r.native_fp8:
                fmt = re.search(r"\bFNUZ=([01])\b", r.label)
                fp8.setdefault(r.kernel, set()).add(("e4m3fn", "e4m3fnuz")[int(fmt.group(1))] if fmt else "?")
        cells = [f"{k} ({', '.join(sorted(v))})" for k, v in sorted(fp8.items())]
        lines.append(f"  {t}: {', '.join(cells) if cells else 'none (software fp8 only)'}")
    lines.append(f"total compile CPU time {sum(r.cpu_seconds for r in results):.1f}s "
                 f"(wall summed over jobs {sum(r.seconds for r in results):.1f}s)")
    lines += [f"FAILED {r.describe()}" for r in results if not r.ok]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m kpool.aot", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", type=lambda s: [t for t in s.split(",") if t], default=None,
                   help=f"comma-separated, from {', '.join(TARGETS)} (default: all)")
    p.add_argument("--tier", choices=TIERS, default=None, help="ci (default, or KPOOL_AOT_TIER) or full")
    p.add_argument("--jobs", "-j", type=int, default=None,
                   help="parallel compiler processes (default: KPOOL_AOT_JOBS or the CPU count, at most 8)")
    p.add_argument("--kernels", type=lambda s: [k for k in s.split(",") if k], default=None)
    p.add_argument("--modules", type=lambda s: [m for m in s.split(",") if m], default=None,
                   help="modules to scan instead of kpool.ops.*")
    p.add_argument("--list", action="store_true", help="print the jobs and exit")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--claims", help=argparse.SUPPRESS)
    p.add_argument("--digest", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    try:
        if args.list:
            for j in build_jobs(args.targets, args.tier or os.environ.get("KPOOL_AOT_TIER", "ci"), args.kernels,
                                args.modules):
                print(f"{j.target:7s} {j.kernel} [{j.label}]")
            return 0
        results = compile_matrix(args.targets, progress=not args.quiet, tier=args.tier, jobs=args.jobs,
                                 kernels=args.kernels, modules=args.modules)
    except AotSpecError as e:
        print(f"kpool.aot: registry error: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    print(format_results(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    from kpool import aot as _aot  # the importable module, not __main__ (specs elsewhere import it)

    try:
        sys.exit(_aot.main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(3)
