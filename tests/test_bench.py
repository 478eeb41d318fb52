"""The benchmark's logic on the CPU: arguments, FLOPs, timing loop, checking, table, JSON and plot."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fa2_inductor import bench

TINY = ["--device", "cpu", "--tokens", "32", "--hidden", "16", "--seqlens", "8", "16", "--head-dims", "8"]
TINY += ["--dtypes", "bf16"]
FAST = ["--warmup", "1", "--reps", "2"]


def _run_main(argv):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = bench.main(argv)
    return status, stdout.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny CPU sweep shared by the tests that read its outputs."""
    out_dir = tmp_path_factory.mktemp("bench")
    argv = TINY + FAST + ["--json", str(out_dir / "r.json"), "--plot", str(out_dir / "r.png")]
    status, stdout = _run_main(argv)
    return status, stdout, out_dir


def _cell(causal=False, dtype="fp32"):
    return bench.Cell(dtype=dtype, causal=causal, head_dim=8, seqlen=16, batch=2, heads=2)


def _inputs(cell, count=2):
    return bench.random_input_sets(cell, torch.device("cpu"), count, seed=0)


# ---------------------------------------------------------------- FLOPs and shapes


def test_flops_count_both_matmuls_and_halve_for_causal():
    assert bench.attention_flops(2, 3, 5, 7, 11, causal=False) == 4 * 2 * 3 * 5 * 7 * 11
    assert bench.attention_flops(2, 3, 5, 7, 11, causal=True) == 2 * 2 * 3 * 5 * 7 * 11


def test_tflops_from_milliseconds():
    assert bench.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert bench.tflops(1e9, 1.0) == pytest.approx(1.0)


def test_paper_shapes_keep_tokens_and_hidden_fixed():
    cells = bench.sweep_cells([512, 16384], [64, 256], ["bf16"], [False])
    shapes = {(c.seqlen, c.head_dim): (c.batch, c.heads) for c in cells}
    assert shapes == {(512, 64): (32, 32), (16384, 64): (1, 32), (512, 256): (32, 8), (16384, 256): (1, 8)}
    # With batch·seqlen and heads·head_dim fixed, the work grows linearly in seqlen only.
    assert {c.flops / c.seqlen for c in cells} == {4 * 16384 * 2048}


def test_sweep_order_puts_seqlen_innermost():
    cells = bench.sweep_cells([1, 2], [8], ["bf16", "fp16"], [False, True], tokens=4, hidden=8)
    assert [(c.dtype, c.causal, c.seqlen) for c in cells][:4] == [
        ("bf16", False, 1), ("bf16", False, 2), ("bf16", True, 1), ("bf16", True, 2)
    ]


# ---------------------------------------------------------------- arguments


def test_default_arguments_are_the_full_sweep():
    args = bench.parse_args(["--device", "cuda"])
    assert args.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert args.head_dims == [64, 128, 256]
    assert args.dtypes == ["bf16", "fp16"]
    assert args.causal == "both"
    assert args.impls == ["fa2_inductor", "sdpa_flash", "sdpa_cudnn"]
    assert args.check is True
    assert (args.tokens, args.hidden) == (16384, 2048)


def test_quick_is_a_subset_and_explicit_flags_win():
    quick = bench.parse_args(["--device", "cuda", "--quick"])
    assert set(quick.seqlens) < set(bench.FULL_SWEEP["seqlens"])
    assert quick.reps < bench.FULL_SWEEP["reps"]
    overridden = bench.parse_args(["--device", "cuda", "--quick", "--seqlens", "2048", "--reps", "7"])
    assert (overridden.seqlens, overridden.reps) == ([2048], 7)
    assert overridden.head_dims == bench.QUICK_SWEEP["head_dims"]


def test_flags_are_parsed():
    args = bench.parse_args(
        ["--device", "cuda", "--causal", "yes", "--dtypes", "fp16", "--impls", "sdpa_flash", "inductor", "sdpa_flash",
         "--no-check", "--warmup", "0"]
    )
    assert bench.CAUSAL_CHOICES[args.causal] == (True,)
    assert args.dtypes == ["fp16"]
    assert args.impls == ["sdpa_flash", "inductor"]
    assert (args.check, args.warmup) == (False, 0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--head-dims", "512"],
        ["--reps", "0"],
        ["--seqlens", "0"],
        ["--dtypes", "int8"],
        ["--impls", "xformers"],
        ["--causal", "maybe"],
        ["--decode", "--contexts", "0"],
        ["--decode", "--batches", "-1"],
        ["--decode", "--peers", "sdpa_magic"],
        ["--decode", "--splits", "0"],
        ["--splits", "2"],
        ["--profile", "p.txt"],
        ["--backward", "--masks", "--profile", "p.txt"],
    ],
)
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda"] + argv)


def test_cpu_refuses_paper_sized_shapes(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu"])
    assert "tiny shapes" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--quick"], ["--masks"], ["--backward", "--masks"]],
                         ids=["sweep", "quick", "masks", "masked-training"])
