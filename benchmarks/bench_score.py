"""HOOK (issue 5): scoring benchmarks (pooled paged fp8 MQA logits + top-k over pools).

No cases yet: ``cases`` returns an empty list, so the harness runs nothing for this op and
records the hook in the result document. To add them, follow ``bench_expand.py``: define
cases (GLM-5.3-Flash geometry: 32 heads x 128 dims, P = 4, select_k = 512; and P = 16),
``impls`` (``ours``, ``seed`` where the seed has an equivalent, ``torch``), the bytes each
call must move (q + weights + every visible pool's 132-byte entry read once, logits or
indices written once), and ``bench`` returning ``ctx.run(...)``.
"""

from __future__ import annotations

OP = "score"
TITLE = "scoring (issue 5)"
HOOK = "issue 5: scoring benchmarks not written yet (benchmarks/bench_score.py)"


def cases(mode):
    return []


def impls(case):
    return ["ours", "seed", "torch"]


def targets(case):
    return []


def bench(ctx, case, impl):
    raise NotImplementedError("scoring benchmarks (issue 5)")
