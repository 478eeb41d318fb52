"""``python -m fa2_inductor.coverage``: real families through the real child processes (a small fixed
sample), the time-limit and crash paths with stand-in children, the verdicts, the JSON and the CLI.

The sweep over every family the installed transformers knows is the long test at the end.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import textwrap

import pytest

pytest.importorskip("transformers")

from fa2_inductor.coverage import __main__ as cli  # noqa: E402
from fa2_inductor.coverage import report, run  # noqa: E402
from fa2_inductor.coverage.results import TOLERANCE, Row, Status, family_status  # noqa: E402


def test_llama_sdpa_is_fully_rewritten_through_the_cli(tmp_path, capsys):
    path = tmp_path / "coverage.json"
    assert cli.main(["llama", "--impls", "sdpa", "--json", str(path)]) == 0
    (row,) = report.read_json(path)
    assert (row.family, row.implementation, row.model_class) == ("llama", "sdpa", "LlamaForCausalLM")
    assert row.status is Status.FULL and (row.sites_rewritten, row.sites_total) == (2, 2), row
    assert row.refusals == {} and row.max_abs_diff <= TOLERANCE["atol"]
    out, err = capsys.readouterr()
    assert "[1/1] llama: sdpa full" in err
    assert "1 of 1 families fully rewritten, logits equal to eager (100.0%)" in out
    assert json.loads(path.read_text())["summary"]["full"] == 1


def test_resume_keeps_the_rows_of_families_it_does_not_run(tmp_path):
    path = tmp_path / "coverage.json"
    other = Row("mistral", "sdpa", Status.FULL, "MistralForCausalLM", sites_rewritten=2, sites_total=2, max_abs_diff=0.0)
    report.write_json(path, [other], {"implementations": ["sdpa"], "timeout_s": 60.0, "complete": True})
    assert cli.main(["llama", "--impls", "sdpa", "--json", str(path), "--resume"]) == 0
    assert sorted(row.family for row in report.read_json(path)) == ["llama", "mistral"]
    assert json.loads(path.read_text())["summary"]["families"] == 2


def test_a_refused_family_shows_its_reason():
    """Longformer's sliding chunks are no attention the op computes: both sites recognised, both refused,
    logits still equal."""
    (row,) = run.run_family("longformer", ["eager"], timeout_s=600)
    assert row.status is Status.PARTIAL and (row.sites_rewritten, row.sites_total) == (0, 2), row
    assert row.refusals == {"unrecognised_scores": 2}
    assert row.max_abs_diff <= TOLERANCE["atol"]
    assert row.why() == "unrecognised_scores ×2"


def test_an_attention_free_model_and_an_unsupported_implementation_are_not_counted():
    rows = run.run_family("resnet", ["eager", "sdpa"], timeout_s=600)
    assert [row.status for row in rows] == [Status.ATTENTION_FREE, Status.NOT_SUPPORTED], rows
    assert report.summary(rows)["counted"] == 0


def test_a_model_whose_softmax_is_no_attention_is_not_counted():
    """MobileViTV2's separable attention weighs tokens by a softmax over a convolution's output (no q @ kᵀ):
    the pass sees every softmax and says so."""
    row, _ = run.run_family("mobilevitv2", ["eager", "sdpa"], timeout_s=600)
    assert row.status is Status.SOFTMAX_ONLY and row.sites_total == 0, row
    assert row.why() == ("softmax over no q·kᵀ scores: its input is computed by no product of two tensors "
                         "(it comes from aten.convolution.default)")
    assert report.summary([row])["counted"] == 0


def test_a_model_that_samples_is_compared_from_the_same_random_state():
    """ViT-MAE masks random patches in its forward: eager and compiled runs draw the same ones."""
    (row,) = run.run_family("vit_mae", ["sdpa"], timeout_s=600)
    assert row.status is Status.FULL and row.max_abs_diff <= TOLERANCE["atol"], row


def test_tiny_configs_keep_each_kind_of_layer_and_consistent_head_dims():
    from transformers import DeepseekV3Config, Gemma3TextConfig, Qwen3NextConfig

    from fa2_inductor.coverage import configs

    hybrid = configs.tiny_config(Qwen3NextConfig)  # three linear-attention layers to one full one
    assert hybrid.num_hidden_layers == 2 and hybrid.layer_types == ["linear_attention", "full_attention"]
    sliding = configs.tiny_config(Gemma3TextConfig)  # five sliding-window layers to one global one
    assert sliding.layer_types == ["sliding_attention", "full_attention"] and sliding.sliding_window < 12
    latent = configs.tiny_config(DeepseekV3Config)
    assert (latent.hidden_size, latent.num_hidden_layers, latent.n_routed_experts) == (64, 2, 4)
    assert latent.qk_head_dim == latent.qk_nope_head_dim + latent.qk_rope_head_dim


# Stand-in children: they write the markers ``measure`` writes, then hang or die where the test says.
_STAND_IN = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    family, folder, *implementations = sys.argv[1:]
    folder = Path(folder)
    (folder.parent / f"{family}.pid").write_text(str(os.getpid()))
    for implementation in implementations:
        (folder / f"{implementation}.started").touch()
        behaviour = BEHAVIOURS[f"{family}/{implementation}"]
        if behaviour == "hang_building":
            time.sleep(60)
        (folder / f"{implementation}.built").touch()
        if behaviour == "hang":
            time.sleep(60)
        if behaviour == "die":
            print("Segmentation fault (stand-in)", flush=True)
            sys.exit(139)
        row = {"family": family, "implementation": implementation, "status": "full", "sites_rewritten": 1,
               "sites_total": 1, "max_abs_diff": 0.0}
        (folder / f"{implementation}.json").write_text(json.dumps(row))
""")