def test_without_cuda_the_gpu_modes_say_so_in_one_line(monkeypatch, argv):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    message = str(exit_info.value.code)
    assert "\n" not in message and "needs a CUDA GPU" in message and bench.CPU_SMOKE_FLAGS in message


def test_the_cpu_smoke_flags_pass_the_cpu_shape_limit():
    args = bench.parse_args(bench.CPU_SMOKE_FLAGS.split())
    assert args.device == "cpu" and args.head_dims == [8, 16]


# ---------------------------------------------------------------- timing


def test_time_cpu_rotates_input_sets_through_warmup_and_reps():
    seen = []
    times = bench.time_cpu(seen.append, [("a",), ("b",), ("c",)], warmup=2, reps=4)
    assert seen == ["a", "b", "c", "a", "b", "c"]
    assert len(times) == 4 and all(t >= 0 for t in times)


def test_slow_calls_get_fewer_reps_within_the_budget():
    assert bench.affordable_counts(1.0, warmup=5, reps=20, budget_ms=2000) == (5, 20)
    warmup, reps = bench.affordable_counts(50.0, warmup=5, reps=20, budget_ms=500)
    assert (warmup, reps) == (2, 8)
    assert bench.affordable_counts(10_000.0, warmup=5, reps=20, budget_ms=2000) == (1, 3)
    assert bench.affordable_counts(10_000.0, warmup=0, reps=20, budget_ms=2000) == (0, 3)
    assert bench.affordable_counts(10_000.0, warmup=1, reps=2, budget_ms=2000) == (1, 2)


def test_time_cuda_brackets_each_call_with_events_after_a_sleep(monkeypatch):
    log = []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing
            self.index = None

        def record(self):
            self.index = len(log)
            log.append("record")

        def elapsed_time(self, end):
            return float(end.index - self.index)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append("sleep"))
    times = bench.time_cuda(log.append, [("a",), ("b",)], warmup=1, reps=2)
    assert log == ["a", "sync", "sleep", "record", "b", "record", "sleep", "record", "a", "record", "sync"]
    assert times == [2.0, 2.0]


def test_time_calls_uses_the_cpu_timer_on_cpu():
    calls = []
    times = bench.time_calls(lambda: calls.append(1), [()], torch.device("cpu"), warmup=1, reps=3)
    assert len(calls) == 4 and len(times) == 3


def test_calls_are_timed_in_turns_after_their_own_probe_and_warmup():
    log = []
    calls = {name: (lambda name: lambda arg: log.append(name + arg))(name) for name in ("a", "b", "c")}
    times = bench.time_in_turns(calls, [("0",), ("1",)], torch.device("cpu"), warmup=1, reps=3)
    probes_and_warmups = ["a0", "a0", "b0", "b0", "c0", "c0"]
    rounds = ["a1", "b1", "c1", "c0", "b0", "a0", "a1", "b1", "c1"]  # every other round reversed
    assert log == probes_and_warmups + rounds
    assert all(len(t) == 3 and min(t) >= 0 for t in times.values())


def test_a_call_that_fails_while_timed_leaves_the_turns_with_its_error():
    seen = []

    def flaky(arg):
        seen.append(arg)
        if len(seen) > 2:
            raise torch.cuda.OutOfMemoryError("out of memory")

    times = bench.time_in_turns({"flaky": flaky, "ok": lambda arg: None}, [("x",)], torch.device("cpu"), warmup=1, reps=4)
    assert isinstance(times["flaky"], torch.cuda.OutOfMemoryError) and len(seen) == 3
    assert len(times["ok"]) == 4


def test_medians_in_turns_keep_a_failure_and_every_median_raises_it():
    def fails():
        raise RuntimeError("no kernel")

    medians = bench.medians_in_turns({"ok": lambda: None, "bad": fails}, [()], torch.device("cpu"), warmup=1, reps=3)
    assert medians["ok"] >= 0 and isinstance(medians["bad"], RuntimeError)
    assert bench.every_median({"ok": 1.5}) == {"ok": 1.5}
    with pytest.raises(RuntimeError, match="no kernel"):
        bench.every_median(medians)


def test_a_backward_cell_checks_then_times_each_mode_in_turns(monkeypatch):
    """The backward sweep's cell on the CPU with stand-in implementations: a right one is timed in both modes,
    a wrong one is WRONG and untimed, one that does not run the cell is n/a; rows keep the --impls order."""
    from fa2_inductor.bench import backward

    def sdpa(q, k, v, causal, scale):
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    def unavailable(q, k, v, causal, scale):
        raise backward.NotAvailable("not this cell")

    forwards = {"right": sdpa, "wrong": lambda *a: (lambda f=sdpa(*a): lambda: 2 * f())(), "n/a": unavailable}
    monkeypatch.setattr(backward, "FORWARDS", forwards)
    args = argparse.Namespace(impls=["n/a", "wrong", "right"], seed=0, warmup=1, reps=3, profile=None)
    cell = bench.Cell("bf16", True, 16, 32, 1, 2)
    record = backward.measure_cell(cell, torch.device("cpu"), args)
    for mode in backward.MODES:
        rows = record["modes"][mode]
        assert list(rows) == ["n/a", "wrong", "right"]
        assert rows["n/a"] == {"status": "n/a", "reason": "not this cell"}
        assert rows["wrong"]["status"] == "WRONG" and "ms" not in rows["wrong"]
        assert rows["right"]["status"] == "ok" and rows["right"]["tflops"] > 0 and rows["right"]["max_abs_error"] < 0.05


