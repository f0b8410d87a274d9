"""Shared test setup.

* Without a GPU, Triton kernels run in its CPU interpreter: ``TRITON_INTERPRET=1`` is the
  default (set here, before anything imports triton).
* Importing kpool makes the interpreter's float downcasts exact (``kpool._interpreter``);
  the setup asserts that it did.
* In the interpreter the scorers plan their smallest leaves (``topk.SMALLEST_LEAVES``), so
  that small cases run several leaves per row and the threshold selection.
* Fixtures: ``backend`` (``"torch"`` and ``"triton"``, set through ``KPOOL_BACKEND``) and
  ``device`` (``"cuda"`` when available, else ``"cpu"``).
"""

import os
import sys

import torch

HAS_GPU = torch.cuda.is_available()
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one core per xdist worker (CI has 2)
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

sys.path.insert(0, os.path.dirname(__file__))  # tests/_util.py

import pytest  # noqa: E402

import kpool  # noqa: E402,F401  (applies the interpreter fix on import)
from kpool import _backend, _interpreter  # noqa: E402

INTERPRETING = _backend.interpreting()
if INTERPRETING:
    assert _interpreter.fix_applied(), "kpool did not install its exact float converter in Triton's interpreter"
    from kpool.ops import topk
    topk.SMALLEST_LEAVES = True  # several leaves per row and the threshold selection, even in small cases

DEVICE = "cuda" if HAS_GPU else "cpu"
BACKENDS = ("torch", "triton")


def pytest_report_header(config):
    mode = "interpreter (TRITON_INTERPRET=1)" if INTERPRETING else "native"
    return f"kpool tests: device={DEVICE}, triton {mode}, exact interpreter downcasts: {_interpreter.fix_applied()}"


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Each public op under ``KPOOL_BACKEND=torch`` and ``KPOOL_BACKEND=triton``."""
    monkeypatch.setenv("KPOOL_BACKEND", request.param)
    return request.param


@pytest.fixture
def device():
    return DEVICE


def pytest_runtest_logreport(report):
    """With ``KPOOL_TEST_LOG=path``, append ``nodeid<TAB>phase<TAB>outcome<TAB>seconds`` per test
    as it finishes (its call, or a setup / teardown that did not pass), from the xdist
    controller only: a run stopped by a time limit still leaves the record of what ran
    (compare with ``pytest --collect-only -q``)."""
    path = os.environ.get("KPOOL_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or (report.when != "call" and report.passed):
        return
    with open(path, "a") as f:
        f.write(f"{report.nodeid}\t{report.when}\t{report.outcome}\t{report.duration:.2f}\n")
