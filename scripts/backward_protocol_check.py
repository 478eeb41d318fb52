"""Exhaustive check of the backward kernel's synchronisation protocol, on the CPU.

A hand-kept model of one CTA of csrc/fa2/bwd_kernel_sm90.hpp walking several key tiles (the persistent
grid): the producer warp (`bwd_load`, bwd_mainloop_sm90.hpp), the dQ writer warp (`bwd_dq_writer`, where
dQ is staged) and the MMA warpgroups (`bwd_mma`, `add_dq`, `bwd_epilogue`, `finish_dq_writer`), the first
warpgroup split into its thread 0 (which names each step's dQ target, flips the K/V phase, stores dK/dV and
frees the K/V buffers) and the rest. Each is a sequence of barrier operations: the K/V barrier and its "free"
barrier, the "tile done" barrier, the Q and dO pipelines, the named barriers (one id per set of threads: the
MMA warps' own, met at dS ready and in the epilogue; dQ empty/full per warpgroup), the K/V phase kept in
shared memory, and the buffers they guard (K/V, the tile and its steps the producer names for the others,
the Q and dO stages, the dS and P stages, the dQ staging halves and the dQ target slots).
The producer names one more tile after the last, the end, and the MMA warps name the writer a last target,
none. Every interleaving is explored (`protocol_model.py`); the check fails on a deadlock, a race (a write
into a buffer that someone still reads), a stale K/V phase read, or a named barrier left with arrivals at
the end. Change the model together with those functions.

    python scripts/backward_protocol_check.py           # every configuration the kernels build
    python scripts/backward_protocol_check.py --quick   # two-tile sequences only
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # protocol_model beside this file, however it is loaded
import protocol_model  # noqa: E402

STAGES = 2  # Q and dO pipeline stages, dS (and P) stages: every configuration the kernels build
LEADER, REST, SECOND = 0, 1, 2  # MMA processes: thread 0 of warpgroup 0, the rest of it, warpgroup 1
MMA = (LEADER, REST, SECOND)


@dataclass(frozen=True)
class Config:
    split_keys: bool  # D <= 128: P^T and dS^T feed dV/dK from registers; else P and dS both in shared memory
    staged_dq: bool  # D <= 192: dQ partials staged for the writer warp; D = 256 adds them directly


KERNEL_CONFIGS = (Config(True, True), Config(False, True), Config(False, False))


def warpgroup(proc: int) -> int:
    return 0 if proc in (LEADER, REST) else 1


def producer_ops(tiles: list[int], early_first_step: bool = True, wait_kv_free: bool = True,
                 publish_after_tile_done: bool = True) -> list[tuple]:
    """bwd_load for tiles of the given step counts, then the end named. The keywords change the protocol, to
    show that the check finds what such changes break."""
    ops: list[tuple] = []
    stage, phase = 0, 1  # a fresh pipeline's producer state: the first acquires pass

    def load_step():
        nonlocal stage, phase
        for pipe in ("q", "do"):
            ops.extend([("wait", f"{pipe}_empty{stage}", phase), ("write", f"{pipe.upper()}{stage}"),
                        ("arrive", f"{pipe}_full{stage}")])
        stage += 1
        if stage == STAGES:
            stage, phase = 0, phase ^ 1

    for i, steps in enumerate(tiles):
        early = early_first_step and steps > 0 and i > 0
        if early:
            load_step()
        if not publish_after_tile_done:
            ops.append(("write", "TILE"))
        if i > 0:
            ops.append(("wait", "tile_done", (i - 1) % 2))  # every MMA thread's arrival in the epilogue
        if publish_after_tile_done:
            ops.append(("write", "TILE"))  # the tile and its steps, for the other roles
        if i > 0 and wait_kv_free:
            ops.append(("wait", "kv_free", (i - 1) % 2))
        if steps > 0:
            ops.append(("write", "KV"))
        ops.append(("arrive", "kv"))  # with the K/V bytes, or plain for a tile without steps
        for _ in range(1 if early else 0, steps):
            load_step()
    if tiles:
        ops.append(("wait", "tile_done", (len(tiles) - 1) % 2))
    ops.append(("write", "TILE"))  # BwdTile::end()
    if tiles:
        ops.append(("wait", "kv_free", (len(tiles) - 1) % 2))
    ops.append(("arrive", "kv"))
    return ops


def writer_ops(tiles: list[int]) -> list[tuple]:
    """bwd_dq_writer: per staged partial, its target (a slot per Q stage, in step order), then one bulk
    reduction per warpgroup half; a last target names none."""
    ops: list[tuple] = [("nb_arrive", "dq_empty0"), ("nb_arrive", "dq_empty1")]
    for partial in range(sum(tiles)):
        ops.extend([("nb_sync", "dq_full0"), ("use_begin", f"DQT{partial % STAGES}"),
                    ("use_end", f"DQT{partial % STAGES}")])
        for wg in (0, 1):
            if wg > 0:
                ops.append(("nb_sync", f"dq_full{wg}"))
            ops.extend([("use_begin", f"DQ{wg}"), ("use_end", f"DQ{wg}"), ("nb_arrive", f"dq_empty{wg}")])
    last = sum(tiles) % STAGES
    ops.extend([("nb_sync", "dq_full0"), ("use_begin", f"DQT{last}"), ("use_end", f"DQT{last}")])
    return ops


def mma_ops(tiles: list[int], proc: int, cfg: Config, flip_after_stores: bool = False, target_slots: int = STAGES,
            take_last_hand_back: bool = True) -> list[tuple]:
    """One MMA process over the tiles (the kernel's tile loop, bwd_mma, add_dq, bwd_epilogue) and the end
    (finish_dq_writer). The keywords change the protocol, to show that the check finds what such changes
    break."""
    ops: list[tuple] = []
    read, phase = 0, 0
    wg = warpgroup(proc)
    for i, steps in enumerate(tiles):
        ops.extend([("read_phase", i % 2), ("wait", "kv", i % 2), ("use_begin", "TILE")])
        if steps > 0:
            ops.append(("use_begin", "KV"))
        for step in range(steps):
            ds = step % STAGES
            if cfg.staged_dq and proc == LEADER:  # the step's dQ target, before its GEMMs
                ops.append(("write", f"DQT{read % target_slots}"))
            ops.extend([("wait", f"q_full{read}", phase), ("use_begin", f"Q{read}"),
                        ("wait", f"do_full{read}", phase), ("use_begin", f"DO{read}")])
            if cfg.split_keys:  # dV from registers, dS to shared memory, then dQ and dK
                ops.extend([("write", f"DS{ds}"), ("nb_sync", "mma_warps"), ("use_begin", f"DS{ds}"),
                            # warpgroup_wait<1>: dV and dQ done, dK (Q and registers) may still run
                            ("use_end", f"DS{ds}"), ("use_end", f"DO{read}"), ("arrive", f"do_empty{read}")])
                ops.extend(add_dq_ops(wg, cfg))
                ops.extend([("use_end", f"Q{read}"), ("arrive", f"q_empty{read}")])
            else:  # P and dS through shared memory; dQ, dV and dK all read them
                ops.extend([("write", f"P{ds}"), ("write", f"DS{ds}"), ("nb_sync", "mma_warps"),
                            ("use_begin", f"P{ds}"), ("use_begin", f"DS{ds}")])
                ops.extend(add_dq_ops(wg, cfg))  # after warpgroup_wait<2>: the dQ GEMM done
                ops.extend([("use_end", f"P{ds}"), ("use_end", f"DS{ds}"), ("use_end", f"DO{read}"),
                            ("use_end", f"Q{read}"), ("arrive", f"do_empty{read}"), ("arrive", f"q_empty{read}")])
            read += 1
            if read == STAGES:
                read, phase = 0, phase ^ 1
        if steps > 0:
            ops.append(("use_end", "KV"))
        # The epilogue: the tile's name handed back to the producer (thread 0 has read it for the store),
        # dK/dV staged in the K/V buffers between two barriers, stored by thread 0.
        ops.extend([("use_end", "TILE"), ("arrive", "tile_done"), ("nb_sync", "mma_warps")])
        if proc == LEADER and not flip_after_stores:
            ops.append(("flip_phase",))
        ops.extend([("write", "KV"), ("nb_sync", "mma_warps")])
        if proc == LEADER:
            ops.extend([("use_begin", "KV"), ("use_end", "KV"), ("arrive", "kv_free")])  # the TMA store's read
            if flip_after_stores:
                ops.append(("flip_phase",))
    n = len(tiles)
    ops.extend([("read_phase", n % 2), ("wait", "kv", n % 2), ("use_begin", "TILE"), ("use_end", "TILE")])
    if cfg.staged_dq:  # finish_dq_writer
        if proc == LEADER:
            ops.append(("write", f"DQT{read % target_slots}"))
        if take_last_hand_back:
            ops.append(("nb_sync", f"dq_empty{wg}"))
        if wg == 0:
            ops.append(("nb_arrive", "dq_full0"))
    return ops


def add_dq_ops(wg: int, cfg: Config) -> list[tuple]:
    if not cfg.staged_dq:
        return []  # vector reductions straight into global memory
    return [("nb_sync", f"dq_empty{wg}"), ("write", f"DQ{wg}"), ("nb_arrive", f"dq_full{wg}")]


def explore(tiles: list[int], cfg: Config, producer=producer_ops, writer=writer_ops, mma=mma_ops
            ) -> tuple[list[str], int]:
    """(errors, states explored) over every interleaving of the producer, the writer and the MMA processes."""
    procs = [producer(tiles), writer(tiles) if cfg.staged_dq else []] + [mma(tiles, p, cfg) for p in MMA]
    arrivals = {"kv": 1, "kv_free": 1, "tile_done": len(MMA)}
    for s in range(STAGES):
        for pipe in ("q", "do"):
            arrivals[f"{pipe}_full{s}"] = 1
            arrivals[f"{pipe}_empty{s}"] = len(MMA)
    # Named barriers and their participants: both warpgroups (and the producer), or one warpgroup and the writer.
    participants = {"mma_warps": 3, "dq_empty0": 3, "dq_full0": 3, "dq_empty1": 2,
                    "dq_full1": 2}
    return protocol_model.explore(procs, arrivals, participants)


def tile_sequences(quick: bool) -> list[list[int]]:
    """Sequences of a CTA's tiles by step count: none, one, the stage count and beyond it."""
    counts = [0, 1, STAGES, STAGES + 1]
    return [list(t) for t in itertools.product(counts, repeat=2 if quick else 3)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two-tile sequences only")
    args = parser.parse_args(argv)
    return protocol_model.check_all(KERNEL_CONFIGS, lambda cfg: tile_sequences(args.quick), explore)


if __name__ == "__main__":
    sys.exit(main())