def test_a_backward_cell_runs_fa2_per_tile_with_the_persistent_grid_off(monkeypatch):
    """fa2_per_tile's forward calls and its gradients (checked and timed) all run with the grid switched to one CTA
    per tile, and the switch is back on between them."""
    from fa2_inductor.bench import backward, implementations

    switched = []
    monkeypatch.setattr(implementations._extension, "C",
                        type("C", (), {"set_persistent_grid": staticmethod(switched.append)}))

    def sdpa(q, k, v, causal, scale):
        def forward():
            switched.append("forward")
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

        return forward

    monkeypatch.setattr(backward, "FORWARDS", {"fa2_per_tile": sdpa})
    args = argparse.Namespace(impls=["fa2_per_tile"], seed=0, warmup=1, reps=3, profile=None)
    record = backward.measure_cell(bench.Cell("bf16", False, 16, 32, 1, 2), torch.device("cpu"), args)
    assert all(record["modes"][mode]["fa2_per_tile"]["status"] == "ok" for mode in backward.MODES)
    off = False
    for event in switched:
        if event is False:
            assert not off
            off = True
        elif event is True:
            assert off
            off = False
        else:
            assert off, "a forward call ran on the persistent grid"
    assert not off and switched.count(False) > switched.count("forward")  # the bwd-only calls switch it too


def test_a_profiled_backward_cell_reports_the_backward_of_each_checked_implementation(monkeypatch, tmp_path):
    from fa2_inductor.bench import backward

    def sdpa(q, k, v, causal, scale):
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    monkeypatch.setattr(backward, "FORWARDS", {"right": sdpa, "wrong": lambda *a: (lambda f=sdpa(*a): lambda: 2 * f())()})
    report = tmp_path / "bwd.txt"
    assert bench.parse_args(["--device", "cuda", "--backward", "--profile", str(report)]).profile == report
    args = argparse.Namespace(impls=["wrong", "right"], seed=0, warmup=0, reps=1, profile=report)
    backward.measure_cell(bench.Cell("bf16", False, 16, 32, 1, 2), torch.device("cpu"), args)
    report = report.read_text()
    assert "== bf16 non-causal d16 seqlen 32 bwd right: profiled call" in report
    assert "wrong" not in report  # its gradients failed the check: neither timed nor profiled
    assert "autograd::engine::evaluate_function" in report or "aten::" in report


def test_mask_rows_time_ours_and_the_comparison_in_turns():
    from fa2_inductor.bench import masks

    rows = masks._MaskRows(argparse.Namespace(seed=0, tokens=64, hidden=128, reps=3, warmup=1), torch.device("cpu"))
    log = []
    ours_ms, other_ms = rows.pair(lambda: log.append("ours"), lambda: log.append("other"))
    assert ours_ms >= 0 and other_ms >= 0 and log.count("ours") == log.count("other") == 1 + rows.warmup + rows.reps

    def fails():
        raise RuntimeError("no kernel")

    with pytest.raises(RuntimeError, match="no kernel"):
        rows.pair(fails, lambda: None)


def test_one_cta_per_tile_switches_the_persistent_grid_off_for_the_call_only(monkeypatch):
    from fa2_inductor.bench import implementations

    switched = []
    monkeypatch.setattr(implementations._extension, "C",
                        type("C", (), {"set_persistent_grid": staticmethod(switched.append)}))
    assert implementations.one_cta_per_tile(lambda x: switched.append(x))("call") is None
    assert switched == [False, "call", True]

    def fails():
        raise RuntimeError("kernel error")

    with pytest.raises(RuntimeError, match="kernel error"):
        implementations.one_cta_per_tile(fails)()
    assert switched[-2:] == [False, True]  # restored all the same


def test_input_sets_outgrow_the_cache():
    assert bench.input_set_count(set_bytes=200 << 20, cache_bytes=50 << 20) == 2
    assert bench.input_set_count(set_bytes=10 << 20, cache_bytes=50 << 20) == 8
    assert bench.input_set_count(set_bytes=40 << 20, cache_bytes=50 << 20) == 5


def test_random_inputs_are_independent_normals():
    (q, k, v), (q2, _, _) = _inputs(_cell(dtype="bf16"))
    assert q.dtype == torch.bfloat16 and q.shape == (2, 2, 16, 8)
    assert not torch.equal(q, k) and not torch.equal(q, q2)
    assert 0.5 < q.float().std().item() < 1.5


