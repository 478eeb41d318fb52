"""The coverage table, its summary line, and the JSON file (rows plus the versions they were measured on)."""

from __future__ import annotations

import json
from pathlib import Path

from .results import COUNTED, Row, Status, by_family, family_status


def summary(rows: list[Row]) -> dict:
    """Families per verdict, and the headline numbers."""
    verdicts = {family: family_status(family_rows) for family, family_rows in by_family(rows).items()}
    counts = {status.value: sum(v is status for v in verdicts.values()) for status in Status}
    counted = sum(counts[status.value] for status in COUNTED)
    return {"families": len(verdicts), "counted": counted, "full": counts[Status.FULL.value], "by_status": counts}


def summary_line(rows: list[Row]) -> str:
    numbers = summary(rows)
    counts, counted = numbers["by_status"], numbers["counted"]
    share = f" ({100 * numbers['full'] / counted:.1f}%)" if counted else ""
    others = ", ".join(f"{counts[s.value]} {s.value.replace('_', ' ')}" for s in COUNTED if s is not Status.FULL)
    return (f"{numbers['full']} of {counted} families fully rewritten, logits equal to eager{share}; {others}; "
            f"not counted: {counts[Status.BEYOND_OP.value]} beyond the op, {counts[Status.SOFTMAX_ONLY.value]} softmax only, "
            f"{counts[Status.ATTENTION_FREE.value]} attention-free, "
            f"{counts[Status.BUILD_FAILED.value]} could not be built, {counts[Status.NOT_SUPPORTED.value]} not supported")


def table(rows: list[Row], implementations: list[str]) -> str:
    """One line per family: rewritten/total sites and max |diff| per implementation, the verdict, and why."""
    header = ["family", "model class", *implementations, "status", "why not fully rewritten"]
    lines = []
    for family, family_rows in by_family(rows).items():
        per_impl = {row.implementation: row for row in family_rows}
        cells = [family, family_rows[0].model_class]
        cells += [_cell(per_impl.get(impl)) for impl in implementations]
        status = family_status(family_rows)
        why = "; ".join(f"{row.implementation}: {row.why()}" for row in family_rows if row.why())
        lines.append([*cells, status.value, why])
    widths = [max(len(str(line[i])) for line in [header, *lines]) for i in range(len(header) - 1)]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1]
                     for line in [header, *lines])


def _cell(row: Row | None) -> str:
    if row is not None and row.status is Status.NOT_SUPPORTED:
        return "n/a"
    if row is None or row.status in (Status.BUILD_FAILED, Status.ATTENTION_FREE, Status.TIMED_OUT, Status.CRASHED):
        return "-"
    diff = f" {row.max_abs_diff:.0e}" if row.max_abs_diff is not None else ""
    return f"{row.sites_rewritten}/{row.sites_total}{diff}"


def defects(rows: list[Row]) -> list[Row]:
    return [row for row in rows if row.status.defect]


def write_json(path: Path, rows: list[Row], settings: dict) -> None:
    import torch
    import transformers

    document = {"torch": torch.__version__, "transformers": transformers.__version__, **settings,
                "summary": summary(rows), "rows": [row.to_json() for row in rows]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")


def read_json(path: Path) -> list[Row]:
    return [Row.from_json(data) for data in json.loads(Path(path).read_text())["rows"]]
