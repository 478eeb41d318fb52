"""The model zoo's plumbing (``bench_e2e --zoo --tiny``): a tiny left-padded Llama on CPU."""

import json

import pytest

pytest.importorskip("transformers")

from fa2_inductor import bench_e2e, config  # noqa: E402
from fa2_inductor.bench import zoo  # noqa: E402


def test_tiny_zoo_checks_times_and_counts_every_backend(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "rewrite_on_cpu", config.rewrite_on_cpu)  # --tiny turns it on
    out, report = tmp_path / "zoo.json", tmp_path / "profile.txt"
    bench_e2e.main(["--zoo", "--tiny", "--warmup", "0", "--reps", "2", "--json", str(out), "--profile", str(report)])
    doc = json.loads(out.read_text())
    runs = {(r["impl"], r["backend"]): r for r in doc["runs"]}
    assert set(runs) == {(impl, backend) for impl in ("sdpa", "eager") for backend in zoo.BACKENDS}
    profiled = report.read_text()
    for (impl, backend), run in runs.items():
        assert run["error"] is None and run["median_ms"] > 0, run
        assert run["max_abs_diff"] <= 0.05, run  # the zoo's models are bfloat16
        assert run["profile_wall_ms"] > 0 and run["profile_device_ms"] == 0, run  # CPU: no kernels
        assert f"{run['entry']} {impl} {backend}: profiled call" in profiled
    for impl in ("sdpa", "eager"):
        rewritten = runs[impl, "fa2_inductor"]["counters"]
        # its one layer, the tokenizer's left padding read as a key mask beside is_causal
        assert rewritten == {"rewrites": 1, "rewrites:is_causal+key_mask": 1}, rewritten
        assert runs[impl, "inductor"]["counters"] == {} and runs[impl, "eager"]["counters"] == {}
    (row, *_) = [r for r in doc["ratios"] if r["impl"] == "sdpa"]
    assert row["fa2_vs_inductor"] == pytest.approx(runs["sdpa", "fa2_inductor"]["median_ms"] / runs["sdpa", "inductor"]["median_ms"])
