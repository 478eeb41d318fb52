"""Registers, stack and spills of every kernel in a build log, and the wgmma serialisation warnings.

    python scripts/ptxas_report.py build.log

The build passes ``-Xptxas=-v`` (setup.py), so the log of
``FA2_INDUCTOR_BUILD_CUDA=1 pip install -v --no-build-isolation -e .`` holds one report per kernel entry.
The first line printed is the summary; a kernel with spills, or any warning that ptxas serialised
wgmma instructions (C7510, C7512, C7515, C7520, ...: each names its cause), is a performance bug.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\w+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")
SERIALISED = re.compile(r"wgmma\.mma_async instructions are serialized")


def kernel_reports(log: str) -> list[dict]:
    """One record per kernel entry, in the log's order (the fields a report lacks stay None)."""
    reports: list[dict] = []
    for line in log.splitlines():
        entry = ENTRY.search(line)
        if entry:
            reports.append({"name": entry[1], "arch": entry[2], "registers": None, "stack": None, "spill_stores": None,
                            "spill_loads": None})
            continue
        if not reports:
            continue
        frame, registers = FRAME.search(line), REGISTERS.search(line)
        if frame and reports[-1]["stack"] is None:
            reports[-1].update(stack=int(frame[1]), spill_stores=int(frame[2]), spill_loads=int(frame[3]))
        elif registers and reports[-1]["registers"] is None:
            reports[-1]["registers"] = int(registers[1])
    return reports


def _without_parameters(name: str) -> str:
    """``void f<A, (B)0>(args)`` -> ``f<A, (B)0>``: the template arguments say which kernel it is."""
    depth = 0
    for i, char in enumerate(name):
        depth += {"<": 1, ">": -1}.get(char, 0)
        if char == "(" and depth == 0:
            name = name[:i]
            break
    return name.removeprefix("void ")


def _readable(names: list[str]) -> list[str]:
    """Demangled (c++filt, where installed) and without the parameter list."""
    if shutil.which("c++filt") and names:
        result = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
        if result.returncode == 0 and len(result.stdout.splitlines()) == len(names):
            names = [_without_parameters(name) for name in result.stdout.splitlines()]
    return [re.sub(r"\s+", " ", name)[:160] for name in names]


def summary(reports: list[dict], serialised: int) -> str:
    spilled = [r for r in reports if (r["spill_stores"] or 0) + (r["spill_loads"] or 0) > 0]
    registers = [r["registers"] for r in reports if r["registers"] is not None]
    span = f", {min(registers)}-{max(registers)} registers" if registers else ""
    return (f"ptxas: {len(reports)} kernel entries, {len(spilled)} with spills, "
            f"{serialised} wgmma serialisation warnings{span}")


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    log = Path(sys.argv[1]).read_text(errors="replace")
    reports = kernel_reports(log)
    warnings = [line.strip() for line in log.splitlines() if SERIALISED.search(line)]
    print(summary(reports, len(warnings)))
    print(f"{'regs':>5} {'stack':>6} {'spill st':>9} {'spill ld':>9}  kernel")
    for report, name in zip(reports, _readable([r["name"] for r in reports])):
        print(f"{report['registers'] or '?':>5} {report['stack'] or 0:>6} {report['spill_stores'] or 0:>9} "
              f"{report['spill_loads'] or 0:>9}  {report['arch']} {name}")
    for line in warnings[:20]:
        print("warning:", line[:240])
    return 0


if __name__ == "__main__":
    # `ptxas_report.py build.log | head` closes the pipe early: end quietly, as other filters do.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
