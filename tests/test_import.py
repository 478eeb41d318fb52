"""Importing the package: fast, no CUDA initialisation, a clear warning when the kernel build is broken."""

from __future__ import annotations

import subprocess
import sys
import textwrap


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
