"""Test helpers: random cache contents and byte-exact comparisons with useful failures."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from kpool.layout import HEAD_DIM


def random_bytes_like(shape, device, seed: int) -> torch.Tensor:
    """A uint8 tensor of ``shape`` filled with reproducible random bytes (made on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, tuple(shape), generator=g, dtype=torch.uint8).to(device)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8)


def assert_bytes_equal(a: torch.Tensor, b: torch.Tensor, what: str, max_report: int = 8) -> None:
    """Assert ``a`` and ``b`` hold the same bytes; on failure name the first differing positions.

    Positions are byte offsets into the contiguous byte image plus, for uint8 tensors,
    the multi-dimensional index.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{what}: shape/dtype differ: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    ab, bb = _as_bytes(a), _as_bytes(b)
    diff = (ab != bb).nonzero().flatten()
    if diff.numel() == 0:
        return
    lines = []
    for off in diff[:max_report].tolist():
        where = f"byte {off}"
        if a.dtype == torch.uint8 and a.ndim > 1:
            idx, rem = [], off
            for size in reversed(a.shape):
                idx.append(rem % size)
                rem //= size
            where += f" index {tuple(reversed(idx))}"
        lines.append(f"  {where}: {int(ab[off])} != {int(bb[off])}")
    raise AssertionError(f"{what}: {diff.numel()} of {ab.numel()} bytes differ; first at\n" + "\n".join(lines))


def make_tail(num_blocks, ring, device, seed, block_pad=0, head_pad=0, fill=None):
    """Base bf16 buffer (random, or ``fill``) and a ``[num_blocks, 2, ring, 128]`` view with
    head stride ``(ring+head_pad)*128`` and block stride ``2*head + block_pad``, starting one
    block into the buffer (guard blocks before and after catch writes outside the view)."""
    head = (ring + head_pad) * HEAD_DIM
    block = 2 * head + block_pad
    n = (num_blocks + 2) * block  # one guard block before and after the view
    if fill is None:
        g = torch.Generator().manual_seed(seed)
        base = torch.randn(n, generator=g).to(torch.bfloat16)
    else:
        base = torch.full((n,), fill, dtype=torch.bfloat16)
    base = base.to(device)
    return base, view_tail(base, num_blocks, ring, block_pad, head_pad)


def view_tail(base, num_blocks, ring, block_pad=0, head_pad=0):
    """The ``[num_blocks, 2, ring, 128]`` ring view of ``make_tail``'s base buffer."""
    head = (ring + head_pad) * HEAD_DIM
    block = 2 * head + block_pad
    return torch.as_strided(base, (num_blocks, 2, ring, HEAD_DIM), (block, head, HEAD_DIM, 1), block)


def restride(t, dim, stride):
    """A view of ``t`` over its own storage with ``stride(dim)`` replaced (e.g. overlapping rows)."""
    strides = list(t.stride())
    strides[dim] = stride
    return torch.as_strided(t, t.shape, strides, t.storage_offset())


# rejection cases of the writers that take a tail ring (``tail_kv_cache`` argument): the
# [num_blocks, 2] rings of RING x 128 elements must not share memory
TAIL_OVERLAP_CASES = [
    ("tail-block-stride-0", lambda a, dv: {"tail_kv_cache": restride(a["tail_kv_cache"], 0, 0)}, ValueError,
     "tail_kv_cache.*overlap"),
    ("tail-head-stride-0", lambda a, dv: {"tail_kv_cache": restride(a["tail_kv_cache"], 1, 0)}, ValueError,
     "tail_kv_cache.*overlap"),
    ("tail-block-stride-one-ring", lambda a, dv: {  # block b's keys are block b-1's gates
        "tail_kv_cache": restride(a["tail_kv_cache"], 0, a["tail_kv_cache"].stride(1))}, ValueError,
     "tail_kv_cache.*overlap"),
]


def strided_copy(t, dim=-1):
    """Same values, stride 2 along ``dim`` (non-unit inner stride when dim=-1)."""
    shape = list(t.shape)
    shape[dim] *= 2
    big = torch.zeros(shape, dtype=t.dtype, device=t.device)
    idx = [slice(None)] * t.ndim
    idx[dim] = slice(None, None, 2)
    big[tuple(idx)] = t
    return big[tuple(idx)]


class GarbageTorch:
    """``torch`` whose ``empty`` fills int32 and uint8 tensors with 3, all others with ``2^62``: set as
    a module's ``torch`` (monkeypatch) so that the scratch it allocates starts as garbage."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, **kw):
        t = torch.empty(*shape, **kw)
        return t.fill_(3 if t.dtype in (torch.int32, torch.uint8) else 1 << 62)


class GuardedTorch(GarbageTorch):
    """``GarbageTorch`` whose ``empty`` tensors of ``n`` elements are followed in their storage by
    ``n + 1`` guard elements, garbage too: ``check`` asserts that no kernel wrote past the end of one."""

    def __init__(self):
        self.guards = []

    def empty(self, *shape, **kw):
        shape = torch.Size(shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)
        n = shape.numel()
        base = GarbageTorch.empty(2 * n + 1, **kw)
        self.guards.append((base[n:], base[n:].clone()))
        return base[:n].view(shape)

    def check(self, what):
        assert self.guards, f"{what}: nothing was allocated"
        for i, (guard, was) in enumerate(self.guards):
            assert_bytes_equal(guard, was, f"{what}: the guard after allocation {i}")


class ReadBacks(TorchFunctionMode):
    """Counts the tensor -> host reads (``tolist``, ``item``, ``bool``/``int`` of a tensor) made inside it."""
    READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def spy_launches(monkeypatch, module, kernel: str, arg: str) -> list:
    """Replace ``module.<kernel>`` (a ``@triton.jit`` function its launcher indexes with a grid)
    by one that records each launch's keyword ``arg`` and then launches: the list it fills."""
    real, seen = getattr(module, kernel), []

    class Spy:
        def __getitem__(self, grid):
            launch = real[grid]

            def run(*args, **kwargs):
                seen.append(kwargs[arg])
                return launch(*args, **kwargs)
            return run

    monkeypatch.setattr(module, kernel, Spy())
    return seen
