"""The model checker behind the kernels' protocol checks (forward_protocol_check.py, backward_protocol_check.py).

A process is a list of operations, each a tuple:
    ("wait", mbarrier, parity)                    blocks until that barrier's phase of this parity has completed
    ("arrive", mbarrier)                          one arrival; the phase completes with the barrier's count
    ("nb_sync", name), ("nb_arrive", name)        a named barrier of a fixed number of participants
    ("write", buffer)                             an error while anyone reads the buffer (a race)
    ("use_begin", buffer), ("use_end", buffer)    a read of the buffer
    ("read_phase", parity), ("flip_phase",)       a bit in shared memory (0 at first): a read of the other value
                                                  is an error (a stale phase)
`explore` runs every interleaving of the processes (depth first over the reachable states) and reports a
deadlock (no one can move and someone has not finished), a race, a stale phase, and a named barrier left
with arrivals once every process has finished.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence


def explore(procs: Sequence[Sequence[tuple]], arrivals: dict[Hashable, int],
            participants: dict[Hashable, int]) -> tuple[list[str], int]:
    """(errors, states explored); arrivals: each mbarrier's arrival count, participants: each named barrier's."""
    mbar_index = {name: i for i, name in enumerate(arrivals)}
    nb_index = {name: i for i, name in enumerate(participants)}
    buffers = {b: i for i, b in enumerate(sorted({op[1] for p in procs for op in p if op[0] in ("write", "use_begin")}))}

    # State: program counters, per mbarrier (phases completed, arrivals pending), per named barrier
    # (arrivals, generation), readers per buffer, the shared-memory phase bit, and the named-barrier
    # generation each process waits on (-1: none).
    start = (tuple(0 for _ in procs), tuple((0, 0) for _ in mbar_index), tuple((0, 0) for _ in nb_index),
             tuple(0 for _ in buffers), 0, tuple(-1 for _ in procs))
    seen, stack, errors = set(), [start], []
    while stack and len(errors) < 3:
        state = stack.pop()
        if state in seen:
            continue
        seen.add(state)
        pcs, mbars, nbars, readers, phase_bit, waiting = state
        moved = False
        for p, ops in enumerate(procs):
            if pcs[p] >= len(ops):
                continue
            op = ops[pcs[p]]
            step = pcs[:p] + (pcs[p] + 1,) + pcs[p + 1:]
            if waiting[p] >= 0:  # in a named-barrier sync: released once its generation completes
                if nbars[nb_index[op[1]]][1] > waiting[p]:
                    stack.append((step, mbars, nbars, readers, phase_bit, waiting[:p] + (-1,) + waiting[p + 1:]))
                    moved = True
                continue
            mbars2, nbars2, readers2, phase_bit2, waiting2 = list(mbars), list(nbars), list(readers), phase_bit, waiting
            kind = op[0]
            if kind == "wait":
                if mbars[mbar_index[op[1]]][0] % 2 == op[2]:
                    continue  # that phase has not completed
            elif kind == "arrive":
                i = mbar_index[op[1]]
                done, pending = mbars[i][0], mbars[i][1] + 1
                mbars2[i] = (done + 1, 0) if pending == arrivals[op[1]] else (done, pending)
            elif kind in ("nb_sync", "nb_arrive"):
                i = nb_index[op[1]]
                count, generation = nbars[i]
                count += 1
                nbars2[i] = (0, generation + 1) if count == participants[op[1]] else (count, generation)
                if kind == "nb_sync" and count < participants[op[1]]:  # wait for this generation to complete
                    waiting2 = waiting[:p] + (generation,) + waiting[p + 1:]
                    stack.append((pcs, mbars, tuple(nbars2), readers, phase_bit, waiting2))
                    moved = True
                    continue
            elif kind == "write":
                if readers[buffers[op[1]]] > 0:
                    errors.append(f"race: a write into {op[1]} while it is read (program counters {pcs})")
                    continue
            elif kind == "use_begin":
                readers2[buffers[op[1]]] += 1
            elif kind == "use_end":
                readers2[buffers[op[1]]] -= 1
            elif kind == "read_phase":
                if phase_bit != op[1]:
                    errors.append(f"stale phase: read {phase_bit}, expected {op[1]} (program counters {pcs})")
                    continue
            elif kind == "flip_phase":
                phase_bit2 = phase_bit ^ 1
            stack.append((step, tuple(mbars2), tuple(nbars2), tuple(readers2), phase_bit2, waiting2))
            moved = True
        finished = all(pcs[p] >= len(procs[p]) for p in range(len(procs)))
        if not moved and not finished:
            stuck = [procs[p][pcs[p]] if pcs[p] < len(procs[p]) else "done" for p in range(len(procs))]
            errors.append(f"deadlock: {stuck}")
        if finished and any(count for count, _ in nbars):
            left = [name for name, i in nb_index.items() if nbars[i][0]]
            errors.append(f"named barriers left with arrivals at the end: {left}")
    return errors, len(seen)


def check_all(configs: Sequence, sequences: Callable[[object], list[list[int]]],
              explore_one: Callable[[list[int], object], tuple[list[str], int]]) -> int:
    """explore_one(tiles, cfg) over every configuration and its tile sequences; prints the outcome and returns the
    exit status (1 at the first configuration and sequence with an error)."""
    total = 0
    for cfg in configs:
        for tiles in sequences(cfg):
            errors, states = explore_one(tiles, cfg)
            total += states
            if errors:
                print(f"FAILED {cfg} tiles {tiles}:")
                for error in errors:
                    print("   ", error)
                return 1
        print(f"ok: {cfg}")
    print(f"{total} states explored, no deadlock, no race")
    return 0
