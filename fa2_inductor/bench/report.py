"""What a run prints and saves: the table, cell by cell, and the JSON document with its environment."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from .. import __version__, _extension
from .cases import Cell
from .implementations import FA2
from .measure import CellResult, Measurement, ratio_name

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


def ratio_summary(results: Sequence[CellResult], impls: Sequence[str]) -> list[str]:
    """After the table: per implementation compared, the range and median of fa2_inductor's ratio over it
    and the cells below 1.0x, grouped by table section (their seqlens)."""
    lines = []
    ratios = [(r.cell, r.ratios()) for r in results]
    for impl in impls:
        name = ratio_name(impl)
        pairs = [(cell, cell_ratios[name]) for cell, cell_ratios in ratios if name in cell_ratios]
        if impl == FA2 or not pairs:
            continue
        values = sorted(value for _, value in pairs)
        below: dict[tuple, list[int]] = {}
        for cell, value in pairs:
            if value < 1.0:
                below.setdefault(cell.group, []).append(cell.seqlen)
        count = sum(len(seqlens) for seqlens in below.values())
        cells = f"{len(pairs)} cell" + ("s" if len(pairs) != 1 else "")
        lines.append(f"{name}: {values[0]:.2f}-{values[-1]:.2f}x over {cells} (median "
                     f"{statistics.median(values):.2f}x), below 1.0x in {count or 'none'}")
        for (dtype, causal, head_dim), seqlens in below.items():
            lines.append(f"    {dtype} {'causal' if causal else 'non-causal'} d{head_dim}: "
                         f"seqlen {', '.join(map(str, seqlens))}")
    return lines


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


def _git(*args: str) -> Optional[str]:
    """git's output in this package's checkout, or None where there is no git or no checkout."""
    try:
        result = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def environment(device: torch.device) -> dict[str, Any]:
    env = {
        "fa2_inductor": __version__,
        "kernel_loaded": _extension.C is not None,
        "kernel_status": _extension.status,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": str(device),
        "git_commit": _git("rev-parse", "HEAD") or None,
        # Tracked files changed since that commit: the numbers are of a tree the commit does not name.
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = f"sm_{major}{minor}"
        env["cudnn"] = torch.backends.cudnn.version()
    if _extension.C is not None:  # which head dims ran on a kernel of their own (FA2_INDUCTOR_HEAD_DIMS)
        env["kernel_head_dims"] = sorted({d for d, _ in _extension.C.compiled_kernels()})
    return env


def environment_line(env: dict) -> str:
    """The first line a run prints: what was measured, with which versions."""
    return f"fa2_inductor {env['fa2_inductor']}, torch {env['torch']}, device {env.get('gpu') or env['device']}"


def write_json(path: Path, document: dict) -> None:
    """Replaces ``path`` in one step, so a run killed mid-write leaves the previous cell's file intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=1))
    os.replace(partial, path)
