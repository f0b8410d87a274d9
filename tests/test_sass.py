"""``python -m kpool.sass``: one kernel specialisation's SASS summary, compiled on the CPU.

The compile runs in a subprocess with TRITON_INTERPRET off (this process may be
interpreting). The filtering leaf's check is the property ``logits.mma_dim_order`` exists
for: its loop reads the key codes from shared memory 16 bytes at a time, never 2.
"""

import os
import re
import subprocess
import sys

import pytest

from kpool import sass
from kpool.ops import decode, score

SNIPPET = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS.128 R4, [R2] ;
        /*0020*/                   HGMMA.64x32x16.F32 R24, R40, gdesc[UR36], RZ ;
        /*0030*/              @P0  BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/              @P5  BRA 0x10 ;
        /*0050*/                   STL [R1], R4 ;
        /*0060*/                   BRA 0x60 ;
        /*0070*/                   EXIT ;
"""


def test_loops_of_a_listing():
    """A backward branch makes a loop (its body from the target to the branch, predicates
    dropped from the opcodes); a branch to itself (the trailing trap) does not."""
    (lp,) = sass.loops(SNIPPET)
    assert (lp.start, lp.end, lp.instructions) == (0x10, 0x40, 4)
    assert lp.memory == {"LDS.128": 1, "HGMMA.64x32x16.F32": 1, "BAR.SYNC.DEFER_BLOCKING": 1}
    assert lp.opcodes["BRA"] == 1 and "@P5" not in lp.opcodes


def test_instructions_through_the_last_exit():
    """The count stops at the last EXIT (predicated or not): subroutines after it are not
    the kernel's path."""
    tail = "        /*0080*/                   MUFU.RCP R2, R3 ;\n        /*0090*/                   RET.REL.NODEC R4 0x0 ;\n"
    assert sass.to_last_exit(SNIPPET) == 8
    assert sass.to_last_exit(SNIPPET + tail) == 8
    assert sass.to_last_exit(SNIPPET.replace("EXIT ;", "@!P1 EXIT ;") + tail) == 8
    assert sass.to_last_exit("        /*0000*/                   NOP ;\n") == 1


def test_assignments():
    assert sass.parse_assignments("FILTER=True,H=32,ERROR=0.5,x=abc") == dict(FILTER=True, H=32, ERROR=0.5,
                                                                               x="abc")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        sass.parse_assignments("H32")


def run_tool(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "kpool.sass", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_filtering_leaf_reads_codes_128_bits_at_a_time():
    out = run_tool("_paged_topk_kernel", "--match", "FILTER=True,ROWS=1,FNUZ=False",
                   "--set", "H=32,NT=8,KB=512,PAGE=64,PRESHUFFLE=False,FINAL=False,STAGES=3",
                   "--maxnreg", str(score.max_regs(filtered=True)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "spill stores 0, spill loads 0" in out.stdout, out.stdout
    loops = [line for line in out.stdout.splitlines() if line.startswith("    memory / sync:") and "HGMMA" in line]
    assert loops, out.stdout
    assert "LDS.128" in loops[0] and "LDS.U16" not in loops[0] and "LDS.U8" not in loops[0], out.stdout
    assert "registers " in out.stdout and "cp.async.wait_group" in out.stdout


def test_bad_arguments_are_named():
    out = run_tool("_paged_topk_kernel", "--match", "FILTER=True", "--set", "NOPE=1")
    assert out.returncode != 0 and "NOPE" in out.stderr
    for target in ("gfx942", "sm_75"):
        out = run_tool("_paged_topk_kernel", "--target", target)
        assert out.returncode != 0 and "NVIDIA" in out.stderr and target in out.stderr


@pytest.mark.parametrize("nb", [1, 4])
@pytest.mark.parametrize("meta_first", [False, True])
def test_decode_metadata_loads_before_the_pdl_wait_only_when_ready(nb, meta_first, tmp_path):
    """``metadata_ready`` (``META_FIRST``): the step's index loads (positions, tail and pool
    slots: 3 for token 0, 3 more for the step's tile at NB > 1) are issued before
    ``griddepcontrol.wait`` (SASS ``ACQBULK``); without it no load precedes the wait."""
    out = run_tool("_decode_update_kernel", "--match", f"P=4,NB={nb}",
                   "--set", f"META_FIRST={meta_first},PDL=True", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    listing = (tmp_path / "_decode_update_kernel.sass").read_text()
    before_wait = listing[:listing.index("ACQBULK")]
    assert before_wait.count("LDG") == ((6 if nb > 1 else 3) if meta_first else 0), before_wait[-3000:]


# the first fma of every exp's Horner polynomial (``_jit.exp_exact``) carries this coefficient
EXP_MARK = "0.0096760317683219"


def _decode_listing(tmp_path, p, nb, walk_stash_first=False):
    out = run_tool("_decode_update_kernel", "--match", f"P={p},NB={nb}",
                   "--set", f"META_FIRST=True,PDL=True,WALK_STASH_FIRST={walk_stash_first}", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = (tmp_path / "_decode_update_kernel.sass").read_text().splitlines()
    exps = [i for i, line in enumerate(lines) if "FFMA" in line and EXP_MARK in line]
    assert exps, out.stdout
    return lines, exps, out.stdout


@pytest.mark.parametrize("p,nb", [(16, 2), (16, 4), (4, 4), (4, 8)])
def test_decode_stash_stores_around_the_pooling(p, nb, tmp_path):
    """A regular step's ring writes (the bf16 stash tile, ``STG.E.128``; the regular path is the
    listing's last): at ``P >= decode.STASH_FIRST_POOL`` the first tile store comes before the
    pooling's last exp; below, after the pooling's exps and before the rotation (the listing's
    last ``BAR.SYNC``)."""
    lines, exps, stdout = _decode_listing(tmp_path, p, nb)
    assert "num_warps=1" in stdout, stdout  # one warp stores a [NB, 128] bf16 tile 128 bits a thread
    bars = [i for i, line in enumerate(lines) if "BAR.SYNC" in line]
    tile_stores = [i for i, line in enumerate(lines) if "STG.E.128" in line]
    assert bars and tile_stores
    if p >= decode.STASH_FIRST_POOL:
        assert tile_stores[0] < exps[-1], "\n".join(lines[exps[-1] - 5:exps[-1] + 40])
    else:
        assert exps[-1] < tile_stores[0] < bars[-1], "\n".join(lines[tile_stores[0] - 40:tile_stores[0] + 2])


@pytest.mark.parametrize("p", [4, 16])
@pytest.mark.parametrize("stash_first", [False, True])
def test_decode_walk_stash_stores_around_the_pooling(p, stash_first, tmp_path):
    """One-token steps (the in-order walk): with ``WALK_STASH_FIRST`` the token's ring writes
    (key and gate rows: ``STG.E.64`` at one warp, ``STG.E.U16`` at four) come before its pool's
    first exp, else after its last."""
    lines, exps, _ = _decode_listing(tmp_path, p, 1, stash_first)
    stash = [i for i, line in enumerate(lines) if re.search(r"STG\.E\.(64|U16) ", line)]
    assert len(stash) == 2
    if stash_first:
        assert stash[-1] < exps[0], "\n".join(lines[stash[0] - 5:exps[0] + 2])
    else:
        assert exps[-1] < stash[0], "\n".join(lines[exps[-1] - 5:stash[0] + 2])
