"""Where one call's time goes: the call run once under ``torch.profiler`` and summarised.

The wall time of the profiled call set against the device time of its kernels tells a host-bound call
(wall well above device) from a GPU-bound one; the table names the kernels (and, on CPU, the ops) that
take the time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile


@dataclass
class CallProfile:
    wall_ms: float  # the profiled call, start to end (the profiler's own overhead included)
    device_ms: float  # its kernels' device time, summed (0 without a GPU)
    table: str  # the profiler's table, busiest first (device time on a GPU, CPU time elsewhere)


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
    device_ms = sum(event.self_device_time_total for event in averages) / 1e3
    busiest = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    return CallProfile(wall_ms, device_ms, averages.table(sort_by=busiest, row_limit=row_limit))
