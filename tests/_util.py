"""Test helpers: random cache contents and byte-exact comparisons with useful failures."""

from __future__ import annotations

import torch


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
