"""scripts/forward_protocol_check.py: the forward kernel's barrier protocol has no deadlock and no race in
any interleaving of its producer and consumers, and the check is not vacuous (it finds the deadlock and
the race that two plausible changes to the producer would bring)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("forward_protocol_check", ROOT / "scripts" / "forward_protocol_check.py")
protocol = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = protocol  # dataclasses look their module up
_spec.loader.exec_module(protocol)

TWO_WARPGROUPS = [cfg for cfg in protocol.KERNEL_CONFIGS if cfg.warpgroups == 2]


@pytest.mark.parametrize("cfg", TWO_WARPGROUPS, ids=str)
def test_two_warpgroup_kernels_never_deadlock_or_race(cfg):
    explored = 0
    for tiles in protocol.tile_sequences(cfg, quick=True):
        errors, states = protocol.explore(tiles, cfg)
        assert not errors, (tiles, errors)
        explored += states
    assert explored > 10_000  # interleavings, not one schedule


def test_three_warpgroup_kernel_never_deadlocks_or_races():
    (cfg,) = [cfg for cfg in protocol.KERNEL_CONFIGS if cfg.warpgroups == 3]
    for tiles in ([cfg.stages + 1, 0], [1, cfg.stages + 1]):  # the full set: `forward_protocol_check.py`
        errors, _ = protocol.explore(tiles, cfg)
        assert not errors, (tiles, errors)


@pytest.mark.parametrize("cfg", TWO_WARPGROUPS, ids=str)
def test_check_finds_the_deadlock_of_other_q_blocks_issued_after_every_key_block(cfg):
    """The second warpgroup needs its Q for its first S GEMM; the producer would wait for a stage that only
    that warpgroup can free."""
    def late(tiles, c):
        return protocol.producer_ops(tiles, c, other_q_after=10**6)

    errors, _ = protocol.explore([cfg.stages + 1], cfg, producer=late)
    assert errors and errors[0].startswith("deadlock"), errors


@pytest.mark.parametrize("cfg", TWO_WARPGROUPS, ids=str)
def test_check_finds_the_race_of_a_q_load_without_its_free_wait(cfg):
    def eager(tiles, c):
        return protocol.producer_ops(tiles, c, wait_q_free=False)

    errors, _ = protocol.explore([2, 2], cfg, producer=eager)
    assert errors and errors[0].startswith("race: a write into Q"), errors