def _stand_in_child(monkeypatch, tmp_path, behaviours: dict) -> None:
    """``behaviours``: "family/implementation" -> ok, hang, hang_building or die."""
    script = tmp_path / "child.py"
    script.write_text(_STAND_IN.replace("BEHAVIOURS", repr(behaviours)))
    monkeypatch.setattr(run, "CHILD_COMMAND", [sys.executable, str(script)])


def test_a_hang_after_the_build_is_a_timed_out_row_and_the_rest_still_runs(monkeypatch, tmp_path):
    _stand_in_child(monkeypatch, tmp_path, {"s/eager": "ok", "s/sdpa": "hang", "s/flex": "ok"})
    rows = run.run_family("s", ["eager", "sdpa", "flex"], timeout_s=2)
    assert [(row.implementation, row.status) for row in rows] == [
        ("eager", Status.FULL), ("sdpa", Status.TIMED_OUT), ("flex", Status.FULL)]
    assert rows[1].why() == "timed out"


def test_a_hang_while_building_is_a_build_failure(monkeypatch, tmp_path):
    _stand_in_child(monkeypatch, tmp_path, {"s/eager": "hang_building"})
    (row,) = run.run_family("s", ["eager"], timeout_s=2)
    assert row.status is Status.BUILD_FAILED and row.error == "timed out after 2 s"


def test_a_child_that_dies_is_a_crashed_row_with_its_last_words(monkeypatch, tmp_path):
    _stand_in_child(monkeypatch, tmp_path, {"s/eager": "die", "s/sdpa": "ok"})
    rows = run.run_family("s", ["eager", "sdpa"], timeout_s=60)
    assert [row.status for row in rows] == [Status.CRASHED, Status.FULL]
    assert rows[0].error == "the process died (exit code 139): Segmentation fault (stand-in)"


def test_an_interrupted_sweep_leaves_no_child_behind(monkeypatch, tmp_path):
    _stand_in_child(monkeypatch, tmp_path, {"fast/eager": "ok", "slow/eager": "hang"})
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the children's folders, and their pid files

    def interrupt(*_):  # Ctrl-C once "fast" is done, with "slow" running
        while not (tmp_path / "slow.pid").exists():
            time.sleep(0.05)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run.run_all(["fast", "slow"], ["eager"], timeout_s=60, jobs=2, on_family_done=interrupt)
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "slow.pid").read_text()), 0)


def _row(status: Status, implementation="eager", **fields) -> Row:
    return Row("f", implementation, status, **fields)


