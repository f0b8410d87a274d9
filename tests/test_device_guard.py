"""Launches on the tensors' GPU, not the current one (``_backend.on_device_of``).

Triton launches a kernel on the current CUDA device; kpool's launchers switch to their
tensors' device for the call, as torch's own ops do. The switch is checked here with a stand-in
for ``torch.cuda`` (no second GPU needed), and every function of ``kpool.ops`` that chooses a
backend (all kernel launches go through one) is checked to carry the decorator.
"""

import ast
import contextlib
import inspect
import pkgutil
from types import SimpleNamespace

import pytest
import torch

import kpool.ops
from kpool import _backend


class _FakeCuda:
    """``current_device`` / ``device`` of a process whose current GPU is ``current``."""

    def __init__(self, current):
        self.current = current
        self.switches = []

    def current_device(self):
        return self.current

    @contextlib.contextmanager
    def device(self, index):
        self.switches.append(index)
        previous, self.current = self.current, index
        try:
            yield
        finally:
            self.current = previous


@pytest.fixture
def fake_cuda(monkeypatch):
    cuda = _FakeCuda(current=0)
    monkeypatch.setattr(torch.cuda, "current_device", cuda.current_device)
    monkeypatch.setattr(torch.cuda, "device", cuda.device)
    return cuda


def _launcher(cuda):
    @_backend.on_device_of("key")
    def launch(kv, key, *, scale=1):
        return cuda.current, scale
    return launch


def _tensor_on(device):
    return SimpleNamespace(device=torch.device(device))


@pytest.mark.parametrize("by_keyword", [False, True])
def test_switches_to_the_tensors_gpu(fake_cuda, by_keyword):
    launch = _launcher(fake_cuda)
    key = _tensor_on("cuda:1")
    ran_on = launch(None, key=key, scale=3) if by_keyword else launch(None, key, scale=3)
    assert ran_on == (1, 3)
    assert fake_cuda.switches == [1]
    assert fake_cuda.current == 0, "the caller's current device must be restored"


def test_switch_is_undone_when_the_launcher_raises(fake_cuda):
    @_backend.on_device_of("key")
    def launch(key):
        raise ValueError("bad key")

    with pytest.raises(ValueError, match="bad key"):
        launch(_tensor_on("cuda:2"))
    assert fake_cuda.switches == [2] and fake_cuda.current == 0


@pytest.mark.parametrize("key", [_tensor_on("cuda:0"), _tensor_on("cpu"), None, 7],
                         ids=["current-gpu", "cpu", "none", "not-a-tensor"])
def test_no_switch(fake_cuda, key):
    assert _launcher(fake_cuda)(None, key) == (0, 1)
    assert fake_cuda.switches == []


def test_cpu_tensors_never_ask_cuda(monkeypatch):
    """On a machine without CUDA, ``torch.cuda.current_device`` raises: CPU calls must not reach it."""
    def no_cuda():
        raise AssertionError("torch.cuda.current_device called for a CPU tensor")
    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    assert _launcher(SimpleNamespace(current="cpu"))(None, _tensor_on("cpu")) == ("cpu", 1)


def _backend_choosers():
    """``(module, function node)`` of every module-level function in ``kpool.ops`` that calls ``backend_for``."""
    for info in pkgutil.iter_modules(kpool.ops.__path__):
        module = __import__(f"kpool.ops.{info.name}", fromlist=["_"])
        tree = ast.parse(inspect.getsource(module))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(n, ast.Call) and getattr(n.func, "id", None) == "backend_for" for n in ast.walk(node)):
                yield module.__name__, node


def test_every_launcher_is_guarded():
    found = list(_backend_choosers())
    assert len(found) >= 17, [f"{m}.{n.name}" for m, n in found]
    for module, node in found:
        names = [d.args[0].value for d in node.decorator_list
                 if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "on_device_of"]
        params = [a.arg for a in node.args.args + node.args.kwonlyargs]
        assert len(names) == 1, f"{module}.{node.name} chooses a backend but has no @on_device_of(<tensor argument>)"
        assert names[0] in params, f"{module}.{node.name}: @on_device_of({names[0]!r}) names no parameter of it"
