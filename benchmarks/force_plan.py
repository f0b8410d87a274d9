"""``ab.py`` patches that force the fused scorer's leaf plan, to time plans its rules would not pick.

    python benchmarks/ab.py --op score --cases 'decode B=64 ctx=8K$' --variant main=src \\
        --variant e256=src::'import force_plan; force_plan.install(256, filtered=False)'

``install(chunk, filtered)`` wraps ``kpool.ops.score.wide_plan``: a plan of several leaves becomes
one of ``chunk``-pool leaves, filtering where ``score.filters`` allows it (``filtered``) or exact
where such leaves keep all their keys (``chunk <= KB``); every other plan stays as ``wide_plan``
makes it. The launcher derives the rest (register cap, stages, refine) from the plan as usual.
(58th session: `results/ab_runs/h100_68ed3d1_verify_forced_plans.json`, run with this logic as
`.abtmp/force.py` driven by `FORCE_CHUNK` / `FORCE_FILTER`.)
"""

from __future__ import annotations


def install(chunk: int, filtered: bool) -> None:
    """Replace ``score.wide_plan`` by the forcing wrapper (once per process)."""
    from kpool.layout import cdiv
    from kpool.ops import score, topk

    real = score.wide_plan

    def forced(rows, n_cols, select_k, device, groups=None, heads=32):
        plan = real(rows, n_cols, select_k, device, groups=groups, heads=heads)
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

