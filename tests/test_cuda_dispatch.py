"""The op's CUDA dispatch as Python sets it up, without a GPU: which implementation is registered with and
without the compiled extension, the delegation of the support rules to it, the refusal of an out-of-date
build, and the reference fallback's counting and warning. (On a Hopper machine tests/gpu/test_dispatch.py
runs the extension itself.)

Each scenario runs in a fresh interpreter that controls what ``fa2_inductor._C`` is, so these tests hold
whether or not this machine has the extension built.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from fa2_inductor import _cuda, ops, reference
from fa2_inductor._extension import INTERFACE_VERSION

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for fa2_inductor._C: records what Python asks of it and, like csrc/api.cpp's TORCH_LIBRARY_IMPL,
# registers both ops' CUDA implementations when it loads. FUNCTIONS names what it provides.
FAKE_EXTENSION = """
import importlib.abc, importlib.machinery, sys, types
import torch

calls = []

def _record(name, result=None):
    def fn(*args):
        calls.append((name, args))
        return result
    return fn

def _cuda_impl(*args):
    raise AssertionError("no CUDA here")

class FakeLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return types.ModuleType(spec.name)
    def exec_module(self, module):
        every = {
            "compiled_kernels": _record("compiled_kernels", [(64, "bf16")]),
            "limits": _record("limits", {}),
            "kernel_unsupported_reason": _record("kernel_unsupported_reason", "a reason from C++"),
            "backward_kernel_unsupported_reason": _record("backward_kernel_unsupported_reason", "a backward reason"),
            "bwd": _record("bwd"),
            "forward": _record("forward"),
            "set_reference_hooks": _record("set_reference_hooks"),
            "fwd": _record("fwd"), "fwd_masked": _record("fwd_masked"), "fill_empty_rows": _record("fill_empty_rows"),
            "interface_version": lambda: INTERFACE_VERSION,
            "set_persistent_grid": _record("set_persistent_grid"),
        }
        for name in FUNCTIONS:
            setattr(module, name, every[name])
        if REGISTERS_CUDA:
            module.library = torch.library.Library("fa2_inductor", "IMPL")
            for name in ("flash_attention_fwd", "flash_attention_bwd"):
                module.library.impl(name, _cuda_impl, "CUDA")

class FakeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "fa2_inductor._C":
            return importlib.machinery.ModuleSpec(name, FakeLoader())

sys.meta_path.insert(0, FakeFinder())
"""

FULL = ("compiled_kernels", "limits", "kernel_unsupported_reason", "forward", "set_reference_hooks", "fwd",
        "fwd_masked", "fill_empty_rows", "interface_version", "set_persistent_grid", "bwd",
        "backward_kernel_unsupported_reason")



def _fake_extension(functions, registers_cuda, interface_version=INTERFACE_VERSION) -> str:
    """Scenario code that installs the stand-in with these functions and interface version."""
    return (f"FUNCTIONS = {functions!r}\nREGISTERS_CUDA = {registers_cuda}\nINTERFACE_VERSION = {interface_version}\n"
            + FAKE_EXTENSION)


CUDA_KERNEL_SOURCE = """
def cuda_kernel_source(op_name):
    dump = torch._C._dispatch_dump(f"fa2_inductor::{op_name}")
    return next(line for line in dump.splitlines() if line.startswith("CUDA:"))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def _assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok"), result.stdout + result.stderr


def test_without_the_extension_python_registers_both_cuda_kernels():
    result = _run(
        "import sys, torch\n" + CUDA_KERNEL_SOURCE + """
sys.modules["fa2_inductor._C"] = None  # as in a pure-Python install
import fa2_inductor
from fa2_inductor import _cuda, _extension, ops
assert _extension.C is None and "not built" in _extension.status
for name in ("flash_attention_fwd", "flash_attention_bwd"):
    assert "custom_ops.py" in cuda_kernel_source(name), cuda_kernel_source(name)
q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
assert _cuda.kernel_unsupported_reason(q, q, q, None, True) == _cuda.KERNEL_NOT_BUILT == "kernel not built"
print("ok")
"""
    )
    _assert_ok(result)


