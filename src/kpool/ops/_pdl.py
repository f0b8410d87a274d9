"""Programmatic dependent launch (PDL, CUDA sm_90+): every kpool kernel is launched with
Triton's ``launch_pdl`` (``_backend.pdl_launch``) and waits for its predecessor in the stream
before its first load, so that a kernel's launch overlaps the run of the one before it
(H200, decode scoring chain, 1 request at 128K context: 25.0 -> 21.7 us per step). Each lets
the next kernel launch right after its wait, except the scoring leaves, which do after their
tile loop (``launch_dependents``). One exception to the wait-first rule: the decode update
called with ``metadata_ready`` loads its step's index tensors (the caller promises they were
written before the previous kernel) before it waits (``decode``).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def grid_dependency_sync(PDL: tl.constexpr):
    """A PDL kernel's wait, before its first load: wait until the previous kernel in the
    stream has completed and its writes are visible (``griddepcontrol.wait``), then let the
    next kernel launch (``griddepcontrol.launch_dependents``; its programs wait here in turn).
    Loads and stores follow the wait (the decode update's metadata loads may precede it), so kernels
    stay ordered as without PDL: what overlaps is a kernel's launch with its predecessor's run.
    No-op when ``PDL`` is False."""
    grid_dependency_wait(PDL)
    launch_dependents(PDL)


@triton.jit
def grid_dependency_wait(PDL: tl.constexpr):
    """The wait of ``grid_dependency_sync`` alone, for a kernel that lets the next one launch
    later (``launch_dependents``); a program that never calls that lets it at its exit.
    No-op when ``PDL`` is False."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel in the stream launch once every program of this one has passed
    here (``griddepcontrol.launch_dependents``); its programs then take SM room beside this
    kernel's. The scoring leaves (``score._paged_topk_kernel``) call it after their tile loop,
    not at their start: a one-wave leaf grid that fills the SMs' slots left the next kernel's
    programs only the few SMs it had left free, as we read the timings. No-op when ``PDL`` is
    False."""
    if PDL:
        gdc_launch_dependents()
