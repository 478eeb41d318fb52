"""The end-to-end benchmark's plumbing, on a tiny float32 model on CPU (``--tiny``)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import fa2_inductor  # noqa: E402
from fa2_inductor import bench_e2e  # noqa: E402


def test_tiny_run_checks_times_and_writes_every_variant(tmp_path, monkeypatch):
    out = tmp_path / "e2e.json"
    # --tiny turns config.rewrite_on_cpu on; monkeypatch puts it back for the other tests.
    monkeypatch.setattr(fa2_inductor.config, "rewrite_on_cpu", fa2_inductor.config.rewrite_on_cpu)
    with torch._inductor.config.patch(force_disable_caches=True):
        # Ours and uncompiled SDPA only: plain Inductor variants would add compiles and test nothing of ours.
        names = ["sdpa", "fa2_inductor (eager attn)", "fa2_inductor (sdpa attn)", "fa2_inductor interface"]
        argv = ["--tiny", "--seqlens", "16", "--warmup", "0", "--reps", "1", "--json", str(out), "--variants", *names]
        results = bench_e2e.main(argv)

    assert [(r.phase, r.variant) for r in results] == [(p, n) for p in bench_e2e.INFERENCE_PHASES for n in names]
    for r in results:
        assert r.error is None, f"{r.phase} {r.variant}: {r.error}"
        if r.phase == "generate":  # a time per new token; float32 greedy tokens as uncompiled SDPA's
            assert r.tokens_differing == 0 and r.median_ms is not None, r
        else:
            assert r.median_ms > 0 and r.max_abs_diff < 1e-4, r
    layers = bench_e2e.TINY_SHAPE["num_hidden_layers"]
    prefill_rewrites = {
        r.variant: r.rewrites for r in results if r.phase == "prefill" and r.variant.startswith("fa2_inductor (")
    }
    assert prefill_rewrites == {"fa2_inductor (eager attn)": layers, "fa2_inductor (sdpa attn)": layers}
    generate_rewrites = {  # the decode step transformers compiles with the variant's backend
        r.variant: r.rewrites for r in results if r.phase == "generate" and r.variant.startswith("fa2_inductor (")
    }
    assert generate_rewrites == {"fa2_inductor (eager attn)": layers, "fa2_inductor (sdpa attn)": layers}
    document = json.loads(out.read_text())
    assert len(document["results"]) == len(results) and document["model"]["num_hidden_layers"] == layers


def test_tiny_training_steps_check_loss_and_gradients(tmp_path, monkeypatch):
    out = tmp_path / "e2e_train.json"
    monkeypatch.setattr(fa2_inductor.config, "rewrite_on_cpu", fa2_inductor.config.rewrite_on_cpu)
    with torch._inductor.config.patch(force_disable_caches=True):
        # One compiled variant (each training compile costs ~10 s of CPU): the hand-written attention, whose
        # additive mask the pass must read in a joint graph; Llama's SDPA training is tests/test_hf_models.py's.
        names = ["sdpa", "fa2_inductor (eager attn)", "fa2_inductor interface"]
        argv = ["--tiny", "--phases", "train", "train_padded", "--seqlens", "16", "--warmup", "0", "--reps", "1",
                "--json", str(out), "--variants", *names]
        results = bench_e2e.main(argv)

    assert [(r.phase, r.variant) for r in results] == [(p, n) for p in bench_e2e.TRAINING_PHASES for n in names]
    for r in results:  # float32: the loss and the gradients as uncompiled SDPA's, up to rounding
        assert r.error is None, f"{r.phase} {r.variant}: {r.error}"
        assert r.median_ms > 0 and r.loss_diff < 1e-5 and r.grad_rel_diff < 1e-5, r
        assert r.max_abs_diff is None and r.reference_fallbacks == r.backward_fallbacks == 0, r
    layers = bench_e2e.TINY_SHAPE["num_hidden_layers"]
    # Both steps pass an attention_mask (all ones in "train"): under torch.compile transformers builds the mask
    # tensor, which the pass takes as causal + a key mask read at run time. Every site is rewritten in the
    # training graph: on CPU the op's backward is its reference by request (rewrite_on_cpu), so no backward rule
    # refuses; on CUDA a site whose backward would not run a fast kernel is refused (backward_unsupported).
    for r in results:
        if r.variant == "fa2_inductor (eager attn)":
            assert r.counters == {"rewrites": layers, "rewrites:is_causal+key_mask": layers}, r
        else:
            assert r.rewrites == 0, r
    document = json.loads(out.read_text())
    assert {r["phase"] for r in document["results"]} == set(bench_e2e.TRAINING_PHASES)
    assert all("grad_rel_diff" in r and "backward_fallbacks" in r for r in document["results"])


def test_generate_reuses_one_static_cache_per_model_reset_before_each_call():
    """A new cache per generate() call would move the CUDA graphs' static inputs (re-recorded in the timed calls);
    the reused one must be reset, or a second call would append to the first call's keys (and soon overflow)."""
    with torch.random.fork_rng(), torch.no_grad():  # build_model seeds the global generator
        workload = bench_e2e.Generation(bench_e2e.TINY_SHAPE, torch.float32, torch.device("cpu"), 12)
        model = bench_e2e.build_model(bench_e2e.TINY_SHAPE, "sdpa", torch.float32, torch.device("cpu"),
                                      12 + bench_e2e.GENERATED_TOKENS)
        first = workload.tokens(model, None, 4)
        cache = workload.caches[model]
        filled = int(cache.get_seq_length())
        second = workload.tokens(model, None, 4)
    assert workload.caches[model] is cache and len(workload.caches) == 1  # the reference model's is gone
    assert int(cache.get_seq_length()) == filled == 12 + 4 - 1  # each call starts from an empty cache
    assert torch.equal(first, second) and torch.equal(first, workload.reference[:, :4])


