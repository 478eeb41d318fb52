"""scripts/backward_balance_model.py: the load-balance model behind design.md's reading of the masked
training table counts work as the kernel walks it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("backward_balance_model", ROOT / "scripts" / "backward_balance_model.py")
model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model)


def test_tile_work_follows_the_mask():
    causal = model.tile_work({"mask": "causal", "seqlen": 256, "batch": 1}, heads=2)
    assert causal == [4, 2, 4, 2]  # key tile j is seen by the query tiles from 2j on, per head
    padding = model.tile_work({"mask": "padding", "seqlen": 256, "batch": 2, "key_lengths": [128, 129]}, heads=1)
    assert padding == [4, 0, 4, 4]  # a key tile with no key inside the length costs nothing


def test_balance_of_the_three_launches():
    work = [3, 1] * 4  # a stride of 2 hands one SM every heavy tile
    assert model.static_stride(work, 2) == pytest.approx(1.5)
    assert model.first_free(work, 2) == pytest.approx(1.0)
    assert model.first_free([1, 1, 1, 3], 2) == pytest.approx(4 / 3)
    assert model.first_free(sorted([1, 1, 1, 3], reverse=True), 2) == pytest.approx(1.0)


def test_paired_slots_join_key_tiles_j_and_n_minus_1_minus_j_of_each_head():
    assert model.paired_slots([5, 4, 3, 2, 1, 9, 8, 7], key_tiles=4) == [7, 7, 8, 17]
    assert model.paired_slots([3, 2, 1], key_tiles=3) == [4, 2]  # an odd count: the middle tile alone
    causal = model.tile_work({"mask": "causal", "seqlen": 1024, "batch": 1}, heads=3)
    assert len(set(model.paired_slots(causal, key_tiles=8))) == 1  # causal pairs cost the same


def test_the_repository_table_runs(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["x", str(ROOT / "docs" / "measurements" / "masked_backward.json")])
    model.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["mask", "seqlen"] and len(lines) == 5
