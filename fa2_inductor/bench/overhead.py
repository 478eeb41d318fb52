"""``python -m fa2_inductor.bench --overhead``: what one call costs, at a shape too small to hide it.

Real models make many short attention calls, so the host's cost per call (dispatch, checks, allocation,
launches) counts as much as the kernel. At B=1, H=2, S=128, D=64, bf16 every row calls one thing back to
back, ``CALLS_PER_BURST`` times with one synchronisation at the end, and reports microseconds per call
(median over ``--reps`` bursts, after ``--warmup`` untimed ones; the rows' bursts timed in turns):

    op: ...                 torch.ops.fa2_inductor.flash_attention_fwd (no mask; a key mask with causal; the
                            same with empty_rows=ALL_KEYS, the arguments the graph pass gives Hugging Face masks)
    flash_attention()       the public function (the default scale, then the op, which checks the call)
    sdpa: ...               F.scaled_dot_product_attention (no mask; causal; Hugging Face's dense mask)

Each row is timed twice: under ``torch.no_grad`` (model inference: the op's autograd layer, in C++ for CUDA
tensors, runs on every call) and under ``torch.inference_mode`` (which skips it).
When the calls are shorter than the GPU's work per call, the rows measure the GPU instead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..ops import flash_attention
from ..reference import EmptyRows
from .report import environment, environment_line, write_json
from .timing import turn_order

BATCH, HEADS, SEQLEN, HEAD_DIM = 1, 2, 128, 64
DTYPE = torch.bfloat16
CALLS_PER_BURST = 200
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@dataclass
class OverheadRow:
    name: str
    us_per_call: dict  # mode -> microseconds per call


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _burst_us(fn: Callable[[], object], device: torch.device) -> float:
    """One burst of ``CALLS_PER_BURST`` back-to-back calls (one sync at the end), in µs per call."""
    start = time.perf_counter()
    for _ in range(CALLS_PER_BURST):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / CALLS_PER_BURST * 1e6


def per_call_us_in_turns(fns: dict[str, Callable[[], object]], device: torch.device, *, warmup: int,
                         reps: int) -> dict[str, float]:
    """Each call's median µs per call over ``reps`` bursts, after ``warmup`` untimed ones. The bursts are timed
    in turns (round r runs one burst of each call, in ``turn_order``): timed one row after
    the other, the first (the op alone, under no_grad) read 20.3 µs on an H200 where flash_attention(),
    which calls it, read 15.7."""
    for fn in fns.values():
        for _ in range(warmup):
            _burst_us(fn, device)
    bursts: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(reps):
        for name in turn_order(fns, r):
            bursts[name].append(_burst_us(fns[name], device))
    return {name: statistics.median(times) for name, times in bursts.items()}


def calls(device: torch.device) -> dict[str, Callable[[], object]]:
    """The timed calls, by row name, on one set of tiny inputs."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, SEQLEN, HEAD_DIM, generator=g, device=device).to(DTYPE) for _ in range(3))
    keys = torch.arange(SEQLEN, device=device) < SEQLEN - 5  # the last keys padded
    key_mask = keys[None, None, None, :]
    visible = torch.ones(SEQLEN, SEQLEN, dtype=torch.bool, device=device).tril() & keys
    dense = torch.where(visible, 0.0, torch.finfo(DTYPE).min).to(DTYPE)[None, None]  # what HF builds for SDPA
    op = torch.ops.fa2_inductor.flash_attention_fwd.default
    scale = HEAD_DIM**-0.5
    all_keys = int(EmptyRows.ALL_KEYS)
    return {
        "op: no mask": lambda: op(q, k, v, None, scale, False),
        "op: key mask + causal": lambda: op(q, k, v, key_mask, scale, True),
        "op: key mask + causal, ALL_KEYS": lambda: op(q, k, v, key_mask, scale, True, -1, all_keys),
        "flash_attention(): no mask": lambda: flash_attention(q, k, v),
        "sdpa: no mask": lambda: F.scaled_dot_product_attention(q, k, v),
        "sdpa: causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa: dense mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
    }


def measure_rows(device: torch.device, *, warmup: int, reps: int) -> list[OverheadRow]:
    timed = calls(device)
    rows = [OverheadRow(name, {}) for name in timed]
    for mode, context in MODES.items():
        with context():
            us = per_call_us_in_turns(timed, device, warmup=warmup, reps=reps)
        for row in rows:
            row.us_per_call[mode] = us[row.name]
    return rows


def table(rows: list[OverheadRow]) -> str:
    lines = [f"{'call':<36}" + "".join(f"{mode + ' us':>20}" for mode in MODES)]
    for row in rows:
        lines.append(f"{row.name:<36}" + "".join(f"{row.us_per_call[mode]:>20.1f}" for mode in MODES))
    by_name = {row.name: row.us_per_call for row in rows}
    for op_row, sdpa_row in (("op: no mask", "sdpa: no mask"), ("op: key mask + causal, ALL_KEYS", "sdpa: dense mask")):
        ratios = ", ".join(f"{mode} {by_name[op_row][mode] / by_name[sdpa_row][mode]:.2f}x" for mode in MODES)
        lines.append(f"{op_row} / {sdpa_row}: {ratios}")
    return "\n".join(lines)


def run_overhead(args) -> list[OverheadRow]:
    device = torch.device(args.device)
    env = environment(device)
    print(environment_line(env))
    print(f"kernel: {env['kernel_status']}")
    print(f"B={BATCH} H={HEADS} S={SEQLEN} D={HEAD_DIM} {DTYPE}, {CALLS_PER_BURST} calls per burst, median of "
          f"{args.reps} bursts after {args.warmup}")
    if device.type != "cuda":
        print("note: not a CUDA device, so the op runs its reference; this only exercises the benchmark")
    rows = measure_rows(device, warmup=args.warmup, reps=args.reps)
    print(table(rows))
    if args.json:
        shape = {"batch": BATCH, "heads": HEADS, "seqlen": SEQLEN, "head_dim": HEAD_DIM, "dtype": str(DTYPE)}
        write_json(args.json, {"environment": env, "shape": shape, "calls_per_burst": CALLS_PER_BURST,
                               "warmup": args.warmup, "reps": args.reps, "rows": [asdict(r) for r in rows]})
        print(f"JSON: {args.json}")
    return rows
