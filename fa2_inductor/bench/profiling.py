"""Where one call's time goes: the call run once under ``torch.profiler`` and summarised.

The wall time of the profiled call set against the time the GPU was busy with its kernels tells a host-bound
call (wall well above busy) from a GPU-bound one; the table names the kernels (and, on CPU, the ops) that
take the time. Busy time is the union of the kernels' intervals, not their sum: a kernel launched as a
programmatic dependent (the backward's main kernel and dQ conversion) starts before the one it depends on
ends, and its duration includes the wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


PROFILE_HEADER = "one call of each variant under torch.profiler, after the timing\n"
# bench --profile (--decode, --backward): calls per implementation and cell, so each kernel's average is over several.
PROFILED_CALLS = 10


def repeated(fn: Callable, arg_sets: Sequence[tuple] = ((),)) -> Callable[[], list]:
    """``PROFILED_CALLS`` calls of ``fn`` on the rotating argument sets, as one argument-free call."""
    return lambda: [fn(*arg_sets[i % len(arg_sets)]) for i in range(PROFILED_CALLS)]


@dataclass
class CallProfile:
    wall_ms: float  # the profiled call, start to end (the profiler's own overhead included)
    device_ms: float  # the time the device was busy with its kernels (0 without a GPU)
    table: str  # the profiler's table, busiest first (device time on a GPU, CPU time elsewhere)


def busy_ms(intervals: Sequence) -> float:
    """Milliseconds covered by at least one of the intervals (``.start`` and ``.end`` in microseconds)."""
    total_us, reached = 0.0, float("-inf")
    for interval in sorted(intervals, key=lambda i: i.start):
        if interval.end > reached:
            total_us += interval.end - max(interval.start, reached)
            reached = interval.end
    return total_us / 1e3


def profile_call(fn: Callable[[], object], device: torch.device, row_limit: int = 12) -> CallProfile:
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    if on_gpu:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if on_gpu:
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    averages = prof.key_averages()
    device_ms = busy_ms([event.time_range for event in prof.events() if event.device_type != DeviceType.CPU])
    busiest = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    return CallProfile(wall_ms, device_ms, averages.table(sort_by=busiest, row_limit=row_limit))


def append_profile(path: Path, title: str, fn: Callable[[], object], device: torch.device) -> Optional[CallProfile]:
    """``fn`` profiled, its section (title, wall and kernel time, the table) appended to ``path``; None, with the
    reason in its place, where the call raised (the caller's timing stands)."""
    with path.open("a") as report:
        try:
            found = profile_call(fn, device)
        except Exception as exc:
            report.write(f"\n== {title}: not profiled: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}\n")
            return None
        report.write(f"\n== {title}: profiled call {found.wall_ms:.3f} ms, GPU busy {found.device_ms:.3f} ms\n"
                     f"{found.table}\n")
    return found


def profile_calls(path: Path, calls: dict[str, Callable[[], object]], title: str,
                  device: torch.device) -> dict[str, CallProfile]:
    """``append_profile`` of each call, under "<title> <name>": the profiles of those that ran, by name."""
    found = {name: append_profile(path, f"{title} {name}", fn, device) for name, fn in calls.items()}
    return {name: profile for name, profile in found.items() if profile is not None}
