"""``python -m fa2_inductor.bench --overhead`` on the CPU: its logic (the numbers only mean something on a GPU)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from fa2_inductor import bench
from fa2_inductor.bench import overhead


@pytest.fixture
def short_bursts(monkeypatch):
    monkeypatch.setattr(overhead, "CALLS_PER_BURST", 3)


def test_per_call_times_are_medians_over_bursts_timed_in_turns(short_bursts):
    made = []
    fns = {name: (lambda name=name: made.append(name)) for name in ("a", "b", "c")}
    us = overhead.per_call_us_in_turns(fns, torch.device("cpu"), warmup=2, reps=3)
    assert set(us) == {"a", "b", "c"} and min(us.values()) > 0
    bursts = [made[i] for i in range(0, len(made), 3)]  # each burst is 3 calls of one function
    assert all(made[i:i + 3] == [bursts[i // 3]] * 3 for i in range(0, len(made), 3))
    assert bursts == ["a", "a", "b", "b", "c", "c"] + ["a", "b", "c"] + ["c", "b", "a"] + ["a", "b", "c"]


def test_overhead_run_prints_every_row_in_both_modes_and_writes_json(short_bursts, tmp_path):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = bench.main(["--overhead", "--device", "cpu", "--warmup", "0", "--reps", "2",
                             "--json", str(tmp_path / "o.json")])
    assert status == 0
    text = stdout.getvalue()
    for name in ("op: no mask", "op: key mask + causal", "op: key mask + causal, ALL_KEYS", "flash_attention(): no mask",
                 "sdpa: no mask", "sdpa: causal", "sdpa: dense mask"):
        assert f"\n{name} " in text, name
    assert "no_grad us" in text and "inference_mode us" in text
    assert "op: no mask / sdpa: no mask: no_grad " in text
    document = json.loads((tmp_path / "o.json").read_text())
    assert document["shape"] == {"batch": 1, "heads": 2, "seqlen": 128, "head_dim": 64, "dtype": "torch.bfloat16"}
    assert document["calls_per_burst"] == 3 and document["reps"] == 2
    assert len(document["rows"]) == 7
    assert all(set(row["us_per_call"]) == {"no_grad", "inference_mode"} and min(row["us_per_call"].values()) > 0
               for row in document["rows"])
