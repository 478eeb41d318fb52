"""The examples a user copies from must run as shipped (CPU: the reference path)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# benchmark_hf_model.py is bench_e2e's command line; tests/test_hf_bench_e2e.py runs that (tiny).
# compile_hf_model.py runs twice in its own test below.
QUICK_EXAMPLES = ["call_op_directly.py", "hf_attention_interface.py"]
# Runs an example, then says whether Inductor's FX-graph cache served its compile.
_RUN_AND_REPORT_CACHE = (
    "import runpy, sys; from torch._dynamo.utils import counters; sys.argv = [sys.argv[1]]; "
    "runpy.run_path(sys.argv[0], run_name='__main__'); "
    "print('fxgraph_cache_hit', counters['inductor']['fxgraph_cache_hit'])"
)


def _run(script: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-c", _RUN_AND_REPORT_CACHE, str(ROOT / "examples" / script)]
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]  # each example asserts its own result
    return result


@pytest.mark.parametrize("script", QUICK_EXAMPLES)
def test_example_runs(script, tmp_path):
    assert _run(script, tmp_path).stdout.strip(), "the example printed nothing"


def _sites_the_example_should_rewrite() -> int:
    """compile_hf_model.py's two layers: rewritten on CPU (it turns on rewrite_on_cpu) and where the kernel
    runs its bf16 head-dim-128 attention; elsewhere on CUDA the pass leaves attention to Inductor."""
    if not torch.cuda.is_available():
        return 2
    from fa2_inductor._cuda import kernel_unsupported_reason

    probe = torch.empty(2, 4, 256, 128, dtype=torch.bfloat16, device="cuda")
    return 2 if kernel_unsupported_reason(probe, probe, probe, None, True) is None else 0


def test_compile_example_counts_its_sites_on_a_cached_run_too(tmp_path):
    """The second run's compile comes from Inductor's cache; its report must still count what the graph holds."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor_cache"), "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "0",
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    expected = _sites_the_example_should_rewrite()
    for run in ("cold", "cached"):
        stdout = _run("compile_hf_model.py", tmp_path, env).stdout
        rewritten = re.search(r"attention sites rewritten: (\d+) of 2", stdout)
        assert rewritten and int(rewritten[1]) == expected, f"{run} run:\n{stdout}"
        hits = int(re.search(r"fxgraph_cache_hit (\d+)", stdout)[1])
        assert (hits > 0) == (run == "cached"), f"{run} run: {hits} FX-graph cache hits"
