"""``--backward``: training attention TFLOP/s, forward+backward and backward alone, next to SDPA FLASH and cuDNN.

Same FlashAttention-paper cells as the forward sweep (``sweep_cells``). FLOPs as the papers count them:
backward = 2.5x the forward's 4·B·H·S²·D (five GEMMs against two), forward+backward = 3.5x, halved when
causal. Every implementation runs the same inputs through autograd (``torch.autograd.grad``, the backward
alone on a retained graph); its gradients are checked against SDPA FLASH's (or the math backend's)
before timing, and a mismatch is marked WRONG and not timed. Ours must run our backward kernel: a cell it
does not cover is n/a (its fallback would be timed otherwise). With ``--profile`` each cell's backward calls
run once more under torch.profiler, their kernels' times appended to a text report (the mainloop against the
light kernels around it).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _cuda
from ..ops import flash_attention
from .implementations import one_cta_per_tile
from .cases import CAUSAL_CHOICES, DTYPES, Cell, attention_flops, sweep_cells
from .measure import CellResult, Measurement, describe_exception, timing_row
from .plot import draw_plot
from .profiling import PROFILED_CALLS, profile_calls, repeated
from .report import environment, environment_line, ratio_summary, write_json
from .timing import medians_in_turns

MODES = {"fwd+bwd": 3.5, "bwd": 2.5}  # FLOPs as multiples of the forward's
IMPLS = ("fa2_inductor", "sdpa_flash", "sdpa_cudnn")
PER_TILE = {"fa2_per_tile"}  # forward and backward calls of these run with one CTA per tile
# max |grad - reference| <= tolerance * max |reference| for each of dq, dk, dv.
GRAD_TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2}


class NotAvailable(Exception):
    """The implementation does not run this cell; the message says why."""


def _ours(q, k, v, causal, scale) -> Callable:
    reason = _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, None, causal, False)
    if reason is not None:
        raise NotAvailable(f"our backward kernel does not cover this cell ({reason})")
    return lambda: flash_attention(q, k, v, scale=scale, is_causal=causal)


def _sdpa(backend: SDPBackend) -> Callable:
    def build(q, k, v, causal, scale) -> Callable:
        def forward():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

        return forward

    return build


# name -> build(q, k, v, causal, scale) -> forward() -> out (differentiable); build raises NotAvailable.
FORWARDS: dict[str, Callable] = {
    "fa2_inductor": _ours,
    "fa2_per_tile": _ours,  # launched one CTA per tile: what the persistent grids gain (PER_TILE)
    "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
}


def _launched(name: str, call: Callable) -> Callable:
    """`call` as `name` runs it: with one CTA per tile for PER_TILE, else as it is."""
    return one_cta_per_tile(call) if name in PER_TILE else call


def _inputs(cell: Cell, device: torch.device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (cell.batch, cell.heads, cell.seqlen, cell.head_dim)
    dtype = DTYPES[cell.dtype]
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_(True) for _ in range(3))
    return q, k, v, torch.randn(shape, device=device, dtype=dtype, generator=gen)


def gradients_close(got, want, dtype) -> tuple[float, bool]:
    """(worst max |got - want| over the gradients, whether each is within GRAD_TOLERANCE)."""
    worst, ok = 0.0, True
    for g, w in zip(got, want):
        err = (g.float() - w.float()).abs().max().item()
        worst = max(worst, err)
        ok &= bool(err <= GRAD_TOLERANCE[dtype] * w.float().abs().max().item())
    return worst, ok


def measure_cell(cell: Cell, device: torch.device, args: argparse.Namespace) -> dict:
    """One cell: every implementation's fwd+bwd and bwd TFLOP/s (or n/a / WRONG / error with a reason). The
    implementations whose gradients agree are timed in turns, one mode after the other (``medians_in_turns``)."""
    q, k, v, g = _inputs(cell, device, args.seed)
    scale = cell.head_dim ** -0.5
    inputs = (q, k, v)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=cell.causal, scale=scale)
        reference = torch.autograd.grad(out, inputs, g)
    del out
    forward_flops = attention_flops(cell.batch, cell.heads, cell.seqlen, cell.seqlen, cell.head_dim, cell.causal)
    record = {"dtype": cell.dtype, "causal": cell.causal, "head_dim": cell.head_dim, "seqlen": cell.seqlen,
              "batch": cell.batch, "heads": cell.heads, "modes": {mode: {} for mode in MODES}}
    checked = {}  # name -> (forward, its output with the graph retained, max abs error)
    for name in args.impls:
        try:
            forward = FORWARDS[name](q, k, v, cell.causal, scale)
            out = _launched(name, forward)()
            gradients = _launched(name, lambda: torch.autograd.grad(out, inputs, g, retain_graph=True))()
            error, ok = gradients_close(gradients, reference, DTYPES[cell.dtype])
        except NotAvailable as exc:
            _set_every_mode(record, name, {"status": "n/a", "reason": str(exc)})
        except Exception as exc:  # a backend refusing the cell (cuDNN at head dim 256), out of memory, ...
            _set_every_mode(record, name, {"status": "error", "reason": describe_exception(exc)})
        else:
            if ok:
                checked[name] = (forward, out, error)
            else:
                _set_every_mode(record, name, {"status": "WRONG", "max_abs_error": error})
    steps = {
        "fwd+bwd": lambda forward, out: lambda: torch.autograd.grad(forward(), inputs, g),
        "bwd": lambda forward, out: lambda: torch.autograd.grad(out, inputs, g, retain_graph=True),
    }
    for mode, factor in MODES.items():
        calls = {name: _launched(name, steps[mode](forward, out)) for name, (forward, out, _) in checked.items()}
        for name, ms in medians_in_turns(calls, [()], device, warmup=args.warmup, reps=args.reps).items():
            record["modes"][mode][name] = {**timing_row(ms, factor * forward_flops), "max_abs_error": checked[name][2]}
    if args.profile:
        backward_calls = {name: repeated(_launched(name, steps["bwd"](forward, out)))
                          for name, (forward, out, _) in checked.items()}
        profile_calls(args.profile, backward_calls, f"{cell.dtype} {'causal' if cell.causal else 'non-causal'} "
                      f"d{cell.head_dim} seqlen {cell.seqlen} bwd", device)
    record["modes"] = {mode: {name: rows[name] for name in args.impls} for mode, rows in record["modes"].items()}
    return record


def _set_every_mode(record: dict, name: str, row: dict) -> None:
    for mode in MODES:
        record["modes"][mode][name] = dict(row)


def _row_text(record: dict, mode: str, impls) -> str:
    cells = record["modes"][mode]
    text = f"{record['seqlen']:>7}{record['batch']:>7}{record['heads']:>7}"
    for name in impls:
        m = cells[name]
        text += f"{(format(m['tflops'], '.1f') if m['status'] == 'ok' else m['status']):>14}"
    ours = cells.get("fa2_inductor", {})
    for name in impls:
        if name == "fa2_inductor":
            continue
        other = cells[name]
        ratio = "-"
        if ours.get("status") == "ok" and other["status"] == "ok":
            ratio = f"{ours['tflops'] / other['tflops']:.2f}x"
        text += f"{ratio:>16}"
    return text


def _header(impls) -> str:
    text = f"{'seqlen':>7}{'batch':>7}{'heads':>7}" + "".join(f"{name:>14}" for name in impls)
    return text + "".join(f"{'ours/' + name:>16}" for name in impls if name != "fa2_inductor")


def mode_summaries(cells: list[Cell], records: list[dict], impls) -> list[str]:
    """After the table: per mode, the forward sweep's ratio summary (range, median, cells below 1.0x)."""
    lines = []
    for mode in MODES:
        results = [CellResult(cell, {name: Measurement(m["status"], tflops=m.get("tflops"))
                                     for name, m in record["modes"][mode].items()})
                   for cell, record in zip(cells, records)]
        lines += [line if line.startswith(" ") else f"{mode} {line}" for line in ratio_summary(results, impls)]
    return lines


