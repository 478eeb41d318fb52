"""Exhaustive check of the forward kernel's synchronisation protocol, on the CPU.

A hand-kept model of one persistent CTA of csrc/fa2/: the producer thread (`producer_load`,
mainloop_sm90.hpp) and the consumer warpgroups (`consumer_tiles` in kernel_sm90.hpp, `consumer_mainloop`,
`epilogue_store` in epilogue_sm90.hpp) as sequences of barrier operations over a few tiles: per-warpgroup
Q barriers (loaded / free again), the K and V pipelines of S stages, the ping-pong turn barriers, and O
staged in a buffer of its own or in the warpgroup's Q block. Every interleaving is explored
(`protocol_model.py`); the check fails on a deadlock (no one can move and someone has not finished), a race
(the producer issues a load into a buffer that a consumer still reads) or a turn barrier left with arrivals at
the end. Change the model together with those functions.

    python scripts/forward_protocol_check.py           # every configuration the kernels build
    python scripts/forward_protocol_check.py --quick   # the short tile sequences only
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # protocol_model beside this file, however it is loaded
import protocol_model  # noqa: E402


@dataclass(frozen=True)
class Config:
    warpgroups: int  # consumer warpgroups (64 query rows each)
    stages: int  # K/V pipeline stages
    own_o_buffer: bool  # O staged in a buffer of its own (D <= 128); else in the warpgroup's Q block
    ping_pong: bool  # two warpgroups taking turns for their GEMMs

    @property
    def q_every_tile(self) -> bool:
        # With O in the Q block every tile's epilogue writes the block, so every tile loads Q (kQEveryTile).
        return not self.own_o_buffer


# The configurations the kernels build: D=64/128 (ping-pong, O buffer; two or three stages), D=64's long
# tiles (three warpgroups, no ping-pong), D=192 (ping-pong, O in Q; two stages, masked three), D=256 (no
# ping-pong, O in Q, two stages).
KERNEL_CONFIGS = (
    Config(2, 2, True, True),
    Config(2, 3, True, True),
    Config(3, 3, True, False),
    Config(2, 2, False, True),
    Config(2, 3, False, True),
    Config(2, 2, False, False),
)


def other_q_after_blocks(cfg: Config) -> int:
    """After how many of a tile's key blocks the producer issues the other warpgroups' Q blocks: once the
    first stages' K and V are issued (a warpgroup that stages O in its Q block frees it only after its store,
    which the first warpgroup should not wait behind)."""
    return cfg.stages


def producer_ops(tiles: list[int], cfg: Config, other_q_after: int | None = None,
                 wait_q_free: bool = True) -> list[tuple]:
    """The producer's operations for tiles of the given key-block counts (producer_load). The keywords
    change the protocol, to show that the check finds what such changes break."""
    other_q_after = other_q_after_blocks(cfg) if other_q_after is None else other_q_after
    ops: list[tuple] = []
    stage, phase = 0, 1  # a fresh pipeline's producer state: the first acquires pass
    q_loads = 0

    def load(pipe):  # K or V of a block into the current stage
        ops.append(("wait", f"empty_{pipe}{stage}", phase))
        ops.append(("write", f"{pipe.upper()}{stage}"))
        ops.append(("arrive", f"full_{pipe}{stage}"))

    def next_stage():
        nonlocal stage, phase
        stage += 1
        if stage == cfg.stages:
            stage, phase = 0, phase ^ 1

    def load_q(w):
        if q_loads > 0 and wait_q_free:
            ops.append(("wait", f"qfree{w}", (q_loads - 1) % 2))
        ops.append(("write", f"Q{w}"))
        ops.append(("arrive", f"qfull{w}"))

    def load_other_q():
        for w in range(1, cfg.warpgroups):
            load_q(w)

    for blocks in tiles:
        if blocks == 0 and not cfg.q_every_tile:
            continue  # the consumers write O = 0 without Q
        if blocks == 0:
            load_q(0)
            load_other_q()
        else:
            # K of the first block, the first warpgroup's Q, V; the other Q blocks after other_q_after blocks.
            load("k")
            load_q(0)
            if other_q_after == 0:
                load_other_q()
            load("v")
            next_stage()
            for i in range(1, blocks):
                if i == other_q_after:
                    load_other_q()
                load("k")
                load("v")
                next_stage()
            if 0 < other_q_after and blocks <= other_q_after:
                load_other_q()
        q_loads += 1
    return ops


def consumer_ops(tiles: list[int], w: int, cfg: Config) -> list[tuple]:
    """Consumer warpgroup w's operations (consumer_tiles, consumer_mainloop, epilogue_store)."""
    ops: list[tuple] = []
    read, phase = 0, 0
    q_loads = 0
    turns = cfg.ping_pong
    if turns and w == 0:
        ops.append(("nb_arrive", 0))  # the first turn is warpgroup 0's

    def next_stage():
        nonlocal read, phase
        read += 1
        if read == cfg.stages:
            read, phase = 0, phase ^ 1

    def free_q_after_last_s():
        ops.append(("use_end", f"Q{w}"))
        ops.append(("arrive", f"qfree{w}"))

    for blocks in tiles:
        if blocks > 0:
            ops.append(("wait", f"full_k{read}", phase))
            ops.append(("wait", f"qfull{w}", q_loads % 2))
            if turns:
                ops.append(("nb_sync", w))
            ops += [("use_begin", f"Q{w}"), ("use_begin", f"K{read}")]  # S GEMM issued
            if turns:
                ops.append(("nb_arrive", (w + 1) % cfg.warpgroups))
            ops.append(("use_end", f"K{read}"))  # S GEMM complete
            if cfg.own_o_buffer and blocks == 1:
                free_q_after_last_s()
            ops.append(("arrive", f"empty_k{read}"))
            read_v, phase_v = read, phase
            next_stage()
            for i in range(1, blocks):
                ops.append(("wait", f"full_k{read}", phase))
                if turns:
                    ops.append(("nb_sync", w))
                ops.append(("use_begin", f"K{read}"))  # S of block i
                ops.append(("wait", f"full_v{read_v}", phase_v))
                ops.append(("use_begin", f"V{read_v}"))  # P.V of block i - 1
                if turns:
                    ops.append(("nb_arrive", (w + 1) % cfg.warpgroups))
                ops.append(("use_end", f"K{read}"))
                if cfg.own_o_buffer and i + 1 == blocks:
                    free_q_after_last_s()
                ops.append(("arrive", f"empty_k{read}"))
                ops += [("use_end", f"V{read_v}"), ("arrive", f"empty_v{read_v}")]
                read_v, phase_v = read, phase
                next_stage()
            ops.append(("wait", f"full_v{read_v}", phase_v))
            ops += [("use_begin", f"V{read_v}"), ("use_end", f"V{read_v}"), ("arrive", f"empty_v{read_v}")]
        elif cfg.q_every_tile:
            ops.append(("wait", f"qfull{w}", q_loads % 2))  # O = 0 is staged where Q has landed
        if not cfg.own_o_buffer:  # the epilogue stages O in the Q block and frees it once stored
            if blocks == 0:
                ops.append(("use_begin", f"Q{w}"))
            ops += [("use_end", f"Q{w}"), ("arrive", f"qfree{w}")]
        if cfg.q_every_tile or blocks > 0:
            q_loads += 1
    if turns and w == 0:
        ops.append(("nb_sync", 0))  # the other warpgroup's last hand-over
    return ops