def test_with_the_extension_its_cuda_kernel_stays_and_python_delegates():
    result = _run(
        _fake_extension(FULL, registers_cuda=True) + CUDA_KERNEL_SOURCE + """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fa2_inductor
assert not [w for w in caught if "verrid" in str(w.message)], [str(w.message) for w in caught]  # no kernel replaced
from fa2_inductor import _cuda, _extension, reference
assert _extension.C is not None and _extension.status == "loaded"
# Both ops' CUDA kernels are the extension's.
for op_name in ("flash_attention_fwd", "flash_attention_bwd"):
    assert "custom_ops.py" not in cuda_kernel_source(op_name), cuda_kernel_source(op_name)
# The extension notifies Python of its fallbacks: the reference's (counted, announced) and the backward's (counted).
hooks = (_cuda.note_reference_fallback, _cuda.note_backward_fallback)
assert calls[-1] == ("set_reference_hooks", hooks), calls[-1]

# The support rules are asked with metadata: (sizes, strides, dtype, device, address or None).
q = torch.zeros(2, 8, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
kv = torch.zeros(2, 2, 8, 64, dtype=torch.bfloat16)
mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
assert _cuda.kernel_unsupported_reason(q, kv, kv, mask, True, 5) == "a reason from C++"
name, (q_meta, k_meta, v_meta, mask_meta, is_causal, window_left, softcap, has_sinks) = calls[-1]
assert name == "kernel_unsupported_reason"
assert q_meta == ((2, 4, 8, 64), (2048, 64, 256, 1), torch.bfloat16, torch.device("cpu"), q.data_ptr()), q_meta
assert mask_meta == ((2, 1, 1, 8), (8, 8, 8, 1), torch.bool, torch.device("cpu"), mask.data_ptr()), mask_meta
assert (is_causal, window_left, softcap, has_sinks) == (True, 5, 0.0, False)
_cuda.kernel_unsupported_reason(q, kv, kv, None, False, softcap=30.0, sinks=torch.zeros(4))
assert calls[-1][1][3] is None and calls[-1][1][5:] == (-1, 30.0, True)
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():
    fake = torch.empty(1, 2, 8, 64, dtype=torch.bfloat16, device="cuda")
    _cuda.kernel_unsupported_reason(fake, fake, fake, None, True)
assert calls[-1][1][0] == ((1, 2, 8, 64), (1024, 512, 64, 1), torch.bfloat16, torch.device("cuda:0"), None), calls[-1]

# The backward's rule too, with the deterministic mode the kernel would run in.
g = torch.zeros(2, 4, 8, 64, dtype=torch.bfloat16)
previous = torch.are_deterministic_algorithms_enabled()
try:
    torch.use_deterministic_algorithms(True)
    assert _cuda.backward_kernel_unsupported_reason(g, q, kv, kv, g, mask, True, False, 5, 30.0) == "a backward reason"
finally:
    torch.use_deterministic_algorithms(previous)
name, (g_meta, q_meta, _, _, out_meta, mask_meta, *flags) = calls[-1]
assert name == "backward_kernel_unsupported_reason"
assert g_meta == ((2, 4, 8, 64), (2048, 512, 64, 1), torch.bfloat16, torch.device("cpu"), g.data_ptr()), g_meta
assert q_meta[:2] == ((2, 4, 8, 64), (2048, 64, 256, 1)) and mask_meta[0] == (2, 1, 1, 8)
assert flags == [True, False, 5, 30.0, False, True], flags

# forward runs the extension's CUDA path with the op's arguments, in the binding's order.
out, lse = reference.empty_outputs(q, kv)
_cuda.forward(q, kv, kv, 0.5, True, out, lse, mask, 3, 2)
assert calls[-1] == ("forward", (q, kv, kv, out, lse, 0.5, True, mask, 3, 2, 0.0, None)), calls[-1]
print("ok")
"""
    )
    _assert_ok(result)


def test_an_extension_of_another_interface_version_is_refused():
    result = _run(
        _fake_extension(FULL, registers_cuda=False, interface_version=INTERFACE_VERSION - 1) + """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fa2_inductor
from fa2_inductor import _extension
assert _extension.C is None
assert f"out of date (interface {_extension.INTERFACE_VERSION - 1}, this package needs" in _extension.status
assert any(_extension.REBUILD_COMMAND in str(w.message) for w in caught)
print("ok")
"""
    )
    _assert_ok(result)


def test_an_out_of_date_extension_is_refused_with_the_rebuild_command():
    stale = tuple(name for name in FULL if name not in ("kernel_unsupported_reason", "set_reference_hooks"))
    result = _run(
        _fake_extension(stale, registers_cuda=False) + CUDA_KERNEL_SOURCE + """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fa2_inductor
from fa2_inductor import _cuda, _extension
assert _extension.C is None
assert "out of date (it lacks kernel_unsupported_reason, set_reference_hooks)" in _extension.status, _extension.status
messages = [str(w.message) for w in caught if "fa2_inductor._C" in str(w.message)]
assert len(messages) == 1 and _extension.REBUILD_COMMAND in messages[0], messages
assert "custom_ops.py" in cuda_kernel_source("flash_attention_fwd")
q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
assert _cuda.kernel_unsupported_reason(q, q, q, None, True) == "kernel not built"
print("ok")
"""
    )
    _assert_ok(result)