@pytest.mark.parametrize("statuses, verdict", [
    ((Status.FULL, Status.FULL), Status.FULL),
    ((Status.FULL, Status.PARTIAL), Status.PARTIAL),
    ((Status.PARTIAL, Status.LOGITS_DIFFER), Status.LOGITS_DIFFER),
    ((Status.FULL, Status.NOT_SUPPORTED), Status.FULL),
    ((Status.BUILD_FAILED, Status.FULL), Status.FULL),  # full wherever it builds
    ((Status.BUILD_FAILED, Status.NOT_SUPPORTED), Status.BUILD_FAILED),
    ((Status.NO_ATTENTION, Status.FULL), Status.NO_ATTENTION),
])
def test_a_family_is_as_good_as_its_worst_implementation_that_built(statuses, verdict):
    assert family_status([_row(s, impl) for s, impl in zip(statuses, ("eager", "sdpa"))]) is verdict


def test_attention_the_op_cannot_compute_is_listed_but_not_counted():
    """A family is beyond the op only where every refused site is one the op's input checks reject."""
    from fa2_inductor.coverage.measure import _refused_status

    assert _refused_status({"not_computable": 1}) is Status.BEYOND_OP
    assert _refused_status({"not_computable": 1, "softcap": 2}) is Status.PARTIAL
    rows = [Row("a", "eager", Status.FULL), Row("g", "eager", Status.BEYOND_OP, refusals={"not_computable": 1}),
            Row("g", "sdpa", Status.FULL)]
    line = report.summary_line(rows)
    assert line.startswith("1 of 1 families fully rewritten") and "1 beyond the op" in line
    assert "eager: not_computable ×1" in report.table(rows, ["eager", "sdpa"])


def test_summary_counts_families_and_leaves_out_what_could_not_be_built():
    rows = [Row("a", "eager", Status.FULL), Row("b", "eager", Status.PARTIAL, refusals={"softcap": 2}),
            Row("c", "eager", Status.BUILD_FAILED, error="ValueError: x"), Row("d", "eager", Status.NO_ATTENTION)]
    line = report.summary_line(rows)
    assert line.startswith("1 of 3 families fully rewritten, logits equal to eager (33.3%)")
    assert "1 partial" in line and "1 no attention" in line and "1 could not be built" in line
    table = report.table(rows, ["eager"])
    assert "eager: softcap ×2" in table and "eager: no attention found" in table
    assert "eager: build failed: ValueError: x" in table


def test_json_round_trips(tmp_path):
    rows = [Row("a", "sdpa", Status.PARTIAL, "AModel", 1, 2, {"softcap": 1}, 3e-7, "", "note", 1.5),
            Row("b", "eager", Status.TIMED_OUT, seconds=120.0)]
    report.write_json(tmp_path / "c.json", rows, {"timeout_s": 120.0})
    assert report.read_json(tmp_path / "c.json") == rows


@pytest.mark.parametrize("argv, message", [
    (["no_such_family"], "unknown families ['no_such_family']"),
    (["llama", "--impls", "flash"], "invalid choice: 'flash'"),
    (["llama", "--timeout-s", "0"], "--timeout-s must be > 0"),
    (["llama", "--jobs", "0"], "--jobs >= 1"),
])
def test_bad_arguments_are_clear_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("family, sites", [("longt5", 6), ("cvt", 13)])
def test_size_one_dims_that_einsum_moves_are_rewritten(family, sites):
    """LongT5's single block of local attention, CvT's single-head stage: einsum moves the size-1 dim out of
    the product's batch; every site is rewritten, the logits equal eager's."""
    (row,) = run.run_family(family, ["eager"], timeout_s=600)
    assert row.status is Status.FULL and (row.sites_rewritten, row.sites_total) == (sites, sites), row


@pytest.mark.slow
def test_every_installed_family(capsys):
    """The whole sweep (an hour or more on 2 cores): no family's compiled output differs from eager, none
    crashes, none with softmax or SDPA goes unrecognised, and >= 95% of the counted families are fully
    rewritten."""
    from fa2_inductor.coverage import models

    rows = run.run_all(models.families(), models.IMPLEMENTATIONS, timeout_s=300, jobs=os.cpu_count() or 1)
    print(report.table(rows, list(models.IMPLEMENTATIONS)))
    assert not report.defects(rows), [f"{row.family}/{row.implementation}: {row.why()}" for row in report.defects(rows)]
    numbers = report.summary(rows)
    assert numbers["full"] >= 0.95 * numbers["counted"], report.summary_line(rows)
