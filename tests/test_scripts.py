"""The Hopper check's plumbing: the ptxas report, and a run of scripts/hopper_check.sh where no GPU is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PTXAS_LOG = """\
ptxas info    : Compiling entry function '_Z4kernILi64EEvPf' for 'sm_90a'
ptxas info    : Function properties for _Z4kernILi64EEvPf
    144 bytes stack frame, 144 bytes spill stores, 144 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 144 bytes cumulative stack size
ptxas warning : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized
ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program dependence on compiler-inserted WG.AR in divergent path in the function '_Z4kernILi64EEvPf'
ptxas info    : Compiling entry function '_Z4kernILi4EEvPf' for 'sm_90a'
ptxas info    : Function properties for _Z4kernILi4EEvPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
"""


def test_ptxas_report_counts_entries_spills_and_serialised_wgmma(tmp_path):
    log = tmp_path / "build.log"
    log.write_text(PTXAS_LOG)
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "ptxas_report.py"), str(log)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "ptxas: 2 kernel entries, 1 with spills, 2 wgmma serialisation warnings, 32-168 registers"
    assert any(line.split()[:4] == ["32", "144", "144", "144"] for line in lines)
    assert any(line.split()[:4] == ["168", "0", "0", "0"] for line in lines)


@pytest.mark.slow
def test_hopper_check_writes_its_summary_where_there_is_no_gpu(tmp_path):
    env = {**os.environ, "STAGES": "env,gpu-tests,report", "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "hopper_check.sh"), str(tmp_path / "results")],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr  # a failing stage never fails the run
    results = tmp_path / "results"
    stages = json.loads((results / "summary.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["env", "gpu-tests", "report"]
    assert all(s["status"] in ("ok", "FAILED") and s["wall_s"] for s in stages)
    summary = (results / "summary.md").read_text()
    assert "| stage | status | rc | wall s | result |" in summary and "| report | ok |" in summary
    assert (results / "results.md").read_text().startswith("# Measured results")


def test_ncu_stage_profiles_each_cell_with_its_flags(tmp_path):
    """The ncu stage's plumbing, with a stand-in `ncu` that prints its arguments: one report per cell of
    NCU_CELLS, the cell's flags passed to scripts/attention_cell.py (a backward cell's kernels are the
    backward's), and the count in the summary."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ncu"
    fake.write_text('#!/usr/bin/env bash\necho "ncu $*"\n')
    fake.chmod(0o755)
    env = {**os.environ, "STAGES": "ncu", "PYTHON": sys.executable, "NCU_CELLS": "64:512:causal 192:2048:full 128:2048:full:backward",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "hopper_check.sh"), str(tmp_path / "results")],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    results = tmp_path / "results"
    causal = (results / "ncu_d64_s512_causal.txt").read_text()
    full = (results / "ncu_d192_s2048_full.txt").read_text()
    assert "--launch-skip 2 --launch-count 4" in causal
    assert causal.rstrip().endswith("scripts/attention_cell.py --head-dim 64 --seqlen 512 --causal")
    assert full.rstrip().endswith("scripts/attention_cell.py --head-dim 192 --seqlen 2048")
    assert "regex:fwd_kernel|fprop" in causal
    backward = (results / "ncu_d128_s2048_full_backward.txt").read_text()
    assert "regex:bwd_kernel_sm90|bprop" in backward
    assert backward.rstrip().endswith("scripts/attention_cell.py --head-dim 128 --seqlen 2048 --backward")
    (stage,) = json.loads((results / "summary.json").read_text())["stages"]
    assert stage["status"] == "ok" and stage["result"] == "3 cells profiled (ncu_*.txt)"


def test_attention_cell_needs_a_gpu_and_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run the kernels")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "attention_cell.py"), "--head-dim", "64",
                             "--seqlen", "512", "--causal", "--backward"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2, result.stderr
    assert result.stdout.strip() == "attention_cell.py needs a CUDA GPU (it runs the kernels to be profiled)"


def test_host_code_check_says_why_it_skips_a_cpu_torch():
    """CI's torch is a CPU build: the check has no c10/cuda headers to compile against and says so, exit 0. With
    a CUDA wheel (bash scripts/test_on_torch.sh 2.11.0) it compiles csrc/api.cpp."""
    import torch

    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch: the check compiles, which test_on_torch.sh runs")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_host_code.py")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"skipped: torch {torch.__version__} is a CPU build (no c10/cuda headers)"
