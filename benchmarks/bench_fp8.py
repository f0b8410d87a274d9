"""fp8 encoding in the writers (issue 6): software (integer ops) vs the native conversion.

The same compress + write as ``bench_compress`` (plain layout, e4m3fn, P = 4 and 16,
262,144 pools), run twice: ``software`` (``KPOOL_FP8_ENCODER=software``: integer ops,
``_jit.fp8_encode``) and ``native`` (``KPOOL_FP8_ENCODER=native``: Triton's
``.to(tl.float8e4nv)``, on targets that have it). Both are checked byte for byte against
the CPU torch reference before timing. The ratio decided the default (``auto`` = native where
available: ``kpool._backend.native_fp8``; benchmarks/LOG.md records the measurement).
"""

from __future__ import annotations

import os
import sys

_harness = sys.modules["kpool_bench_harness"]  # loaded by kpool.bench before any bench module

OP = "fp8"
TITLE = "fp8 encoder in compress + write (issue 6)"
_COMPRESS = _harness.load_op_module("compress")


def cases(mode):
    sizes = [(4, 16), (16, 16)] if mode == "dry" else [(4, 262_144), (16, 262_144)]
    return [{"label": f"P={p} pools={n}", "P": p, "pools": n, "page": _COMPRESS.PAGE} for p, n in sizes]


def impls(case):
    return ["software", "native"]


def targets(case):
    return []


def bench(ctx, case, impl):
    import kpool
    from kpool._backend import FP8_ENCODER_ENV, native_fp8
    from kpool.layout import cdiv
    p, n = case["P"], case["pools"]
    fp8 = _COMPRESS.FP8

    def fn(kv, k, g, ape, loc):
        os.environ[FP8_ENCODER_ENV] = impl
        kpool.kpool_compress_and_write_cache(kv, k, g, ape, loc, p, layout="plain", fp8_dtype=fp8)

    prev = os.environ.get(FP8_ENCODER_ENV)
    try:
        os.environ[FP8_ENCODER_ENV] = impl
        extra = {"native_used": bool(native_fp8(ctx.device, fp8))}
        if ctx.check:
            extra.update(_COMPRESS.check_exact(ctx, fn, p, n))
        nbytes = _COMPRESS.floor_bytes(p, n)
        alloc = nbytes + (cdiv(n, _COMPRESS.PAGE) + 1) * _COMPRESS.PAGE * (_COMPRESS.HEAD + 4)
        return ctx.run(fn, lambda i: _COMPRESS.make_inputs(ctx, p, n, i), bytes=nbytes, alloc_bytes=alloc,
                       graph=True, **extra)
    finally:
        if prev is None:
            os.environ.pop(FP8_ENCODER_ENV, None)
        else:
            os.environ[FP8_ENCODER_ENV] = prev