def explore(tiles: list[int], cfg: Config, producer=producer_ops) -> tuple[list[str], int]:
    """(errors, states explored) over every interleaving of the producer and the consumers."""
    procs = [producer(tiles, cfg)] + [consumer_ops(tiles, w, cfg) for w in range(cfg.warpgroups)]
    arrivals = {f"qfull{w}": 1 for w in range(cfg.warpgroups)}
    arrivals.update({f"qfree{w}": 1 for w in range(cfg.warpgroups)})
    for s in range(cfg.stages):
        for pipe in "kv":
            arrivals[f"full_{pipe}{s}"] = 1
            arrivals[f"empty_{pipe}{s}"] = cfg.warpgroups
    turns = {w: 2 for w in range(cfg.warpgroups)}  # ping-pong: the warpgroup that waits and the one that hands over
    return protocol_model.explore(procs, arrivals, turns)


def tile_sequences(cfg: Config, quick: bool) -> list[list[int]]:
    """Sequences of a CTA's tiles by key-block count: none, one, the stage count and beyond it."""
    counts = [0, 1, cfg.stages, cfg.stages + 1]
    length = 2 if quick or cfg.warpgroups == 3 else 3
    return [list(t) for t in itertools.product(counts, repeat=length)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tile sequences of two tiles only")
    args = parser.parse_args(argv)
    return protocol_model.check_all(KERNEL_CONFIGS, lambda cfg: tile_sequences(cfg, args.quick), explore)


if __name__ == "__main__":
    sys.exit(main())
