"""``python -m fa2_inductor.coverage [FAMILY ...] [--impls eager sdpa] [--json PATH [--resume]] [--timeout-s N] [--jobs N]``"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from . import models, report, run
from .results import Row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fa2_inductor.coverage",
        description="Builds a tiny random-weight model of each Hugging Face family the installed transformers "
                    "knows (no download), compiles it with backend='fa2_inductor' on CPU and reports, per family "
                    "and attention implementation, the attention sites rewritten and the logits' difference.")
    parser.add_argument("families", nargs="*", help="model types (e.g. llama bert); default: every family")
    parser.add_argument("--impls", nargs="+", default=list(models.IMPLEMENTATIONS), choices=models.IMPLEMENTATIONS,
                        help="attention implementations (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the rows and the summary to this JSON file")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="time limit per family and implementation, seconds (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=1, help="families measured side by side (default: %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the families already in the --json file (it is rewritten after every family, "
                             "so an interrupted sweep resumes where it stopped); rows of families this run does not "
                             "cover stay in it")
    args = parser.parse_args(argv)
    known = models.families()
    unknown = [family for family in args.families if family not in known]
    if unknown:
        parser.error(f"unknown families {unknown}; this transformers knows e.g. {known[:5]} ({len(known)} in all)")
    if args.timeout_s <= 0 or args.jobs < 1:
        parser.error("--timeout-s must be > 0 and --jobs >= 1")
    if args.resume and args.json is None:
        parser.error("--resume needs --json PATH")
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # as Ctrl-C: the children are killed, the JSON keeps the finished families


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _sweep(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sweep(args: argparse.Namespace) -> int:
    every_family = models.families()
    families = args.families or every_family
    settings = {"implementations": args.impls, "timeout_s": args.timeout_s}
    previous = report.read_json(args.json) if args.resume and args.json.exists() else []
    kept = [row for row in previous if row.family in families and row.implementation in args.impls]
    # Rows of families (or implementations) this run does not cover stay in the file: resuming a sweep of a
    # few families never drops the others' rows.
    others = [row for row in previous if not (row.family in families and row.implementation in args.impls)]
    finished = list(kept)
    order = {family: i for i, family in enumerate(every_family)}

    def document(rows: list[Row]) -> list[Row]:
        return sorted(others + rows, key=lambda row: order.get(row.family, len(order)))
    todo = [family for family in families if family not in {row.family for row in kept}]
    start = time.perf_counter()

    def progress(done: int, family: str, rows: list[Row], seconds: float) -> None:
        verdicts = ", ".join(f"{row.implementation} {row.status.value}" for row in rows)
        print(f"[{done}/{len(todo)}] {family}: {verdicts}  {seconds:.1f} s", file=sys.stderr, flush=True)
        finished.extend(rows)
        if args.json:
            report.write_json(args.json, document(finished), {**settings, "complete": False})

    run.run_all(todo, args.impls, args.timeout_s, args.jobs, progress)
    rows = sorted(finished, key=lambda row: order.get(row.family, len(order)))  # stable: implementations keep their order
    print(report.table(rows, args.impls))
    defects = report.defects(rows)
    if defects:
        print("\nDEFECTS (the pass or the compiled model is wrong here):")
        for row in defects:
            print(f"  {row.family} {row.implementation}: {row.status.meaning}: {row.why()}")
    print("\n" + report.summary_line(rows) + f"  [{time.perf_counter() - start:.0f} s]")
    if args.json:
        report.write_json(args.json, document(rows), {**settings, "complete": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
