"""Timing a call: CUDA events on the GPU, ``perf_counter`` on the CPU, rotating input sets past the cache."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

# ~0.2 ms of GPU sleep before each timed call: Python launches the call while the GPU waits, so the events
# time the GPU work and not the launch overhead.
_LAUNCH_CUSHION_CYCLES = 400_000
# One implementation on one cell may take this long to time; a slow kernel (or one that quietly fell back)
# then gets fewer reps instead of eating the sweep's GPU minutes.
TIME_BUDGET_MS = 2000.0

ArgSets = Sequence[tuple]


def input_set_count(set_bytes: int, cache_bytes: int, max_sets: int = 8) -> int:
    """How many input sets to rotate through so that a call never finds its inputs still in the cache."""
    return max(2, min(max_sets, math.ceil(4 * cache_bytes / max(set_bytes, 1))))


def time_cuda(fn: Callable, arg_sets: ArgSets = ((),), *, warmup: int = 5, reps: int = 20) -> list[float]:
    """Milliseconds of each of ``reps`` calls, from CUDA events on the current stream.

    Call i, counting warm-up calls, gets ``arg_sets[i % len(arg_sets)]``: rotating several input sets means
    no timed call reuses the inputs (still in L2) of the call before it.
    """
    for i in range(warmup):
        fn(*arg_sets[i % len(arg_sets)])
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for i in range(reps):
        torch.cuda._sleep(_LAUNCH_CUSHION_CYCLES)
        starts[i].record()
        fn(*arg_sets[(warmup + i) % len(arg_sets)])
        ends[i].record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def time_cpu(fn: Callable, arg_sets: ArgSets = ((),), *, warmup: int = 5, reps: int = 20) -> list[float]:
    """``time_cuda`` for CPU work, with ``time.perf_counter``."""
    for i in range(warmup):
        fn(*arg_sets[i % len(arg_sets)])
    times = []
    for i in range(reps):
        start = time.perf_counter()
        fn(*arg_sets[(warmup + i) % len(arg_sets)])
        times.append((time.perf_counter() - start) * 1e3)
    return times


def keep_busy(fn: Callable, device: torch.device, min_ms: float = 500.0) -> None:
    """Calls ``fn`` (waiting for each call) until ``min_ms`` have passed. The GPU clocks down while a model
    compiles on the CPU, and a few warm-up calls of a few ms each do not bring the clocks back up."""
    if device.type != "cuda":
        return
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < min_ms:
        fn()
        torch.cuda.synchronize(device)


def time_calls(fn: Callable, arg_sets: ArgSets, device: torch.device, *, warmup: int, reps: int) -> list[float]:
    timer = time_cuda if device.type == "cuda" else time_cpu
    return timer(fn, arg_sets, warmup=warmup, reps=reps)


def turn_order(items: Sequence, round_index: int) -> list:
    """The order of one round when calls are timed in turns: as given in even rounds, reversed in odd ones, so
    that the GPU's clocks and temperature drifting over the rounds reach every call alike."""
    return list(items) if round_index % 2 == 0 else list(items)[::-1]


def time_in_turns(
    calls: dict[str, Callable], arg_sets: ArgSets, device: torch.device, *, warmup: int, reps: int
) -> dict[str, "list[float] | Exception"]:
    """Milliseconds of each call's timed reps, the calls timed in turns: round r times one call of each, in
    ``turn_order`` (timed one after another, the same kernel read up to 7 % faster when timed first at 16k
    tokens). Each call first gets a probe call that sets its own affordable (warmup, reps)
    and its warm-up calls. A call that raises gets its exception instead of times and leaves the rounds."""
    plans: dict[str, tuple[int, int]] = {}
    failed: dict[str, Exception] = {}
    for name, fn in calls.items():
        try:
            probe_ms = time_calls(fn, arg_sets, device, warmup=0, reps=1)[0]
            plans[name] = affordable_counts(probe_ms, warmup, reps)
            for i in range(plans[name][0]):
                fn(*arg_sets[i % len(arg_sets)])
        except Exception as exc:  # e.g. out of memory: the caller records it
            failed[name] = exc
    times: dict[str, list[float]] = {name: [] for name in plans}
    for r in range(max((plan_reps for _, plan_reps in plans.values()), default=0)):
        for name in turn_order(plans, r):
            call_warmup, call_reps = plans[name]
            if name in failed or r >= call_reps:
                continue
            try:
                args = arg_sets[(call_warmup + r) % len(arg_sets)]
                times[name] += time_calls(calls[name], [args], device, warmup=0, reps=1)
            except Exception as exc:
                failed[name] = exc
    return {name: failed.get(name, times.get(name)) for name in calls}


def medians(timed: dict[str, "list[float] | Exception"]) -> dict[str, "float | Exception"]:
    """Each call's median milliseconds of ``time_in_turns``'s answer (or the exception it raised)."""
    return {name: t if isinstance(t, Exception) else statistics.median(t) for name, t in timed.items()}


def medians_in_turns(
    calls: dict[str, Callable], arg_sets: ArgSets, device: torch.device, *, warmup: int, reps: int
) -> dict[str, "float | Exception"]:
    """``time_in_turns``, as each call's median milliseconds (or the exception it raised)."""
    return medians(time_in_turns(calls, arg_sets, device, warmup=warmup, reps=reps))


def time_compiled_in_turns(
    calls: dict[str, Callable], device: torch.device, *, warmup: int, reps: int
) -> dict[str, "list[float] | Exception"]:
    """``time_in_turns`` of argument-free calls just compiled: compiling let the GPU clock down, so the first
    call keeps it busy before the rounds start."""
    if calls:
        keep_busy(next(iter(calls.values())), device)
    return time_in_turns(calls, [()], device, warmup=warmup, reps=reps)


def every_median(medians: dict[str, "float | Exception"]) -> dict[str, float]:
    """``medians_in_turns``'s result where every call must have run: raises the first failure."""
    for result in medians.values():
        if isinstance(result, Exception):
            raise result
    return medians


def affordable_counts(call_ms: float, warmup: int, reps: int, budget_ms: float = TIME_BUDGET_MS) -> tuple[int, int]:
    """(warmup, reps) shrunk in proportion so that all the calls fit in ``budget_ms``, keeping 3 reps and 1 warm-up."""
    share = min(1.0, budget_ms / (max(call_ms, 1e-6) * (warmup + reps)))
    return min(warmup, max(1, round(warmup * share))), min(reps, max(3, round(reps * share)))
