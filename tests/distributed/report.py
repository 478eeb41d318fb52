"""Checks and tables for the multi-rank flows' results (the tests assert them; the GPU script prints them).

    python -m tests.distributed.report RESULTS_DIR      (reads fsdp2_1.json, fsdp2_2.json, tp_2.json, cp_*.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.distributed.llama_flows import ATTENTION_OPS, LAYERS, LOSS_RTOL

_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16"}
# Ours within 2x the plain model's error (against high precision), plus the dtype's epsilon for errors that
# are pure rounding noise (float32 gradients of ~1e-7).
_EPSILON = {"float32": 1.2e-7, "bfloat16": 7.9e-3}


def _loss_rtol(result: dict) -> float:
    import torch

    return LOSS_RTOL[getattr(torch, _DTYPES[result["ranks"][0]["dtype"]])]


def rewrite_problems(result: dict) -> list[str]:
    """Every rank rewrote its attention sites and ran the op for every layer, forward and backward."""
    problems = []
    for rank, r in enumerate(result["ranks"]):
        refused = {k: v for k, v in r["counters"].items() if k.startswith("refused")}
        if r["counters"].get("rewrites", 0) == 0 or refused:
            problems.append(f"rank {rank}: pass counters {r['counters']}")
        ran = {op: r["op_calls"].get(op, 0) for op in ATTENTION_OPS}
        leftover = {k: v for k, v in r["op_calls"].items() if k not in ATTENTION_OPS}
        if any(n != LAYERS for n in ran.values()) or leftover:
            problems.append(f"rank {rank}: one step ran {ran} (want {LAYERS} each), other attention ops {leftover}")
    return problems


def fsdp2_problems(one_rank: dict, two_ranks: dict) -> list[str]:
    problems = rewrite_problems(one_rank) + rewrite_problems(two_ranks)
    rtol = _loss_rtol(two_ranks)
    for step, (a, b) in enumerate(zip(one_rank["ranks"][0]["losses"], two_ranks["ranks"][0]["losses"])):
        if abs(a - b) > rtol * abs(a):
            problems.append(f"step {step}: loss {b} on 2 ranks vs {a} on 1 (rtol {rtol})")
    return problems


def tp_problems(result: dict) -> list[str]:
    problems = rewrite_problems(result)
    for rank, r in enumerate(result["ranks"]):
        epsilon = _EPSILON[_DTYPES[r["dtype"]]]
        for name, (ours, plain) in r["errors"].items():
            if ours > 2 * plain + epsilon:
                problems.append(f"rank {rank}: {name}: error {ours:.3g} > 2 x plain {plain:.3g} + {epsilon:g}")
    return problems


def fsdp2_table(one_rank: dict, two_ranks: dict) -> str:
    lines = [f"FSDP2, {_DTYPES[two_ranks['ranks'][0]['dtype']]} compute: mean loss per optimizer step",
             "step | 1 rank | 2 ranks | rel. diff"]
    for step, (a, b) in enumerate(zip(one_rank["ranks"][0]["losses"], two_ranks["ranks"][0]["losses"])):
        lines.append(f"{step + 1} | {a:.6f} | {b:.6f} | {abs(a - b) / abs(a):.2e}")
    return "\n".join(lines)


def tp_table(result: dict) -> str:
    r = result["ranks"][0]
    lines = [
        f"Tensor parallel on {result['world_size']} ranks, {_DTYPES[r['dtype']]}, {r['local_query_heads']} local query heads "
        "per rank: relative error against the model in high precision on one device",
        "tensor | compiled TP (ours) | plain model, 1 device",
    ]
    worst = sorted(r["errors"].items(), key=lambda kv: -kv[1][0] / max(kv[1][1], 1e-30))
    for name, (ours, plain) in [("logits", r["errors"]["logits"])] + [kv for kv in worst if kv[0] != "logits"][:6]:
        lines.append(f"{name} | {ours:.3e} | {plain:.3e}")
    return "\n".join(lines)


def counters_table(result: dict, title: str) -> str:
    lines = [f"{title}: pass counters and op calls in one training step, per rank"]
    for rank, r in enumerate(result["ranks"]):
        lines.append(f"rank {rank}: counters {r['counters']} | op calls {r['op_calls']}")
    return "\n".join(lines)


def main(results_dir: str) -> int:
    folder = Path(results_dir)

    def load(name):
        path = folder / name
        return json.loads(path.read_text()) if path.exists() else None

    problems = []
    fsdp2_1, fsdp2_2, tp = load("fsdp2_1.json"), load("fsdp2_2.json"), load("tp_2.json")
    if fsdp2_1 and fsdp2_2:
        print(fsdp2_table(fsdp2_1, fsdp2_2), counters_table(fsdp2_2, "FSDP2, 2 ranks"), sep="\n\n", end="\n\n")
        problems += [f"FSDP2: {p}" for p in fsdp2_problems(fsdp2_1, fsdp2_2)]
    if tp:
        print(tp_table(tp), counters_table(tp, "Tensor parallel, 2 ranks"), sep="\n\n", end="\n\n")
        problems += [f"TP: {p}" for p in tp_problems(tp)]
    for path in sorted(folder.glob("cp_*.json")):
        from fa2_inductor.distributed import bench_cp

        cp = json.loads(path.read_text())
        print(bench_cp.table(cp), end="\n\n")
        problems += [f"CP ({path.name}): {p}" for p in bench_cp.accuracy_problems(cp)]
    print("\n".join(problems) if problems else "all checks passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
