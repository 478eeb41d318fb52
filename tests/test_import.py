"""Importing the package: fast, no CUDA initialisation, a clear warning when the kernel build is broken."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_import_does_not_initialise_cuda():
    result = _run(
        """
        import torch, fa2_inductor
        assert not torch.cuda.is_initialized()
        q = torch.randn(1, 2, 4, 8)
        fa2_inductor.flash_attention(q, q, q)
        assert not torch.cuda.is_initialized()
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_broken_extension_warns_once_and_falls_back():
    # A finder that makes `fa2_inductor._C` exist but fail to load, as a build for another torch does.
    result = _run(
        """
        import importlib.abc, importlib.machinery, sys, warnings
        class BrokenLoader(importlib.abc.Loader):
            def create_module(self, spec):
                raise ImportError("_C.so: undefined symbol: _ZN3c104cuda")
            def exec_module(self, module):
                pass
        class BrokenFinder(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "fa2_inductor._C":
                    return importlib.machinery.ModuleSpec(name, BrokenLoader())
        sys.meta_path.insert(0, BrokenFinder())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import fa2_inductor
            import fa2_inductor.ops
        messages = [str(w.message) for w in caught if "fa2_inductor._C" in str(w.message)]
        assert len(messages) == 1, messages
        assert "undefined symbol" in messages[0] and "--no-build-isolation" in messages[0], messages[0]
        import torch
        q = torch.randn(1, 2, 4, 8)
        assert fa2_inductor.flash_attention(q, q, q).shape == q.shape
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_info_reports_the_kernel_state():
    result = subprocess.run([sys.executable, "-m", "fa2_inductor.info"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch " in result.stdout and "kernel:" in result.stdout


def _warnings_on_import(cuda_version: str | None, nvml_device_count: int) -> list[str]:
    """The kernel warnings ``import fa2_inductor`` gives on a pure-Python install, as seen on a machine with
    the given torch CUDA version and NVML device count (-1: no driver)."""
    result = _run(
        f"""
        import warnings, torch
        torch.version.cuda = {cuda_version!r}
        torch.cuda._device_count_nvml = lambda: {nvml_device_count}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import fa2_inductor
        from fa2_inductor import _extension
        assert _extension.C is None, "this test needs a pure-Python install"
        assert not torch.cuda.is_initialized()
        print([str(w.message) for w in caught if "fa2_inductor._C" in str(w.message)])
        """
    )
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip())


def test_missing_kernel_is_said_only_where_a_cuda_device_exists():
    from fa2_inductor import _extension

    if _extension.C is not None:
        pytest.skip("the kernel is built here")
    assert _warnings_on_import(None, 0) == []  # CPU build of torch
    assert _warnings_on_import("13.0", -1) == []  # CUDA build of torch, no driver
    assert _warnings_on_import("13.0", 0) == []  # driver, no device
    [message] = _warnings_on_import("13.0", 1)
    assert "not built" in message and "FA2_INDUCTOR_BUILD_CUDA=1" in message