# ---------------------------------------------------------------- checking and measuring


def test_compare_to_reference_uses_dtype_tolerance_and_rejects_nan():
    expected = torch.ones(4, dtype=torch.bfloat16)
    assert bench.compare_to_reference(expected + 0.03, expected)[1]
    error, within = bench.compare_to_reference(expected + 0.5, expected)
    assert error == pytest.approx(0.5) and not within
    assert not bench.compare_to_reference(torch.full_like(expected, math.nan), expected)[1]
    assert bench.compare_to_reference(expected[:2], expected) == (math.inf, False)


def _measure(name, cell, check=True, reps=2):
    input_sets = _inputs(cell)
    expected = bench.sdpa_reference(*input_sets[0], cell.causal, cell.head_dim**-0.5) if check else None
    return bench.measure_together([name], cell, input_sets, expected, torch.device("cpu"), warmup=1, reps=reps)[name]


@pytest.mark.parametrize("causal", [False, True])
def test_fa2_inductor_is_checked_then_timed(causal):
    m = _measure("fa2_inductor", _cell(causal))
    assert m.status == "ok"
    assert m.max_abs_error < 1e-5
    assert len(m.times_ms) == 2 and m.median_ms > 0
    assert m.tflops == pytest.approx(bench.tflops(_cell(causal).flops, m.median_ms))


def test_wrong_output_is_marked_and_never_timed(monkeypatch):
    calls = []

    def build_wrong(q, k, v, causal, scale):
        def call(q, k, v):
            calls.append(1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale) + 0.1

        return call

    monkeypatch.setitem(bench.IMPLEMENTATIONS, "fa2_inductor", build_wrong)
    m = _measure("fa2_inductor", _cell())
    assert m.status == "WRONG" and m.tflops is None and m.times_ms == []
    assert m.max_abs_error == pytest.approx(0.1, rel=1e-3)
    assert len(calls) == 1


def test_without_check_the_output_is_not_compared(monkeypatch):
    monkeypatch.setitem(bench.IMPLEMENTATIONS, "fa2_inductor", lambda q, k, v, causal, scale: lambda q, k, v: q * 0)
    m = _measure("fa2_inductor", _cell(), check=False)
    assert m.status == "ok" and m.max_abs_error is None


def test_a_backend_that_refuses_is_not_available_with_its_reason():
    m = _measure("sdpa_cudnn", _cell())  # no cuDNN attention on the CPU
    assert m.status == "n/a"
    assert "RuntimeError" in m.reason


def test_a_declining_builder_gives_its_own_reason(monkeypatch):
    def decline(q, k, v, causal, scale):
        raise bench.NotAvailable("head dim 8 is not compiled")

    monkeypatch.setitem(bench.IMPLEMENTATIONS, "fa2_inductor", decline)
    m = _measure("fa2_inductor", _cell())
    assert (m.status, m.reason) == ("n/a", "head dim 8 is not compiled")


def test_fa2_inductor_failing_is_an_error_not_a_refusal(monkeypatch):
    def crash(q, k, v):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(bench.IMPLEMENTATIONS, "fa2_inductor", lambda q, k, v, causal, scale: crash)
    m = _measure("fa2_inductor", _cell())
    assert m.status == "error" and "illegal memory access" in m.reason


@pytest.mark.parametrize("causal", [False, True])
def test_hand_written_attention_matches_sdpa(causal):
    q, k, v = _inputs(_cell(), count=1)[0]
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
    torch.testing.assert_close(bench.attention_by_hand(q, k, v, 0.3, causal), expected)


def test_ratios_and_row_text():
    ok = bench.Measurement("ok", median_ms=1.0, tflops=300.0)
    result = bench.CellResult(
        _cell(),
        {
            "fa2_inductor": bench.Measurement("ok", median_ms=1.0, tflops=600.0, max_abs_error=0.004),
            "sdpa_flash": ok,
            "sdpa_cudnn": bench.Measurement("n/a", reason="head dim"),
        },
    )
    assert result.ratios() == {"fa2/flash": 2.0}
    impls = ["fa2_inductor", "sdpa_flash", "sdpa_cudnn"]
    header = bench.table_header(impls, check=True).split()
    row = bench.table_row(result, impls, check=True).split()
    assert header == ["seqlen", "batch", "heads", *impls, "fa2/flash", "fa2/cudnn", "fa2", "max|err|"]
    assert row == ["16", "2", "2", "600.0", "300.0", "n/a", "2.00x", "-", "4.00e-03"]


