"""Measuring one cell: each implementation is built, checked against SDPA, then timed on the same inputs."""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .cases import DTYPES, Cell, random_input_sets, tflops
from .implementations import FA2, IMPLEMENTATIONS, NotAvailable, compare_to_reference, sdpa_reference
from .timing import affordable_counts, input_set_count, time_calls


@dataclass
class Measurement:
    status: str  # "ok", "n/a" (the implementation declined the cell), "WRONG" (failed the check) or "error"
    median_ms: Optional[float] = None
    tflops: Optional[float] = None
    max_abs_error: Optional[float] = None
    reason: Optional[str] = None
    times_ms: list[float] = field(default_factory=list)


def describe_exception(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


def _refusal_reason(exc: Exception, caught: list[warnings.WarningMessage]) -> str:
    # SDPA says why a backend declined in warnings, then raises a generic "no kernel" error.
    lines = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    return "; ".join(dict.fromkeys([*lines, describe_exception(exc)]))[:400]


def _build_and_run_once(name: str, cell: Cell, inputs: tuple, scale: float) -> tuple[Callable, Tensor]:
    """The implementation's call and its output on ``inputs``.

    Raises NotAvailable when a peer declines the cell; fa2_inductor's own failures propagate, being bugs.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call = IMPLEMENTATIONS[name](*inputs, cell.causal, scale)
            out = call(*inputs)
            if out.is_cuda:
                torch.cuda.synchronize()  # a failing launch raises here, not in the middle of the timing
        except NotAvailable:
            raise
        except Exception as exc:  # each backend declines in its own words
            if name == FA2:
                raise
            raise NotAvailable(_refusal_reason(exc, caught)) from exc
    return call, out


def measure(
    name: str,
    cell: Cell,
    input_sets: list[tuple],
    expected: Optional[Tensor],
    device: torch.device,
    warmup: int,
    reps: int,
) -> Measurement:
    """Checks one implementation on one cell against ``expected`` (if given), then times it."""
    scale = cell.head_dim**-0.5
    try:
        call, out = _build_and_run_once(name, cell, input_sets[0], scale)
    except NotAvailable as exc:
        return Measurement("n/a", reason=str(exc))
    except Exception as exc:  # recorded, so the sweep goes on and the JSON says what broke
        return Measurement("error", reason=describe_exception(exc))
    error = None
    if expected is not None:
        error, within = compare_to_reference(out, expected)
        if not within:
            reason = f"max abs error {error:.3g} vs SDPA is above tolerance"
            return Measurement("WRONG", max_abs_error=error, reason=reason)
    del out
    try:
        probe_ms = time_calls(call, input_sets, device, warmup=0, reps=1)[0]
        warmup, reps = affordable_counts(probe_ms, warmup, reps)
        times = time_calls(call, input_sets, device, warmup=warmup, reps=reps)
    except Exception as exc:  # e.g. out of memory: record it and go on with the next cell
        return Measurement("error", max_abs_error=error, reason=describe_exception(exc))
    median = statistics.median(times)
    return Measurement("ok", median, tflops(cell.flops, median), error, times_ms=times)


def ratio_name(impl: str) -> str:
    return "fa2/" + impl.removeprefix("sdpa_")


@dataclass
class CellResult:
    cell: Cell
    measurements: dict[str, Measurement]

    def ratios(self) -> dict[str, float]:
        """fa2_inductor's TFLOP/s over each other implementation's, where both ran."""
        fa2 = self.measurements.get(FA2)
        if fa2 is None or fa2.status != "ok":
            return {}
        return {
            ratio_name(name): fa2.tflops / m.tflops
            for name, m in self.measurements.items()
            if name != FA2 and m.status == "ok"
        }

    def to_record(self) -> dict:
        return {
            **asdict(self.cell),
            "flops": self.cell.flops,
            "ratios": self.ratios(),
            "measurements": {name: asdict(m) for name, m in self.measurements.items()},
        }


def _cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    return 0


def _input_sets_for(cell: Cell, device: torch.device, seed: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    set_bytes = 3 * cell.batch * cell.heads * cell.seqlen * cell.head_dim * DTYPES[cell.dtype].itemsize
    return random_input_sets(cell, device, input_set_count(set_bytes, _cache_bytes(device)), seed)


def measure_cell(cell: Cell, impls: Sequence[str], device: torch.device, args: argparse.Namespace) -> CellResult:
    input_sets = _input_sets_for(cell, device, args.seed)
    expected = sdpa_reference(*input_sets[0], cell.causal, cell.head_dim**-0.5) if args.check else None
    measurements = {name: measure(name, cell, input_sets, expected, device, args.warmup, args.reps) for name in impls}
    return CellResult(cell, measurements)
