"""Hold some SMs with a spinning kernel while others are timed: a bandwidth-per-SM proxy.

An H200 has the H100's 132 SMs at the same clocks but ~1.4x its copy bandwidth, so a kernel
that is memory-bound on an H100 can be issue-bound on an H200 (the 48th session's compress
A/Bs: 3.6% fewer instructions, flat on the H100). Timing on an H100 with ``n`` of its SMs
held raises the bandwidth each remaining SM must carry towards the H200's
(``ab.py --occupy-sms 39``: 93 SMs at ~3.0 TB/s ~ 132 at ~4.3 TB/s). A proxy for ranking
variants whose difference is instruction issue; the README's numbers never come from it.

Each held SM runs one program of 32 warps that keeps ``KEEP`` floats per thread live across
its spin loop, so it takes the whole register file (64 registers x 1,024 threads) and no
other program fits beside it. The programs report their SM ids (``distinct_sms``) and the
compiled register count (``regs``), and spin until a flag written by the timed stream after
its last event, or ``limit_s`` after they start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WARPS = 32  # 1,024 threads: 64 registers each fill the 65,536-register file
KEEP = 64   # floats per thread held across the loop: ptxas caps a 1,024-thread program at 64 registers


@triton.jit
def _clock_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _occupy_kernel(flag_ptr, hold_ptr, sm_ptr, limit_ns, HOLD: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, HOLD)
    held = tl.load(hold_ptr + offs)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sm_ptr + pid, sm)
    start = _clock_ns()
    done = tl.load(flag_ptr, volatile=True)
    while done == 0:
        tl.inline_asm_elementwise("nanosleep.u32 2000; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
        done = tl.load(flag_ptr, volatile=True) | ((_clock_ns() - start) > limit_ns).to(tl.int32)
    tl.store(hold_ptr + HOLD + pid, tl.sum(held, axis=0))


class Occupier:
    """``with Occupier(n):`` holds ``n`` SMs for the work enqueued on the current stream inside."""

    def __init__(self, n_sms: int, device=None, limit_s: float = 30.0):
        self.device = torch.device(device or "cuda")
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if not 0 < n_sms <= sms - 8:
            raise ValueError(f"n_sms must be in 1..{sms - 8} (the timed work needs SMs), got {n_sms}")
        self.n = int(n_sms)
        self.limit_ns = int(limit_s * 1e9)
        self.held = WARPS * 32 * KEEP  # floats the program keeps live (HOLD); its sums follow them in self.hold
        self.flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.hold = torch.zeros(self.held + self.n, dtype=torch.float32, device=self.device)
        self.sm_ids = torch.full((self.n,), -1, dtype=torch.int32, device=self.device)
        self.side = torch.cuda.Stream(self.device)
        self.regs = None

    def __enter__(self):
        main = torch.cuda.current_stream(self.device)
        self.flag.zero_()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            k = _occupy_kernel[(self.n,)](self.flag, self.hold, self.sm_ids, self.limit_ns, HOLD=self.held,
                                          num_warps=WARPS)
        self.regs = getattr(k, "n_regs", None)
        return self

    def __exit__(self, *exc):
        self.flag.fill_(1)  # on the timed stream, after its last event
        return False

    def report(self) -> dict:
        """After a device sync: programs, distinct SMs they ran on, registers per thread."""
        ids = self.sm_ids.tolist()
        return {"occupy_sms": self.n, "distinct_sms": len(set(ids) - {-1}), "regs": self.regs}