def test_ratio_summary_gives_the_range_median_and_the_cells_below_one():
    def result(causal, seqlen, fa2_tflops):
        cell = bench.Cell(dtype="bf16", causal=causal, head_dim=64, seqlen=seqlen, batch=1, heads=1)
        measurements = {
            "fa2_inductor": bench.Measurement("ok", median_ms=1.0, tflops=fa2_tflops),
            "sdpa_flash": bench.Measurement("ok", median_ms=1.0, tflops=100.0),
            "sdpa_cudnn": bench.Measurement("n/a", reason="head dim"),
        }
        return bench.CellResult(cell, measurements)

    results = [result(False, 512, 90.0), result(False, 1024, 120.0), result(True, 512, 80.0), result(True, 1024, 95.0)]
    assert bench.ratio_summary(results, ["fa2_inductor", "sdpa_flash", "sdpa_cudnn"]) == [
        "fa2/flash: 0.80-1.20x over 4 cells (median 0.93x), below 1.0x in 3",
        "    bf16 non-causal d64: seqlen 512",
        "    bf16 causal d64: seqlen 512, 1024",
    ]
    assert bench.ratio_summary(results[1:2], ["fa2_inductor", "sdpa_flash"]) == [
        "fa2/flash: 1.20-1.20x over 1 cell (median 1.20x), below 1.0x in none"
    ]


def test_backward_summary_per_mode():
    from fa2_inductor.bench import backward

    cells = [bench.Cell(dtype="bf16", causal=True, head_dim=128, seqlen=s, batch=1, heads=1) for s in (512, 1024)]

    def row(tflops):
        return {"status": "ok", "tflops": tflops}

    records = [
        {"modes": {"fwd+bwd": {"fa2_inductor": row(90.0), "sdpa_cudnn": row(100.0)},
                   "bwd": {"fa2_inductor": row(110.0), "sdpa_cudnn": row(100.0)}}},
        {"modes": {"fwd+bwd": {"fa2_inductor": row(120.0), "sdpa_cudnn": row(100.0)},
                   "bwd": {"fa2_inductor": {"status": "WRONG"}, "sdpa_cudnn": row(100.0)}}},
    ]
    assert backward.mode_summaries(cells, records, ["fa2_inductor", "sdpa_cudnn"]) == [
        "fwd+bwd fa2/cudnn: 0.90-1.20x over 2 cells (median 1.05x), below 1.0x in 1",
        "    bf16 causal d128: seqlen 512",
        "bwd fa2/cudnn: 1.10-1.10x over 1 cell (median 1.10x), below 1.0x in none",
    ]


def test_no_ratios_when_fa2_did_not_run():
    measurements = {"fa2_inductor": bench.Measurement("WRONG"), "sdpa_flash": bench.Measurement("ok", 1.0, 1.0)}
    result = bench.CellResult(_cell(), measurements)
    assert result.ratios() == {}


# ---------------------------------------------------------------- a whole tiny run


def test_tiny_run_prints_the_table_progressively(tiny_run):
    status, stdout, _ = tiny_run
    assert status == 0
    assert "kernel: " in stdout
    assert stdout.count("bf16, non-causal, head dim 8") == 1 and stdout.count("bf16, causal, head dim 8") == 1
    assert "fa2/flash" in stdout and "fa2/cudnn" in stdout
    assert "[1/4," in stdout and "[4/4," in stdout
    assert "fa2/flash: " in stdout and " over 4 cells (median " in stdout  # the summary after the table
    assert stdout.count("note: sdpa_cudnn n/a") == 1  # the same reason is noted once, not per row


def test_tiny_run_writes_every_number_and_the_environment(tiny_run):
    _, _, out_dir = tiny_run
    document = json.loads((out_dir / "r.json").read_text())
    env = document["environment"]
    assert env["torch"] == torch.__version__ and env["kernel_loaded"] in (True, False) and env["kernel_status"]
    assert document["settings"]["impls"] == ["fa2_inductor", "sdpa_flash", "sdpa_cudnn"]
    results = document["results"]
    assert [(r["causal"], r["seqlen"]) for r in results] == [(False, 8), (False, 16), (True, 8), (True, 16)]
    for record in results:
        fa2, flash, cudnn = (record["measurements"][name] for name in document["settings"]["impls"])
        assert fa2["status"] == flash["status"] == "ok" and len(fa2["times_ms"]) == 2
        assert cudnn["status"] == "n/a" and cudnn["reason"]
        assert record["ratios"]["fa2/flash"] == pytest.approx(fa2["tflops"] / flash["tflops"])
        assert record["flops"] == bench.attention_flops(
            record["batch"], record["heads"], record["seqlen"], record["seqlen"], 8, record["causal"]
        )


