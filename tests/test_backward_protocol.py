"""scripts/backward_protocol_check.py: the backward kernel's barrier protocol over a persistent CTA's key tiles
has no deadlock, no race, no stale K/V phase and no named barrier left with arrivals, in any interleaving of
its producer, dQ writer and MMA warps; and the check is not vacuous (it finds what five plausible changes
would break)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("backward_protocol_check", ROOT / "scripts" / "backward_protocol_check.py")
protocol = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = protocol  # dataclasses look their module up
_spec.loader.exec_module(protocol)

STAGED = [cfg for cfg in protocol.KERNEL_CONFIGS if cfg.staged_dq]


@pytest.mark.parametrize("cfg", protocol.KERNEL_CONFIGS, ids=str)
@pytest.mark.parametrize("tiles", [[1, 2], [0, 3], [2, 0, 1]], ids=str)
def test_kernels_never_deadlock_or_race(cfg, tiles):
    """Tiles with and without steps, fewer and more steps than stages (the full set: the script)."""
    errors, states = protocol.explore(tiles, cfg)
    assert not errors, errors
    assert states > 10_000  # interleavings, not one schedule


@pytest.mark.parametrize("cfg", protocol.KERNEL_CONFIGS, ids=str)
def test_check_finds_the_race_of_next_keys_loaded_before_the_stores_read_k_and_v(cfg):
    """Without the wait the producer loads the next tile's K and V while the epilogue's stores still read the
    buffers."""
    errors, _ = protocol.explore([1, 2], cfg, producer=lambda tiles: protocol.producer_ops(tiles, wait_kv_free=False))
    assert errors and errors[0].startswith("race: a write into KV"), errors


@pytest.mark.parametrize("cfg", protocol.KERNEL_CONFIGS, ids=str)
def test_check_finds_the_race_of_a_tile_named_before_the_last_one_is_done(cfg):
    """The producer may name the next tile only once every MMA thread has handed the last one back."""
    errors, _ = protocol.explore([1, 1], cfg,
                                 producer=lambda tiles: protocol.producer_ops(tiles, publish_after_tile_done=False))
    assert errors and errors[0].startswith("race: a write into TILE"), errors


@pytest.mark.parametrize("cfg", STAGED, ids=str)
def test_check_finds_the_race_of_one_dq_target_slot(cfg):
    """A step names its dQ target before its GEMMs, while the writer may still read the step before's."""
    def one_slot(tiles, proc, c):
        return protocol.mma_ops(tiles, proc, c, target_slots=1)

    errors, _ = protocol.explore([2], cfg, mma=one_slot)
    assert errors and errors[0].startswith("race: a write into DQT0"), errors


@pytest.mark.parametrize("cfg", STAGED, ids=str)
def test_check_finds_the_named_barrier_an_untaken_last_hand_back_leaves(cfg):
    def untaken(tiles, proc, c):
        return protocol.mma_ops(tiles, proc, c, take_last_hand_back=False)

    errors, _ = protocol.explore([2, 1], cfg, mma=untaken)
    assert "named barriers left with arrivals at the end: ['dq_empty0', 'dq_empty1']" in errors, errors


@pytest.mark.parametrize("cfg", protocol.KERNEL_CONFIGS, ids=str)
def test_check_finds_the_stale_phase_of_a_flip_after_the_stores(cfg):
    """Flipped after the epilogue's second barrier, the phase can be read before the flip by the other warps."""
    def late_flip(tiles, proc, c):
        return protocol.mma_ops(tiles, proc, c, flip_after_stores=True)

    errors, _ = protocol.explore([1, 1], cfg, mma=late_flip)
    assert errors and errors[0].startswith("stale phase"), errors
