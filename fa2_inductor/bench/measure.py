"""Measuring one cell: each implementation is built and checked against SDPA, then all are timed in turns on
the same inputs."""

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
from .timing import input_set_count, time_in_turns


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


def timing_row(median_ms: "float | Exception", flops: float) -> dict:
    """One timed call's JSON row: ``ok`` with its median ms and TFLOP/s, or ``error`` with what it raised."""
    if isinstance(median_ms, Exception):
        return {"status": "error", "reason": describe_exception(median_ms)}
    return {"status": "ok", "ms": median_ms, "tflops": tflops(flops, median_ms)}


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


def measure_together(
    names: Sequence[str],
    cell: Cell,
    input_sets: list[tuple],
    expected: Optional[Tensor],
    device: torch.device,
    warmup: int,
    reps: int,
) -> dict[str, Measurement]:
    """Checks each implementation on one cell against ``expected`` (if given), then times the ones that
    passed in turns (``time_in_turns``)."""
    scale = cell.head_dim**-0.5
    results: dict[str, Measurement] = {}
    passed: dict[str, tuple[Callable, Optional[float]]] = {}
    for name in names:
        try:
            call, out = _build_and_run_once(name, cell, input_sets[0], scale)
        except NotAvailable as exc:
            results[name] = Measurement("n/a", reason=str(exc))
            continue
        except Exception as exc:  # recorded, so the sweep goes on and the JSON says what broke
            results[name] = Measurement("error", reason=describe_exception(exc))
            continue
        error = None
        if expected is not None:
            error, within = compare_to_reference(out, expected)
            if not within:
                reason = f"max abs error {error:.3g} vs SDPA is above tolerance"
                results[name] = Measurement("WRONG", max_abs_error=error, reason=reason)
                continue
        del out
        passed[name] = (call, error)
    timed = time_in_turns({name: call for name, (call, _) in passed.items()}, input_sets, device,
                          warmup=warmup, reps=reps)
    for name, (_, error) in passed.items():
        times = timed[name]
        if isinstance(times, Exception):
            results[name] = Measurement("error", max_abs_error=error, reason=describe_exception(times))
        else:
            median = statistics.median(times)
            results[name] = Measurement("ok", median, tflops(cell.flops, median), error, times_ms=times)
    return {name: results[name] for name in names}


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
    return CellResult(cell, measure_together(impls, cell, input_sets, expected, device, args.warmup, args.reps))
