"""``ab.py`` patches that force the fused scorer's leaf plan, to time plans its rules would not pick.

    python benchmarks/ab.py --op score --cases 'decode B=64 ctx=8K$' --variant main=src \\
        --variant e256=src::'import force_plan; force_plan.install(256, filtered=False)'

``install(chunk, filtered)`` wraps ``kpool.ops.score.wide_plan``: a plan of several leaves becomes
one of ``chunk``-pool leaves, filtering where ``score.filters`` allows it (``filtered``) or exact
where such leaves keep all their keys (``chunk <= KB``); every other plan stays as ``wide_plan``
makes it. The launcher derives the rest (register cap, stages, refine) from the plan as usual.
(58th session: `results/ab_runs/h100_68ed3d1_verify_forced_plans.json`, run with this logic as
`.abtmp/force.py` driven by `FORCE_CHUNK` / `FORCE_FILTER`.)

``install_exact_grid(per_sm, smallest)`` re-plans exact plans only: their leaves as
``topk.plan_leaves`` would choose them for ``per_sm`` programs per SM (``PROGRAMS_PER_SM`` is 2),
where that gives finer leaves of at least ``smallest`` pools (NOTES.md, open leads: exact leaves
of 256 where ``plan_leaves``' 512 leave the grid short of programs; written in the 59th session,
not yet run on a GPU).
"""

from __future__ import annotations


def install(chunk: int, filtered: bool) -> None:
    """Replace ``score.wide_plan`` by the forcing wrapper (once per process)."""
    from kpool.layout import cdiv
    from kpool.ops import score, topk

    real = score.wide_plan

    def forced(rows, n_cols, select_k, device, groups=None):
        plan = real(rows, n_cols, select_k, device, groups=groups)
        n_chunks = cdiv(n_cols, chunk)
        if plan[1] == 1 or n_chunks < 2:
            return plan
        kb = topk.key_block(select_k)
        if filtered and score.filters(chunk, kb, n_chunks, n_cols, select_k):
            return chunk, n_chunks, True
        if not filtered and chunk <= kb:
            return chunk, n_chunks, False
        return plan

    score.wide_plan = forced


def install_exact_grid(per_sm: int, smallest: int = 256) -> None:
    """Replace ``score.wide_plan`` by a wrapper whose exact plans of several leaves take
    ``topk.plan_leaves``' leaves at ``per_sm`` programs per SM when those are finer and hold at
    least ``smallest`` pools (once per process)."""
    from kpool.ops import score, topk

    real = score.wide_plan

    def finer(rows, n_cols, select_k, device, groups=None):
        plan = real(rows, n_cols, select_k, device, groups=groups)
        if plan[2] or plan[1] == 1:
            return plan
        target = topk.PROGRAMS_PER_SM
        topk.PROGRAMS_PER_SM = per_sm
        try:
            chunk, n_chunks = topk.plan_leaves(rows, n_cols, select_k, device, score.BLOCK_POOLS)
        finally:
            topk.PROGRAMS_PER_SM = target
        return (chunk, n_chunks, False) if n_chunks > 1 and smallest <= chunk < plan[0] else plan

    score.wide_plan = finer