def _plot_records(records: list[dict], mode: str) -> list[dict]:
    """The records of one mode in the forward sweep's plot format."""
    return [{**{key: r[key] for key in ("dtype", "causal", "head_dim", "seqlen")}, "measurements": r["modes"][mode]}
            for r in records]


def backward_rows(args: argparse.Namespace) -> int:
    """The backward sweep. Exit status 1 when an implementation was WRONG or failed."""
    device = torch.device(args.device)
    if device.type != "cuda":
        print("--backward needs a CUDA device")
        return 1
    torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    impls = [name for name in args.impls if name in FORWARDS] or list(IMPLS)
    args.impls = impls
    cells = sweep_cells(args.seqlens, args.head_dims, args.dtypes, CAUSAL_CHOICES[args.causal], args.tokens, args.hidden)
    env = environment(device)
    print(environment_line(env))
    if args.profile:
        args.profile.write_text(f"{PROFILED_CALLS} backward calls of each implementation per cell under "
                                "torch.profiler, after the timing\n")
    print(f"backward sweep: {len(cells)} cells x {len(impls)} implementations x {list(MODES)}; "
          f"median of {args.reps}, timed in turns (TFLOP/s: backward = 2.5x, fwd+bwd = 3.5x the forward's FLOPs)")
    records, group, notes = [], None, set()
    for cell in cells:
        record = measure_cell(cell, device, args)
        records.append(record)
        if cell.group != group:
            group = cell.group
            print(f"\n{cell.dtype}, {'causal' if cell.causal else 'non-causal'}, head dim {cell.head_dim}  (TFLOP/s; "
                  f"batch·seqlen = {args.tokens}, heads·head_dim = {args.hidden})")
            print(f"{'mode':<8}" + _header(impls))
        for mode in MODES:
            print(f"{mode:<8}" + _row_text(record, mode, impls))
        for name, m in record["modes"]["bwd"].items():
            if m.get("reason") and (name, m["reason"]) not in notes:
                notes.add((name, m["reason"]))
                print(f"{'':>7}note: {name} {m['status']}: {m['reason']}")
        write_json(args.json, {"environment": env, "settings": {"impls": impls, "modes": MODES}, "backward": records})
        torch.cuda.empty_cache()
    print(f"\nJSON: {args.json}")
    for line in mode_summaries(cells, records, impls):
        print(line)
    for mode in MODES:
        path = Path(args.plot).with_name(f"{Path(args.plot).stem}_{mode.replace('+', '')}.png")
        title = f"Attention {mode}, {env.get('gpu') or env['device']} (torch {env['torch']})"
        if draw_plot(_plot_records(records, mode), impls, path, title):
            print(f"plot: {path}")
    failed = any(m["status"] in ("WRONG", "error") and name == "fa2_inductor"
                 for r in records for mode in MODES for name, m in r["modes"][mode].items())
    return 1 if failed else 0
