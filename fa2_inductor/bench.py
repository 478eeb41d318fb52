"""``python -m fa2_inductor.bench``: forward-attention TFLOP/s of fa2_inductor next to torch SDPA's backends.

It runs the FlashAttention papers' shapes (batch·seqlen = 16384 tokens, heads·head_dim = 2048) for every
seqlen, head dim, dtype and causal flag asked for, and in each cell times every implementation on the same
inputs. Before a cell is timed each implementation's output is checked against SDPA's; a wrong one is
marked WRONG and not timed, and one that refuses the cell (e.g. cuDNN at head dim 256) is marked n/a
with the reason. The table is printed cell by cell, the JSON is rewritten after every cell (a run cut
short keeps what it measured) and a PNG plots TFLOP/s against seqlen, as the papers do.

The FLOP count and the timers are importable for other benchmarks: ``attention_flops``, ``tflops``,
``time_cuda``, ``time_cpu``, ``time_calls``, ``input_set_count``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import __version__, _cuda, _extension

PAPER_TOKENS = 16384  # batch · seqlen in the FlashAttention papers' forward benchmarks
PAPER_HIDDEN = 2048  # heads · head_dim
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CAUSAL_CHOICES = {"both": (False, True), "no": (False,), "yes": (True,)}
FA2 = "fa2_inductor"
DEFAULT_IMPLS = (FA2, "sdpa_flash", "sdpa_cudnn")
FULL_SWEEP = {
    "seqlens": [512, 1024, 2048, 4096, 8192, 16384],
    "head_dims": [64, 128, 256],
    "dtypes": ["bf16", "fp16"],
    "causal": "both",
    "warmup": 5,
    "reps": 20,
}
QUICK_SWEEP = {
    "seqlens": [1024, 4096, 16384],
    "head_dims": [128],
    "dtypes": ["bf16"],
    "causal": "both",
    "warmup": 3,
    "reps": 10,
}
# |out - sdpa| <= atol + rtol·|sdpa|. Both outputs are rounded to the dtype and both round P before P·V,
# so honest kernels differ by an ulp or two; a bug shows up far above these.
TOLERANCES = {torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3), torch.float32: (1e-4, 1e-4)}
# ~0.2 ms of GPU sleep before each timed call: Python launches the call while the GPU waits, so the events
# time the GPU work and not the launch overhead.
_LAUNCH_CUSHION_CYCLES = 400_000
# One implementation on one cell may take this long to time; a slow kernel (or one that quietly fell back)
# then gets fewer reps instead of eating the sweep's GPU minutes.
TIME_BUDGET_MS = 2000.0
# CPU runs exist to test the benchmark's logic; bigger problems would only make the test slow.
_MAX_CPU_SCORES = 1 << 22

ArgSets = Sequence[tuple]


# ---------------------------------------------------------------- FLOPs and timing (reusable)


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs as the FlashAttention papers count them: QKᵀ and PV at 2·Sq·Sk·D each, half when causal."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def tflops(flops: float, milliseconds: float) -> float:
    return flops / (milliseconds * 1e-3) / 1e12


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


def affordable_counts(call_ms: float, warmup: int, reps: int, budget_ms: float = TIME_BUDGET_MS) -> tuple[int, int]:
    """(warmup, reps) shrunk in proportion so that all the calls fit in ``budget_ms``, keeping 3 reps and 1 warm-up."""
    share = min(1.0, budget_ms / (max(call_ms, 1e-6) * (warmup + reps)))
    return min(warmup, max(1, round(warmup * share))), min(reps, max(3, round(reps * share)))


def time_calls(fn: Callable, arg_sets: ArgSets, device: torch.device, *, warmup: int, reps: int) -> list[float]:
    timer = time_cuda if device.type == "cuda" else time_cpu
    return timer(fn, arg_sets, warmup=warmup, reps=reps)


# ---------------------------------------------------------------- cells and inputs


@dataclass(frozen=True)
class Cell:
    """One problem of the sweep."""

    dtype: str
    causal: bool
    head_dim: int
    seqlen: int
    batch: int
    heads: int

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal)

    @property
    def group(self) -> tuple:
        """Cells sharing a table section and a subplot."""
        return (self.dtype, self.causal, self.head_dim)


def sweep_cells(
    seqlens: Sequence[int],
    head_dims: Sequence[int],
    dtypes: Sequence[str],
    causal_flags: Sequence[bool],
    tokens: int = PAPER_TOKENS,
    hidden: int = PAPER_HIDDEN,
) -> list[Cell]:
    """Every combination, seqlen innermost; batch = tokens // seqlen and heads = hidden // head_dim (at least 1)."""
    return [
        Cell(dtype, causal, head_dim, seqlen, max(1, tokens // seqlen), max(1, hidden // head_dim))
        for dtype in dtypes
        for causal in causal_flags
        for head_dim in head_dims
        for seqlen in seqlens
    ]


def random_input_sets(cell: Cell, device: torch.device, count: int, seed: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``count`` independent (q, k, v) sets of standard normals (zeros would flatter the softmax)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (cell.batch, cell.heads, cell.seqlen, cell.head_dim)
    dtype = DTYPES[cell.dtype]
    return [
        tuple(torch.randn(shape, generator=generator, device=device, dtype=dtype) for _ in range(3))
        for _ in range(count)
    ]


def _cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    return 0


def _input_sets_for(cell: Cell, device: torch.device, seed: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    set_bytes = 3 * cell.batch * cell.heads * cell.seqlen * cell.head_dim * DTYPES[cell.dtype].itemsize
    return random_input_sets(cell, device, input_set_count(set_bytes, _cache_bytes(device)), seed)


# ---------------------------------------------------------------- implementations


class NotAvailable(Exception):
    """The implementation does not run this cell; the message says why."""


def _fa2_inductor(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Callable:
    if q.is_cuda:
        reason = _cuda.kernel_unsupported_reason(q, k, v, None, causal)
        if reason is not None:
            # The op would quietly run its reference implementation; timing that would mislead.
            raise NotAvailable(f"the kernel does not cover this cell ({reason})")

    def call(q, k, v):
        return torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, None, scale, causal)[0]

    return call


def _sdpa_with(backend: SDPBackend) -> Callable:
    def build(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Callable:
        def call(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

        return call

    return build


def attention_by_hand(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> Tensor:
    """softmax(q kᵀ · scale) v as a model author writes it, for Inductor to fuse as it sees fit."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(dim=-1) @ v


def _inductor(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Callable:
    torch._dynamo.reset()  # one compile per cell; the sweep's shapes would otherwise pass the recompile limit
    compiled = torch.compile(attention_by_hand, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, scale, causal)


# name -> build(q, k, v, causal, scale) -> call(q, k, v) -> out; build raises NotAvailable to decline a cell.
IMPLEMENTATIONS: dict[str, Callable] = {
    FA2: _fa2_inductor,
    "sdpa_flash": _sdpa_with(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": _sdpa_with(SDPBackend.CUDNN_ATTENTION),
    "sdpa_efficient": _sdpa_with(SDPBackend.EFFICIENT_ATTENTION),
    "inductor": _inductor,
}


def sdpa_reference(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
    """What the implementations are checked against: SDPA with whichever backend it picks."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def compare_to_reference(out: Tensor, expected: Tensor) -> tuple[float, bool]:
    """(max abs error, whether every element is within the dtype's tolerance); NaN is never within."""
    if out.shape != expected.shape:
        return math.inf, False
    expected = expected.float()
    diff = (out.float() - expected).abs()
    atol, rtol = TOLERANCES[out.dtype]
    within = bool((diff <= atol + rtol * expected.abs()).all())
    return diff.max().item(), within


# ---------------------------------------------------------------- measuring one cell


@dataclass
class Measurement:
    status: str  # "ok", "n/a" (the implementation declined the cell), "WRONG" (failed the check) or "error"
    median_ms: Optional[float] = None
    tflops: Optional[float] = None
    max_abs_error: Optional[float] = None
    reason: Optional[str] = None
    times_ms: list[float] = field(default_factory=list)


def _describe(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


def _refusal_reason(exc: Exception, caught: list[warnings.WarningMessage]) -> str:
    # SDPA says why a backend declined in warnings, then raises a generic "no kernel" error.
    lines = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    return "; ".join(dict.fromkeys([*lines, _describe(exc)]))[:400]


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
        return Measurement("error", reason=_describe(exc))
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
        return Measurement("error", max_abs_error=error, reason=_describe(exc))
    median = statistics.median(times)
    return Measurement("ok", median, tflops(cell.flops, median), error, times_ms=times)


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


def ratio_name(impl: str) -> str:
    return "fa2/" + impl.removeprefix("sdpa_")


def measure_cell(cell: Cell, impls: Sequence[str], device: torch.device, args: argparse.Namespace) -> CellResult:
    input_sets = _input_sets_for(cell, device, args.seed)
    expected = sdpa_reference(*input_sets[0], cell.causal, cell.head_dim**-0.5) if args.check else None
    measurements = {name: measure(name, cell, input_sets, expected, device, args.warmup, args.reps) for name in impls}
    return CellResult(cell, measurements)


# ---------------------------------------------------------------- table


def _column_width(impl: str) -> int:
    return max(len(impl), 8) + 2


def group_title(cell: Cell, tokens: int, hidden: int) -> str:
    causal = "causal" if cell.causal else "non-causal"
    shapes = f"batch·seqlen = {tokens}, heads·head_dim = {hidden}"
    return f"{cell.dtype}, {causal}, head dim {cell.head_dim}  (TFLOP/s; {shapes})"


def table_header(impls: Sequence[str], check: bool) -> str:
    columns = [f"{'seqlen':>7}{'batch':>7}{'heads':>7}"]
    columns += [f"{impl:>{_column_width(impl)}}" for impl in impls]
    if FA2 in impls:
        columns += [f"{ratio_name(impl):>{_column_width(ratio_name(impl))}}" for impl in impls if impl != FA2]
        if check:
            columns.append(f"{'fa2 max|err|':>14}")
    return "".join(columns)


def _cell_text(m: Measurement) -> str:
    if m.status != "ok":
        return m.status
    return f"{m.tflops:.1f}" if m.tflops >= 1 else f"{m.tflops:.3g}"  # CPU test runs are far below 1


def table_row(result: CellResult, impls: Sequence[str], check: bool) -> str:
    cell = result.cell
    columns = [f"{cell.seqlen:>7}{cell.batch:>7}{cell.heads:>7}"]
    columns += [f"{_cell_text(result.measurements[impl]):>{_column_width(impl)}}" for impl in impls]
    if FA2 in impls:
        ratios = result.ratios()
        for impl in impls:
            if impl != FA2:
                name = ratio_name(impl)
                text = f"{ratios[name]:.2f}x" if name in ratios else "-"
                columns.append(f"{text:>{_column_width(name)}}")
        if check:
            error = result.measurements[FA2].max_abs_error
            columns.append(f"{'-' if error is None else f'{error:.2e}':>14}")
    return "".join(columns)


class Progress:
    """Prints the table as cells finish, with a transient status line on an interactive stderr."""

    def __init__(self, total: int, impls: Sequence[str], args: argparse.Namespace):
        self.total, self.impls, self.args = total, impls, args
        self.done = 0
        self.start = time.perf_counter()
        self.group = None
        self.notes_shown: set[tuple[str, str]] = set()
        self.interactive = sys.stderr.isatty()

    def starting(self, cell: Cell) -> None:
        if self.interactive:
            sys.stderr.write(
                f"\r\033[K[{self.done + 1}/{self.total}, {self._elapsed()}] timing {cell.dtype} "
                f"{'causal' if cell.causal else 'non-causal'} d{cell.head_dim} seqlen {cell.seqlen} ..."
            )
            sys.stderr.flush()

    def finished(self, result: CellResult) -> None:
        if self.interactive:
            sys.stderr.write("\r\033[K")
        self.done += 1
        if result.cell.group != self.group:
            self.group = result.cell.group
            print(f"\n{group_title(result.cell, self.args.tokens, self.args.hidden)}")
            print(table_header(self.impls, self.args.check))
        print(f"{table_row(result, self.impls, self.args.check)}   [{self.done}/{self.total}, {self._elapsed()}]")
        self._print_new_notes(result)
        sys.stdout.flush()

    def _print_new_notes(self, result: CellResult) -> None:
        # One note per distinct reason, or cuDNN's head-dim refusal would repeat on every row.
        for name, m in result.measurements.items():
            if m.reason and (name, m.reason) not in self.notes_shown:
                self.notes_shown.add((name, m.reason))
                print(f"{'':>7}note: {name} {m.status}: {m.reason}")

    def _elapsed(self) -> str:
        return f"{time.perf_counter() - self.start:.0f} s"


# ---------------------------------------------------------------- JSON and environment


def _git_commit() -> Optional[str]:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def environment(device: torch.device) -> dict[str, Any]:
    env = {
        "fa2_inductor": __version__,
        "kernel_loaded": _extension.C is not None,
        "kernel_status": _extension.status,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": str(device),
        "git_commit": _git_commit(),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = f"sm_{major}{minor}"
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def write_json(path: Path, document: dict) -> None:
    """Replaces ``path`` in one step, so a run killed mid-write leaves the previous cell's file intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=1))
    os.replace(partial, path)


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("seqlens", "head_dims", "dtypes", "causal", "impls", "warmup", "reps", "check", "tokens", "hidden", "seed")
    return {
        **{key: getattr(args, key) for key in keys},
        "time_budget_ms": TIME_BUDGET_MS,
        "tolerances": {name: TOLERANCES[dtype] for name, dtype in DTYPES.items()},
    }


# ---------------------------------------------------------------- plot


def _seqlen_label(seqlen: int) -> str:
    return f"{seqlen // 1024}k" if seqlen >= 1024 and seqlen % 1024 == 0 else str(seqlen)


def draw_plot(records: Sequence[dict], impls: Sequence[str], path: Path, title: str) -> bool:
    """TFLOP/s against seqlen per implementation, one subplot per (dtype, causal) row and head dim column.

    Returns False (and says so) when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on the GPU machine
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plot was drawn: pip install matplotlib (or the 'bench' extra)")
        return False
    rows = list(dict.fromkeys((r["dtype"], r["causal"]) for r in records))
    head_dims = sorted({r["head_dim"] for r in records})
    figure, axes = plt.subplots(
        len(rows), len(head_dims), figsize=(4.5 * len(head_dims), 3.4 * len(rows)), squeeze=False
    )
    for (dtype, causal), row_axes in zip(rows, axes):
        for head_dim, ax in zip(head_dims, row_axes):
            group = [r for r in records if (r["dtype"], r["causal"], r["head_dim"]) == (dtype, causal, head_dim)]
            _plot_group(ax, group, impls)
            ax.set_title(f"{dtype}, {'causal' if causal else 'non-causal'}, head dim {head_dim}", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="upper center", ncol=len(impls), bbox_to_anchor=(0.5, 1.0))
    figure.suptitle(title, y=1.04)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return True


def _plot_group(ax, group: Sequence[dict], impls: Sequence[str]) -> None:
    seqlens = sorted({r["seqlen"] for r in group})
    for index, impl in enumerate(impls):
        points = [
            (r["seqlen"], r["measurements"][impl]["tflops"])
            for r in group
            if r["measurements"].get(impl, {}).get("status") == "ok"
        ]
        # Every implementation keeps its label and colour even where it ran nowhere, so the legend is whole.
        xs, ys = zip(*sorted(points)) if points else ((), ())
        ax.plot(xs, ys, marker="o", label=impl, color=f"C{index}")
    ax.set_xscale("log", base=2)
    if seqlens:
        ax.set_xticks(seqlens, [_seqlen_label(s) for s in seqlens])
    ax.set_xlabel("seqlen")
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)


def _plot_title(env: dict) -> str:
    return f"Attention forward, {env.get('gpu') or env['device']} (torch {env['torch']})"


# ---------------------------------------------------------------- command line


# ---------------------------------------------------------------- attention-mask rows


def _kernel_times_ms(fn: Callable, calls: int = 10) -> dict[str, float]:
    """Mean device time per call of each kernel ``fn`` launches (torch.profiler), by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        total_us = getattr(event, "device_time_total", None)
        if total_us is None:
            total_us = getattr(event, "cuda_time_total", 0.0)
        if total_us:
            times[event.key] = total_us / 1e3 / calls
    return times


def mask_rows(args: argparse.Namespace) -> int:
    """Masked-kernel rows on one shape family (bf16, D=128, batch·seqlen = --tokens, heads·D = --hidden).

    Each row times our op through ``flash_attention_fwd`` (CUDA events, median) next to its comparison,
    after checking the output against SDPA. Exit status 1 when a check fails or the kernel refused a mask.
    """
    device = torch.device(args.device)
    if device.type != "cuda":
        print("--masks needs a CUDA device")
        return 1
    dtype, d = torch.bfloat16, 128
    heads = max(1, args.hidden // d)
    op = torch.ops.fa2_inductor.flash_attention_fwd
    reps, warmup = max(args.reps, 10), max(args.warmup, 3)
    records, failed = [], False

    def med(fn: Callable) -> float:
        return statistics.median(time_cuda(fn, warmup=warmup, reps=reps))

    def sdpa_best(q, k, v, mask, scale) -> tuple[str, float]:
        best = ("none", float("nan"))
        for name, backend in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def call(backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            try:
                call()
                ms = med(call)
            except Exception:  # the backend refuses this mask / shape
                continue
            if not (best[1] <= ms):
                best = (name, ms)
        return best

    def inputs(seqlen_q: int, seqlen_k: int, batch: int):
        g = torch.Generator(device=device).manual_seed(args.seed)
        q = torch.randn(batch, heads, seqlen_q, d, device=device, dtype=dtype, generator=g)
        k = torch.randn(batch, heads, seqlen_k, d, device=device, dtype=dtype, generator=g)
        v = torch.randn(batch, heads, seqlen_k, d, device=device, dtype=dtype, generator=g)
        return q, k, v

    def check(name: str, q, k, v, mask, scale) -> bool:
        nonlocal failed
        reason = _cuda.kernel_unsupported_reason(q, k, v, mask, False)
        if reason is not None:
            print(f"{name}: kernel refused the mask ({reason})")
            failed = True
            return False
        out, _ = op(q, k, v, mask, scale, False)
        ref_mask = mask if mask.dtype == torch.bool else mask.to(q.dtype)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask, scale=scale)
        err = (out.float() - ref.float()).abs().max().item()
        ok = err <= 3e-2 + 3e-2 * ref.float().abs().max().item()
        if not ok:
            print(f"{name}: WRONG, max |ours - sdpa| = {err:.3e}")
            failed = True
        return ok

    def row(name: str, ours_ms: float, other: str, other_ms: float, note: str = "", **extra):
        ratio = other_ms / ours_ms if ours_ms > 0 else float("nan")
        print(f"{name:<44} ours {ours_ms:8.3f} ms | {other:<28} {other_ms:8.3f} ms | x{ratio:5.2f} {note}")
        records.append({"row": name, "ours_ms": ours_ms, "other": other, "other_ms": other_ms,
                        "speedup": ratio, **extra})

    env = environment(device)
    print(f"fa2_inductor {env['fa2_inductor']}, torch {env['torch']}, device {env.get('gpu') or env['device']}")
    print(f"mask rows: bf16, D={d}, heads={heads}, batch*seqlen={args.tokens}; median of {reps}")
    for seqlen in (2048, 4096, 8192):
        batch = max(1, args.tokens // seqlen)
        scale = d ** -0.5
        q, k, v = inputs(seqlen, seqlen, batch)
        i = torch.arange(seqlen, device=device)
        causal = (i[None, :] <= i[:, None])[None, None]
        if check(f"causal bool {seqlen}", q, k, v, causal, scale):
            t_mask = med(lambda: op(q, k, v, causal, scale, False))
            t_causal = med(lambda: op(q, k, v, None, scale, True))
            row(f"causal as bool [1,1,S,S] S={seqlen}", t_mask, "ours is_causal=True", t_causal,
                "(target: ours within 10%, i.e. x >= 0.91)", seqlen=seqlen, batch=batch)
            try:
                kt = _kernel_times_ms(lambda: op(q, k, v, causal, scale, False))
                pre = sum(ms for name, ms in kt.items() if "classify_mask_blocks" in name)
                main = sum(ms for name, ms in kt.items() if "fwd_kernel_sm90" in name)
                print(f"{'':<44} pre-pass {pre:.4f} ms, main kernel {main:.4f} ms (profiler, per call)")
                records[-1].update(prepass_ms=pre, main_kernel_ms=main)
            except Exception as exc:  # profiler unavailable: the rows above still stand
                print(f"{'':<44} pre-pass not measured: {_describe(exc)}")
        hf = torch.where(causal, 0.0, torch.finfo(torch.float32).min).to(torch.float32).expand(batch, 1, seqlen, seqlen)
        if check(f"hf additive {seqlen}", q, k, v, hf, scale):
            t_mask = med(lambda: op(q, k, v, hf, scale, False))
            t_causal = med(lambda: op(q, k, v, None, scale, True))
            row(f"HF causal float32 finfo.min [B,1,S,S] S={seqlen}", t_mask, "ours is_causal=True", t_causal,
                seqlen=seqlen, batch=batch)
        # padding: half the keys of every sequence visible vs no mask over exactly those keys
        visible = seqlen // 2
        pad = (i < visible)[None, None, None, :].expand(batch, 1, 1, seqlen)
        if check(f"padding {seqlen}", q, k, v, pad, scale):
            t_mask = med(lambda: op(q, k, v, pad, scale, False))
            kk, vv = k[:, :, :visible].contiguous(), v[:, :, :visible].contiguous()
            t_plain = med(lambda: op(q, kk, vv, None, scale, False))
            row(f"padding [B,1,1,S] S={seqlen} ({visible} visible)", t_mask, f"ours no mask Sk={visible}", t_plain,
                "(target: x >= 0.91)", seqlen=seqlen, batch=batch)
        sliding = ((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 1024))[None, None]
        if seqlen == 4096 and check(f"sliding {seqlen}", q, k, v, sliding, scale):
            t_mask = med(lambda: op(q, k, v, sliding, scale, False))
            name, t_sdpa = sdpa_best(q, k, v, sliding, scale)
            row(f"sliding window 1k bool [1,1,S,S] S={seqlen}", t_mask, f"sdpa {name} same mask", t_sdpa,
                "(target: x > 1)", seqlen=seqlen, batch=batch)
            bias = (-(i[:, None] - i[None, :]).abs().float() * 0.01)[None, None].expand(1, heads, seqlen, seqlen)
            bias = bias.to(dtype).contiguous()
            if check(f"t5 bias {seqlen}", q, k, v, bias, scale):
                t_mask = med(lambda: op(q, k, v, bias, scale, False))
                name, t_sdpa = sdpa_best(q, k, v, bias, scale)
                row(f"T5-like bias bf16 [1,H,S,S] S={seqlen} (all partial)", t_mask, f"sdpa {name} same mask",
                    t_sdpa, seqlen=seqlen, batch=batch)
            rnd = torch.rand(batch, 1, seqlen, seqlen, device=device) < 0.5
            rnd[..., 0] = True
            if check(f"random {seqlen}", q, k, v, rnd, scale):
                t_mask = med(lambda: op(q, k, v, rnd, scale, False))
                t_plain = med(lambda: op(q, k, v, None, scale, False))
                row(f"random bool [B,1,S,S] S={seqlen} (worst case)", t_mask, "ours no mask", t_plain,
                    seqlen=seqlen, batch=batch)
        del q, k, v
    write_json(args.json, {"environment": env, "mask_rows": records})
    print(f"JSON: {args.json}")
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fa2_inductor.bench",
        description="Forward attention TFLOP/s of fa2_inductor and torch SDPA backends on FlashAttention-paper shapes.",
    )
    full = FULL_SWEEP
    parser.add_argument("--seqlens", type=int, nargs="+", help=f"default {full['seqlens']}")
    parser.add_argument("--head-dims", type=int, nargs="+", help=f"default {full['head_dims']}")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help=f"default {full['dtypes']}")
    parser.add_argument("--causal", choices=sorted(CAUSAL_CHOICES), help="default both")
    parser.add_argument(
        "--impls", nargs="+", choices=list(IMPLEMENTATIONS), default=list(DEFAULT_IMPLS),
        help="default %(default)s; 'inductor' (torch.compile of a hand-written attention) costs a compile per cell",
    )
    parser.add_argument("--warmup", type=int, help=f"untimed calls per cell and implementation ({full['warmup']})")
    parser.add_argument("--reps", type=int, help=f"timed calls; the median counts ({full['reps']})")
    parser.add_argument(
        "--check", action=argparse.BooleanOptionalAction, default=True,
        help="compare each output with SDPA's before timing; a mismatch is marked WRONG and not timed (default on)",
    )
    parser.add_argument("--quick", action="store_true", help=f"a small sweep: {QUICK_SWEEP}; explicit flags still win")
    parser.add_argument("--tokens", type=int, default=PAPER_TOKENS, help="batch·seqlen (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=PAPER_HIDDEN, help="heads·head_dim (default %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("fa2_bench.json"), help="default %(default)s")
    parser.add_argument("--plot", type=Path, default=Path("fa2_bench.png"), help="default %(default)s")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only redraw --plot from a saved JSON")
    parser.add_argument(
        "--masks", action="store_true",
        help="only the attention-mask rows (bf16, D=128, --tokens/--hidden shapes): causal as a bool mask vs "
        "is_causal, padding vs no mask at the same visible keys, sliding window vs SDPA, HF/T5 additive masks, "
        "pre-pass cost; writes --json",
    )
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    for key, value in (QUICK_SWEEP if args.quick else FULL_SWEEP).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.impls = list(dict.fromkeys(args.impls))
    _validate(parser, args)
    return args


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.seqlens) < 1 or args.tokens < 1 or args.hidden < 1:
        parser.error("seqlens, --tokens and --hidden must be positive")
    if not all(1 <= d <= 256 for d in args.head_dims):
        parser.error("head dims must be between 1 and 256")
    if args.warmup < 0 or args.reps < 1:
        parser.error("--warmup must be >= 0 and --reps >= 1")
    if torch.device(args.device).type == "cpu" and args.replot is None:
        cells = sweep_cells(args.seqlens, args.head_dims, args.dtypes, (False,), args.tokens, args.hidden)
        if max(c.batch * c.heads * c.seqlen * c.seqlen for c in cells) > _MAX_CPU_SCORES:
            parser.error(
                "on the CPU the benchmark only tests its own logic; give tiny shapes, "
                "e.g. --tokens 64 --hidden 32 --seqlens 16 32 --head-dims 8 16"
            )


def run(args: argparse.Namespace) -> list[CellResult]:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the timers synchronise and record on the current device
    causal_flags = CAUSAL_CHOICES[args.causal]
    cells = sweep_cells(args.seqlens, args.head_dims, args.dtypes, causal_flags, args.tokens, args.hidden)
    env = environment(device)
    print(f"fa2_inductor {env['fa2_inductor']}, torch {env['torch']}, device {env.get('gpu') or env['device']}")
    print(f"kernel: {env['kernel_status']}")
    print(f"{len(cells)} cells x {len(args.impls)} implementations, warm-up {args.warmup}, median of {args.reps} "
          f"(fewer where timing one would pass {TIME_BUDGET_MS / 1000:.0f} s)")
    progress = Progress(len(cells), args.impls, args)
    results = []
    for cell in cells:
        progress.starting(cell)
        results.append(measure_cell(cell, args.impls, device, args))
        progress.finished(results[-1])
        document = {"environment": env, "settings": run_settings(args), "results": [r.to_record() for r in results]}
        write_json(args.json, document)
    print(f"\n{len(cells)} cells in {time.perf_counter() - progress.start:.0f} s; JSON: {args.json}")
    if draw_plot(document["results"], args.impls, args.plot, _plot_title(env)):
        print(f"plot: {args.plot}")
    return results


def replot(json_path: Path, plot_path: Path) -> None:
    document = json.loads(json_path.read_text())
    if draw_plot(document["results"], document["settings"]["impls"], plot_path, _plot_title(document["environment"])):
        print(f"plot: {plot_path}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status 1 when any implementation was WRONG or failed, so a script running the sweep notices."""
    args = parse_args(argv)
    if args.masks:
        return mask_rows(args)
    if args.replot is not None:
        replot(args.replot, args.plot)
        return 0
    results = run(args)
    failed = [m for r in results for m in r.measurements.values() if m.status in ("WRONG", "error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
