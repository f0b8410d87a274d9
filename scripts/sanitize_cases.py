"""Small launches of every kernel, for `compute-sanitizer --tool memcheck python3 scripts/sanitize_cases.py`.

Each case uses padded strides, -1 sentinels and slots at the edges of the buffers, so an
out-of-bounds access shows up as a memcheck error. Prints one line per case.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

import kpool  # noqa: E402
from kpool.demo import run_demo  # noqa: E402


def main():
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    bf = lambda *s: torch.randn(*s, device=dev, generator=g).to(torch.bfloat16)  # noqa: E731
    for p in (4, 16):
        ape = torch.randn(p, 128, device=dev, generator=g)
        base = torch.zeros(5, 32 * 132 + 64, dtype=torch.uint8, device=dev)
        kv = base[:, : 32 * 132].view(5, 32, 132)  # padded page stride
        n = 9
        loc = torch.tensor([0, 159, -1, 31, 32, 100, -1, 64, 5][:n], device=dev)
        for layout in ("plain", "preshuffle"):
            kpool.kpool_compress_and_write_cache(kv, bf(n, p, 128), bf(n, p, 128), ape, loc, p, layout=layout)
        tail_base = torch.zeros(6, 2, 2 * p + 3, 128, dtype=torch.bfloat16, device=dev)
        tail = tail_base[:, :, : 2 * p]
        pos = torch.tensor([[-1, 2 * p - 1, 2 * p], [p - 1, p, -1], [0, 1, 2]], device=dev, dtype=torch.int32)
        ts = torch.where(pos >= 0, torch.tensor([[5], [0], [2]], device=dev) * 2 * p + pos % (2 * p), -1)
        sm = torch.where((pos >= 0) & ((pos + 1) % p == 0), torch.tensor([[159], [0], [3]], device=dev), -1)
        kpool.kpool_decode_update_and_maybe_write_cache_batched(kv, tail, ts, bf(3, 3, 128), bf(3, 3, 128), ape, sm,
                                                                pos, p)
        tslot = torch.tensor([0, 1, 2, -1, 5 * 2 * p + 7, 5 * 2 * p + 6], device=dev)
        kpool.kpool_seed_tail_cache(tail, bf(6, 128), bf(6, 128), tslot, p)
        print(f"P={p}: compress, decode, seed_tail ok", flush=True)
    ids = torch.randint(-1, 300, (7, 512), device=dev, generator=g)
    seq = torch.randint(-3, 2000, (7,), device=dev, generator=g)
    kpool.expand_pools_and_append_tail(ids, seq, 4)
    kpool.expand_pools_and_append_tail(ids, seq, 4, width=2176)
    pt = torch.randint(0, 1000, (7, 2100), device=dev, generator=g, dtype=torch.int32)
    kpool.expand_pools_to_tokens(ids, ids >= 0, 2048, 4, page_table=pt)
    kpool.append_tail_to_topk(torch.zeros(7, 2048, dtype=torch.int32, device=dev), seq, seq // 4, 4)
    kpool.build_pooled_page_table(pt[:, :2048], 4)
    print("select ops ok", flush=True)
    q8, qs = kpool.fwht128_quant_fp8(bf(5, 32, 128))
    print("quant ok", flush=True)
    run_demo(requests=3, max_prompt=300, decode_steps=6, device=dev, quiet=True)
    print("KPoolCache session ok", flush=True)
    torch.cuda.synchronize()
    print("SANITIZE CASES DONE")


if __name__ == "__main__":
    main()