def test_a_run_cut_short_keeps_the_phases_it_finished(tmp_path, monkeypatch):
    """The JSON is rewritten after every phase and length: a run stopped (time limit, crash) in its second
    phase leaves the first one's results on disk."""
    out = tmp_path / "e2e.json"
    monkeypatch.setattr(fa2_inductor.config, "rewrite_on_cpu", fa2_inductor.config.rewrite_on_cpu)
    run_phase = bench_e2e.run_phase
    phases = []

    def run_then_stop(variants, workload, *args, **kwargs):
        phases.append(workload.phase)
        if len(phases) == 2:
            raise KeyboardInterrupt  # what a time limit's signal looks like to the loop
        return run_phase(variants, workload, *args, **kwargs)

    monkeypatch.setattr(bench_e2e, "run_phase", run_then_stop)
    argv = ["--tiny", "--phases", "prefill", "decode_dynamic", "--seqlens", "16", "--warmup", "0", "--reps", "1",
            "--json", str(out), "--variants", "eager", "sdpa"]
    with pytest.raises(KeyboardInterrupt):
        bench_e2e.main(argv)
    document = json.loads(out.read_text())
    assert phases == ["prefill", "decode_dynamic"]
    assert [(r["phase"], r["variant"]) for r in document["results"]] == [("prefill", "eager"), ("prefill", "sdpa")]
    assert all(r["median_ms"] > 0 for r in document["results"])


def test_the_variants_of_a_phase_are_timed_in_turns(monkeypatch):
    """Every variant is built and checked before any is timed, and the timing takes them all at once."""
    timed = []

    def record_turns(calls, device, *, warmup, reps):
        timed.append(list(calls))
        return {name: [1.0] for name in calls}

    monkeypatch.setattr(bench_e2e, "time_compiled_in_turns", record_turns)
    names = ["eager", "sdpa"]
    with torch.random.fork_rng():  # build_model seeds the global generator
        workload = bench_e2e.Workload("prefill", bench_e2e.TINY_SHAPE, torch.float32, torch.device("cpu"), 8)
        args = bench_e2e.parse_args(["--tiny"])
        results = bench_e2e.run_phase([v for v in bench_e2e.VARIANTS if v.name in names], workload,
                                      bench_e2e.TINY_SHAPE, torch.float32, torch.device("cpu"), args)
    assert timed == [names]
    assert [(r.variant, r.median_ms, r.error) for r in results] == [(n, 1.0, None) for n in names]
    assert all(r.max_abs_diff < 1e-5 for r in results)


def test_profile_reports_every_variant_after_its_timing(tmp_path, monkeypatch):
    out, report = tmp_path / "e2e.json", tmp_path / "profile.txt"
    monkeypatch.setattr(fa2_inductor.config, "rewrite_on_cpu", fa2_inductor.config.rewrite_on_cpu)
    names = ["sdpa", "fa2_inductor interface"]
    argv = ["--tiny", "--phases", "prefill", "--seqlens", "16", "--warmup", "0", "--reps", "1", "--json", str(out),
            "--profile", str(report), "--variants", *names]
    results = bench_e2e.main(argv)

    assert [r.variant for r in results] == names
    for r in results:  # on CPU the profiled call has no kernels
        assert r.error is None and r.profile_wall_ms > 0 and r.profile_device_ms == 0, r
    text = report.read_text()
    assert all(f"== prefill 16 {name}: profiled call" in text for name in names)
    assert "fa2_inductor::flash_attention_fwd" in text  # the op shows in the interface's table
    assert "GPU busy ms" in bench_e2e.format_table(results)
