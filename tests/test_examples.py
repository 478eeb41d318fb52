"""The examples a user copies from must run as shipped (CPU: the reference path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# benchmark_hf_model.py is bench_e2e's command line; tests/test_hf_bench_e2e.py runs that (tiny).
QUICK_EXAMPLES = ["call_op_directly.py", "compile_hf_model.py", "hf_attention_interface.py"]


@pytest.mark.parametrize("script", QUICK_EXAMPLES)
def test_example_runs(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]  # each example asserts its own result
    assert result.stdout.strip(), "the example printed nothing"
