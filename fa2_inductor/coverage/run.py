"""Families measured in child processes, side by side, each implementation under a time limit.

One child per family measures its implementations in turn (``measure``); the parent watches the marker
files it writes. An implementation past the time limit has its child's whole process group killed and
becomes a row (timed out, or a build failure if it never ran uncompiled); a child that dies becomes a row
too; the family's remaining implementations go to a fresh child. So a hang or a crash is a row, never a
dead sweep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Iterable

from .results import Row, Status

POLL_S = 0.2
_stopping = threading.Event()
# The child: ``CHILD_COMMAND + [family, result_dir, *implementations]`` (see ``measure``).
CHILD_COMMAND = [sys.executable, "-m", "fa2_inductor.coverage.measure"]


def run_family(family: str, implementations: Iterable[str], timeout_s: float) -> list[Row]:
    rows: list[Row] = []
    remaining = list(implementations)
    with tempfile.TemporaryDirectory(prefix=f"fa2_coverage_{family}_") as folder:
        folder = Path(folder)
        while remaining:
            rows += _run_child(family, remaining, folder, timeout_s)
            done = {row.implementation for row in rows}
            remaining = [impl for impl in remaining if impl not in done]
    return rows


def _run_child(family: str, implementations: list[str], folder: Path, timeout_s: float) -> list[Row]:
    """Rows for the implementations this child finished, plus one for the implementation it stopped in."""
    log = folder / "child.log"
    with open(log, "w") as stderr:
        child = subprocess.Popen(
            [*CHILD_COMMAND, family, str(folder), *implementations],
            stdout=stderr, stderr=subprocess.STDOUT, start_new_session=True,  # a group: kill its compile workers too
        )
        started = time.time()  # wall clock, as the markers' modification times
        timed_out = False
        while child.poll() is None:
            if _stopping.is_set():  # the sweep was interrupted: no orphaned children
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                raise KeyboardInterrupt
            current = _current(folder, implementations)
            marker = folder / f"{current}.started"
            since = marker.stat().st_mtime if current and marker.exists() else started
            if time.time() - max(since, started) > timeout_s:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                timed_out = True
                break
            time.sleep(POLL_S)
    rows = [Row.from_json(json.loads((folder / f"{impl}.json").read_text()))
            for impl in implementations if (folder / f"{impl}.json").exists()]
    if len(rows) < len(implementations):
        rows.append(_stopped_row(family, _current(folder, implementations), folder, timed_out, child.returncode, log, timeout_s))
    for name in implementations:  # a fresh child starts with clean markers
        for suffix in (".started", ".built", ".json"):
            (folder / f"{name}{suffix}").unlink(missing_ok=True)
    return rows


def _current(folder: Path, implementations: list[str]):
    """The first implementation without a row yet (None once all have one)."""
    return next((impl for impl in implementations if not (folder / f"{impl}.json").exists()), None)


def _stopped_row(family, implementation, folder, timed_out, returncode, log: Path, timeout_s) -> Row:
    built = (folder / f"{implementation}.built").exists()
    if timed_out:
        if built:
            return Row(family, implementation, Status.TIMED_OUT, seconds=timeout_s)
        return Row(family, implementation, Status.BUILD_FAILED, error=f"timed out after {timeout_s:g} s", seconds=timeout_s)
    lines = log.read_text(errors="replace").strip().splitlines()
    error = f"the process died (exit code {returncode})" + (f": {lines[-1][:160]}" if lines else "")
    return Row(family, implementation, Status.CRASHED if built else Status.BUILD_FAILED, error=error)


def run_all(families: list[str], implementations: Iterable[str], timeout_s: float, jobs: int,
            on_family_done: Callable[[int, str, list[Row], float], None] = lambda *_: None) -> list[Row]:
    """Rows of every family × implementation, in the families' order; ``on_family_done(done, family,
    rows, seconds)`` is called as each family finishes (in finishing order)."""
    implementations = list(implementations)
    results: dict[str, list[Row]] = {}
    _stopping.clear()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(_timed, run_family, family, implementations, timeout_s): family for family in families}
        try:
            for done, future in enumerate(as_completed(futures), 1):
                family = futures[future]
                results[family], seconds = future.result()
                on_family_done(done, family, results[family], seconds)
        except BaseException:
            _stopping.set()
            for future in futures:
                future.cancel()
            raise
    return [row for family in families for row in results[family]]


def _timed(function, *args):
    start = time.perf_counter()
    return function(*args), time.perf_counter() - start

