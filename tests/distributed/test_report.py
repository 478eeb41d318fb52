"""The multi-GPU report reads the flows' and the benchmark's JSON, prints the tables and fails on a bad result
(checked here on made-up results: the real ones come from 2-GPU runs)."""

from __future__ import annotations

import json

from tests.distributed import report
from tests.distributed.llama_flows import ATTENTION_OPS, LAYERS


def _rank(**extra) -> dict:
    return {
        "counters": {"rewrites": LAYERS, "rewrites:is_causal": LAYERS},
        "op_calls": {op: LAYERS for op in ATTENTION_OPS},
        "dtype": "torch.bfloat16",
        **extra,
    }


def _write(folder, name, ranks, **extra):
    (folder / name).write_text(json.dumps({"world_size": len(ranks), "ranks": ranks, **extra}))


def _results(folder, two_gpu_losses):
    _write(folder, "fsdp2_1.json", [_rank(losses=[4.0, 3.0])])
    _write(folder, "fsdp2_2.json", [_rank(losses=two_gpu_losses)] * 2)
    tp_errors = {"logits": [0.010, 0.008], "grad lm_head.weight": [0.02, 0.012]}
    _write(folder, "tp_2.json", [_rank(errors=tp_errors, local_query_heads=2)] * 2)
    cp = {
        "world_size": 2,
        "config": {"heads": 16, "head_dim": 128, "accuracy_seq": 8192},
        "accuracy": {"out": {"ring": 0.004, "one_gpu": 0.004}},
        "speed": [
            {"seq": 32768, "ring_fa2_inductor_s": 0.1, "torch_cp_sdpa_s": 0.15, "torch_cp_error": None,
             "one_gpu_fa2_inductor_s": 0.18, "ring_vs_torch_cp_out_rel_diff": 0.003},
            {"seq": 65536, "ring_fa2_inductor_s": 0.3, "torch_cp_sdpa_s": None, "torch_cp_error": "RuntimeError: x",
             "one_gpu_fa2_inductor_s": 0.6, "ring_vs_torch_cp_out_rel_diff": None},
        ],
    }
    (folder / "cp_2.json").write_text(json.dumps(cp))


def test_good_results_pass_and_print_every_table(tmp_path, capsys):
    _results(tmp_path, two_gpu_losses=[4.01, 3.02])
    assert report.main(str(tmp_path)) == 0
    printed = capsys.readouterr().out
    for needle in ("1 rank | 2 ranks", "rank 1: counters", "compiled TP (ours)", "327,680", "failed: RuntimeError: x",
                   "all checks passed"):
        assert needle in printed, needle


def test_a_diverging_loss_fails(tmp_path, capsys):
    _results(tmp_path, two_gpu_losses=[4.0, 3.5])
    assert report.main(str(tmp_path)) == 1
    assert "step 1: loss 3.5 on 2 ranks vs 3.0 on 1" in capsys.readouterr().out


def test_an_inaccurate_ring_fails(tmp_path, capsys):
    _results(tmp_path, two_gpu_losses=[4.0, 3.0])
    cp = json.loads((tmp_path / "cp_2.json").read_text())
    cp["accuracy"]["dq"] = {"ring": 0.05, "one_gpu": 0.01}
    (tmp_path / "cp_2.json").write_text(json.dumps(cp))
    assert report.main(str(tmp_path)) == 1
    assert "CP (cp_2.json): dq: ring error 0.05" in capsys.readouterr().out


def test_a_missing_rewrite_fails():
    ranks = [_rank(losses=[1.0]), _rank(losses=[1.0])]
    ranks[1] = {**ranks[1], "op_calls": {ATTENTION_OPS[0]: LAYERS, "aten::_scaled_dot_product_flash_attention": 1}}
    problems = report.rewrite_problems({"ranks": ranks})
    assert len(problems) == 1 and problems[0].startswith("rank 1:")