@pytest.fixture
def fresh_counters():
    saved = dict(counters["fa2_inductor"])
    counters["fa2_inductor"].clear()
    yield counters["fa2_inductor"]
    counters["fa2_inductor"].clear()
    counters["fa2_inductor"].update(saved)


def _qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 9, 16, generator=g)
    k, v = (torch.randn(1, 2, 11, 16, generator=g) for _ in range(2))
    mask = torch.rand(1, 1, 9, 11, generator=g) > 0.4
    return q, k, v, mask


def test_reference_fallback_counts_every_call_and_warns_once_per_reason(fresh_counters):
    q, k, v, mask = _qkv()
    with pytest.warns(UserWarning, match=r"CUDA call runs the \(slow\) reference implementation: reason A"):
        out, lse = _cuda.reference_fallback("reason A", q, k, v, mask, 0.3, True, 2, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _cuda.reference_fallback("reason A", q, k, v, mask, 0.3, True, 2, 1)
    with pytest.warns(UserWarning, match="reason B"):
        _cuda.reference_fallback("reason B", q, k, v, None, 0.3, False, -1, 0)
    assert dict(fresh_counters) == {"reference_fallback:reason A": 2, "reference_fallback:reason B": 1}
    expected_out, expected_lse = reference.empty_outputs(q, v)
    reference.attention_forward(q, k, v, mask, 0.3, True, expected_out, expected_lse, 2, 1)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    assert out.stride() == expected_out.stride()


def test_python_cuda_kernel_checks_inputs_then_falls_back_as_kernel_not_built(fresh_counters):
    """The CUDA implementation of an install without the extension (called here on CPU tensors)."""
    q, k, v, mask = _qkv()
    with pytest.raises(ValueError, match="window_left must be -1"):
        ops._flash_attention_fwd_cuda(q, k, v, mask, 0.3, False, 4, 0)
    assert not fresh_counters
    with pytest.warns(UserWarning, match="reference implementation: kernel not built"):
        out, _ = ops._flash_attention_fwd_cuda(q, k, v, mask, 0.3, True, -1, 2)
    assert fresh_counters["reference_fallback:kernel not built"] == 1
    assert torch.equal(out, reference.attention_reference(q, k, v, mask, 0.3, True, -1, 2)[0])


def test_note_backward_fallback_counts_without_warning(fresh_counters):
    """The extension's notice of a backward call its kernel does not run: PyTorch's flash backward is not slow, so
    only the reference's use is announced (through note_reference_fallback)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _cuda.note_backward_fallback("reason D")
        _cuda.note_backward_fallback("reason D")
    assert dict(fresh_counters) == {"backward_fallback:reason D": 2}


def test_backward_fallback_counts_and_runs_the_reference_off_cuda(fresh_counters):
    """The backward's fallback of an install without the extension: counted under backward_fallback:<reason>;
    off CUDA, PyTorch's flash backward cannot run, so the reference gives the op's outputs (counted, announced)."""
    q, k, v, mask = _qkv()
    additive = torch.where(mask, 0.0, -3.0)
    out, lse = reference.attention_reference(q, k, v, additive, 0.3, False)
    g = torch.randn_like(out)
    with pytest.warns(UserWarning, match="reference implementation: backward: reason C"):
        got = _cuda.backward_fallback("reason C", g, q, k, v, out, lse, additive, 0.3, False, True)
    want = reference.backward_outputs(g, q, k, v, out, lse, additive, 0.3, False, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[3].shape == additive.shape and got[4].numel() == 0
    assert dict(fresh_counters) == {"backward_fallback:reason C": 1, "reference_fallback:backward: reason C": 1}


def test_python_cuda_backward_falls_back_as_kernel_not_built(fresh_counters):
    """The backward's CUDA implementation of an install without the extension (called here on CPU tensors)."""
    q, k, v, mask = _qkv()
    out, lse = reference.attention_reference(q, k, v, mask, 0.3, True)
    g = torch.randn_like(out)
    with pytest.warns(UserWarning, match="reference implementation: backward: kernel not built"):
        got = ops._flash_attention_bwd_cuda(g, q, k, v, out, lse, mask, 0.3, True, False)
    want = reference.backward_outputs(g, q, k, v, out, lse, mask, 0.3, True, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert dict(fresh_counters) == {"backward_fallback:kernel not built": 1,
                                    "reference_fallback:backward: kernel not built": 1}