def test_tiny_run_draws_the_plot(tiny_run):
    pytest.importorskip("matplotlib")
    _, stdout, out_dir = tiny_run
    assert (out_dir / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {out_dir / 'r.png'}" in stdout


def test_missing_matplotlib_is_said_and_not_fatal(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert bench.draw_plot([], ["fa2_inductor"], tmp_path / "p.png", "title") is False
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "p.png").exists()


def test_replot_redraws_from_the_json_alone(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    _, _, out_dir = tiny_run
    status, stdout = _run_main(["--replot", str(out_dir / "r.json"), "--plot", str(tmp_path / "again.png")])
    assert status == 0 and "again.png" in stdout
    assert (tmp_path / "again.png").stat().st_size > 1000


def test_a_wrong_cell_makes_the_exit_status_fail(monkeypatch, tmp_path):
    monkeypatch.setitem(bench.IMPLEMENTATIONS, "fa2_inductor", lambda q, k, v, causal, scale: lambda q, k, v: q + 1)
    argv = TINY + FAST + ["--seqlens", "8", "--causal", "no", "--impls", "fa2_inductor", "sdpa_flash",
                          "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]
    status, stdout = _run_main(argv)
    assert status == 1
    assert "WRONG" in stdout
    record = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert record["measurements"]["fa2_inductor"]["status"] == "WRONG" and record["ratios"] == {}


def test_mask_modes_default_to_their_own_seqlens():
    assert bench.parse_args(["--device", "cuda", "--backward", "--masks"]).seqlens == [2048, 8192]
    assert bench.parse_args(["--device", "cuda", "--backward", "--masks", "--seqlens", "4096"]).seqlens == [4096]
    assert bench.parse_args(["--device", "cuda", "--backward"]).seqlens == bench.FULL_SWEEP["seqlens"]
    assert bench.parse_args(["--device", "cuda", "--masks"]).seqlens == [1024, 2048, 4096, 8192]
    assert bench.parse_args(["--device", "cuda", "--masks", "--seqlens", "512"]).seqlens == [512]


def test_decode_split_rows_force_the_count_only_around_their_call(monkeypatch):
    from fa2_inductor.bench import decode

    seen = []
    monkeypatch.setattr(decode, "_ours", lambda *inputs: seen.append(os.environ.get(decode.SPLITS_VARIABLE)))
    monkeypatch.delenv(decode.SPLITS_VARIABLE, raising=False)
    decode._ours_with_splits(4)(None, None, None, None)
    assert seen == ["4"] and decode.SPLITS_VARIABLE not in os.environ
    monkeypatch.setenv(decode.SPLITS_VARIABLE, "2")
    decode._ours_with_splits(8)(None, None, None, None)
    assert seen == ["4", "8"] and os.environ[decode.SPLITS_VARIABLE] == "2"


def test_decode_cells_and_peers_default_to_the_full_table():
    from fa2_inductor.bench import decode

    args = bench.parse_args(["--device", "cuda", "--decode"])
    assert (args.contexts, args.batches, args.peers) == (list(decode.CONTEXTS), list(decode.BATCHES), list(decode.PEERS))
    assert args.splits == []
    chosen = bench.parse_args(["--device", "cuda", "--decode", "--contexts", "2048", "--batches", "1", "8",
                               "--peers", "sdpa_cudnn", "--splits", "1", "4"])
    assert (chosen.contexts, chosen.batches, chosen.peers, chosen.splits) == ([2048], [1, 8], ["sdpa_cudnn"], [1, 4])


def _visible_pairs(seqlen, lengths, window=None, causal=True):
    """Visible (query, key) pairs over the batch (one key length per sequence), counted row by row."""
    window = window or seqlen
    return sum(min(i + 1, window, length) if causal else length for length in lengths for i in range(seqlen))


def test_masked_training_rows_run_on_the_cpu(tmp_path):
    from fa2_inductor.bench import results

    path = tmp_path / "masked_backward.json"
    argv = ["--backward", "--masks", "--device", "cpu", "--tokens", "32", "--hidden", "16", "--seqlens", "8", "16",
            "--warmup", "0", "--reps", "1", "--json", str(path)]
    status, stdout = _run_main(argv)
    assert status == 0
    document = json.loads(path.read_text())
    rows = document["masked_backward"]
    assert [(r["mask"], r["seqlen"], r["batch"]) for r in rows] == [
        ("causal", 8, 4), ("sliding window 4", 8, 4), ("padding", 8, 4), ("padding + causal", 8, 4),
        ("causal", 16, 2), ("sliding window 8", 16, 2), ("padding", 16, 2), ("padding + causal", 16, 2)]
    for r in rows:
        seqlen, batch, lengths = r["seqlen"], r["batch"], r.get("key_lengths")
        if lengths is not None:
            assert len(lengths) == batch and all(seqlen / 2 <= n <= seqlen for n in lengths)
        full = [seqlen] * batch
        expected = {"causal": _visible_pairs(seqlen, full),
                    f"sliding window {seqlen // 2}": _visible_pairs(seqlen, full, window=seqlen // 2),
                    "padding": _visible_pairs(seqlen, lengths or full, causal=False),
                    "padding + causal": _visible_pairs(seqlen, lengths or full)}[r["mask"]]
        assert r["visible_pairs"] == expected
        assert r["visible_share"] == pytest.approx(expected / (batch * seqlen * seqlen))
        assert (r["heads"], r["head_dim"]) == (1, 128)
        assert r["flops"] == 3.5 * 4 * r["heads"] * expected * 128
        *ours, flex = r["measurements"]
        assert [m["impl"] for m in ours] == ["fa2_inductor"] * len(ours) and flex["impl"] == "flex"
        assert len(ours) == (2 if r["mask"] in ("causal", f"sliding window {seqlen // 2}") else 1)
        for m in ours:
            assert m["status"] == "ok" and m["ms"] > 0 and m["max_abs_error"] < 0.05
            assert m["tflops"] == pytest.approx(bench.tflops(r["flops"], m["ms"]))
            assert ("speedup_vs_flex" in m) == (flex["status"] == "ok")
        # Flex has no backward on the CPU in today's torch: its column is n/a, with the reason, never a crash.
        assert flex["status"] == "ok" or (flex["status"] == "n/a" and flex["reason"])
    assert "masked training" in stdout
    if rows[0]["measurements"][-1]["status"] == "n/a":
        assert stdout.count("note: flex n/a") == 1  # the same reason is noted once, not per row
    text = results.render([path])
    assert "## Masked training (`python -m fa2_inductor.bench --backward --masks`)" in text
    assert "| causal | 8 | 4 | 56.2% | fa2_inductor is_causal |" in text


def test_masked_training_adds_our_forms_one_cta_per_tile_when_asked(tmp_path):
    path = tmp_path / "masked_backward.json"
    argv = ["--backward", "--masks", "--device", "cpu", "--tokens", "16", "--hidden", "16", "--seqlens", "16",
            "--impls", "fa2_inductor", "fa2_per_tile", "--warmup", "0", "--reps", "1", "--json", str(path)]
    status, stdout = _run_main(argv)
    assert status == 0
    for r in json.loads(path.read_text())["masked_backward"]:
        *ours, flex = r["measurements"]
        forms = [m["form"] for m in ours if m["impl"] == "fa2_inductor"]
        assert [(m["impl"], m["form"]) for m in ours] == [("fa2_inductor", f) for f in forms] + [
            ("fa2_per_tile", f) for f in forms]
        assert all(m["status"] == "ok" and m["max_abs_error"] < 0.05 for m in ours) and flex["impl"] == "flex"
    assert "fa2_per_tile key mask [B,1,1,S]" in stdout


def test_masked_training_marks_wrong_gradients_and_fails(monkeypatch, tmp_path):
    from fa2_inductor.bench import masked_backward

    real = masked_backward.flash_attention
    monkeypatch.setattr(masked_backward, "flash_attention", lambda q, k, v, **kwargs: 2 * real(q, k, v, **kwargs))
    path = tmp_path / "masked_backward.json"
    argv = ["--backward", "--masks", "--device", "cpu", "--tokens", "16", "--hidden", "16", "--seqlens", "16",
            "--warmup", "0", "--reps", "1", "--json", str(path)]
    status, stdout = _run_main(argv)
    assert status == 1 and "WRONG" in stdout
    ours = [m for r in json.loads(path.read_text())["masked_backward"] for m in r["measurements"]
            if m["impl"] == "fa2_inductor"]
    assert len(ours) == 6 and all(m["status"] == "WRONG" and "ms" not in m for m in ours)


def test_end_to_end_benchmark_without_cuda_says_so_in_one_line(monkeypatch):
    from fa2_inductor import bench_e2e

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        bench_e2e.main([])
    message = str(exit_info.value.code)
    assert "\n" not in message and "needs a CUDA GPU" in message and "--tiny" in message


# ---------------------------------------------------------------- the results document

ROOT = Path(__file__).resolve().parents[1]


def _environment(**extra):
    return {"fa2_inductor": "0.1.0", "torch": "2.11.0", "cuda": "13.0", "gpu": "NVIDIA H200", "capability": "sm_90",
            "cudnn": 91900, "git_commit": "0123456789abcdef", "started_utc": "2026-11-30T15:00:00+00:00", **extra}


def test_results_document_has_a_section_per_benchmark_kind(tiny_run, tmp_path):
    from fa2_inductor.bench import results

    _, _, out_dir = tiny_run
    masks = {"environment": _environment(), "mask_rows": [
        {"row": "padding S=2048", "ours_ms": 0.265, "other": "ours no mask", "other_ms": 0.257, "speedup": 0.97,
         "prepass_ms": 0.003}]}
    e2e_result = {"phase": "prefill", "seqlen": 2048, "error": None, "counters": {}}
    e2e = {"environment": _environment(), "settings": {"reps": 10},
           "model": {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8, "num_hidden_layers": 4,
                     "dtype": "torch.bfloat16", "batch": 1},
           "results": [{**e2e_result, "variant": "sdpa + Inductor", "median_ms": 2.0},
                       {**e2e_result, "variant": "fa2_inductor (sdpa attn)", "median_ms": 1.6,
                        "counters": {"rewrites": 4, "rewrites:is_causal": 4}}]}
    check = {"environment": _environment(), "stages": [
        {"stage": "build", "status": "ok", "rc": 0, "wall_s": 70, "result": "ptxas: 48 kernels, 0 with spills"}]}
    paths = []
    for name, doc in (("masks", masks), ("e2e", e2e), ("check", check), ("other", {"something": 1})):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    text = results.render([out_dir / "r.json", *paths])

    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert [h.split(" (")[0] for h in headings] == [
        "## Build, tests and sanitizer", "## Forward kernel against SDPA", "## Masks", "## End to end"]
    assert "cuDNN 9.19.0" in text and "at commit 0123456789" in text and "2026-11-30 15:00:00 UTC" in text
    assert "| bf16 | 8 | no | 8 |" in text  # the tiny sweep's first cell
    assert "| padding S=2048 | 0.265 | ours no mask | 0.257 | 0.97 | 0.003 |" in text
    assert "| fa2_inductor (sdpa attn) | 1.60 | 1.25 | 4 is_causal |" in text
    assert "| build | ok | 0 | 70 | ptxas: 48 kernels, 0 with spills |" in text
    assert "Not a benchmark JSON this version reads: " in text and "other.json" in text


def test_results_backward_section_has_a_column_and_a_ratio_per_implementation_measured(tmp_path):
    from fa2_inductor.bench import results

    def timed(tflops):
        return {"status": "ok", "ms": 1.0, "tflops": tflops}

    record = {"dtype": "bf16", "causal": True, "head_dim": 128, "seqlen": 512, "batch": 32, "heads": 16,
              "modes": {"bwd": {"fa2_inductor": timed(300.0), "fa2_per_tile": timed(250.0),
                                "sdpa_cudnn": timed(200.0), "sdpa_flash": {"status": "failed: no kernel"}}}}
    doc = {"environment": _environment(), "backward": [record],
           "settings": {"impls": ["fa2_inductor", "fa2_per_tile", "sdpa_cudnn", "sdpa_flash"]}}
    path = tmp_path / "backward.json"
    path.write_text(json.dumps(doc))
    text = results.render([path])

    assert ("| dtype | mask | head dim | seqlen | mode | fa2_inductor | fa2_per_tile | sdpa_cudnn | sdpa_flash "
            "| fa2/fa2_per_tile | fa2/cudnn | fa2/flash |") in text
    assert "| bf16 | causal | 128 | 512 | bwd | 300.0 | 250.0 | 200.0 | - | 1.20 | 1.50 | - |" in text


def test_docs_results_is_regenerated_from_docs_measurements():
    from fa2_inductor.bench import results

    paths = sorted((ROOT / "docs" / "measurements").glob("*.json"))
    expected = results.render(paths, [p.relative_to(ROOT).as_posix() for p in paths])
    assert (ROOT / "docs" / "results.md").read_text() == expected, (
        "docs/results.md is stale: python -m fa2_inductor.bench.results docs/measurements/*.json > docs/results.md"
    )


def test_a_profiled_call_that_raises_leaves_its_reason_in_the_report(tmp_path):
    from fa2_inductor.bench.profiling import append_profile

    report = tmp_path / "profile.txt"

    def broken():
        raise RuntimeError("CUDA out of memory\nmore detail")

    assert append_profile(report, "prefill 16 sdpa", broken, torch.device("cpu")) is None
    assert append_profile(report, "prefill 16 eager", lambda: torch.ones(4).sum(), torch.device("cpu")) is not None
    text = report.read_text()
    assert "== prefill 16 sdpa: not profiled: RuntimeError: CUDA out of memory\n" in text
    assert "== prefill 16 eager: profiled call" in text and "aten::sum" in text


def test_a_documents_build_names_the_head_dims_with_kernels_of_their_own():
    from fa2_inductor.bench import results

    env = {"gpu": "NVIDIA H200", "capability": "sm_90", "torch": "2.11.0", "fa2_inductor": "0.1.0",
           "git_commit": "8e4df8f7189", "kernel_head_dims": [64, 96, 128], "started_utc": "2026-12-02T02:00:32+00:00"}
    line = results.measured_on(env, "x.json")
    assert "fa2_inductor 0.1.0 at commit 8e4df8f718 (kernels for head dims 64, 96, 128);" in line
    del env["kernel_head_dims"]  # documents written before the field existed
    assert "kernels for" not in results.measured_on(env, "x.json")
    env["git_dirty"] = True  # measured on a tree the commit does not name
    assert "at commit 8e4df8f718 with uncommitted changes;" in results.measured_on(env, "x.json")


def test_busy_time_is_the_union_of_the_kernels_intervals_not_their_sum():
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from fa2_inductor.bench.profiling import busy_ms

    def kernel(start_us, end_us):
        return FunctionEvent(id=0, name="k", thread=0, start_us=start_us, end_us=end_us,
                             device_type=DeviceType.CUDA).time_range

    # A preprocess, a main kernel launched as its dependent (starts 12 us before it ends) and a conversion
    # launched during the main kernel (waits inside it), then a gap and a kernel of 5 us.
    intervals = [kernel(1240, 1380), kernel(0, 100), kernel(88, 1320), kernel(1500, 1505)]
    assert busy_ms(intervals) == pytest.approx(1.385)
    assert busy_ms([kernel(10, 20), kernel(12, 15)]) == pytest.approx(0.010)  # one inside another
    assert busy_ms([]) == 0.0
