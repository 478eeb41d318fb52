"""The command line: the sweep's flags, the run cell by cell, ``--replot`` and the other modes' dispatch.

It lives here rather than in ``__main__`` so that the package can re-export ``main`` without importing
``__main__`` (which ``python -m`` would then warn about and run a second time).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from .backward import backward_rows
from .decode import BATCHES as DECODE_BATCHES, CONTEXTS as DECODE_CONTEXTS, PEERS as DECODE_PEERS, decode_rows
from .cases import CAUSAL_CHOICES, DTYPES, PAPER_HIDDEN, PAPER_TOKENS, sweep_cells
from .implementations import DEFAULT_IMPLS, IMPLEMENTATIONS, TOLERANCES
from .masked_backward import SEQLENS as MASKED_TRAINING_SEQLENS
from .masked_backward import masked_backward_rows
from .masks import SEQLENS as MASK_ROWS_SEQLENS
from .masks import mask_rows
from .overhead import run_overhead
from .profiling import PROFILED_CALLS
from .score_mods import score_mod_rows
from .sites import run_sites
from .measure import CellResult, measure_cell
from .plot import draw_plot, plot_title
from .report import Progress, environment, environment_line, ratio_summary, write_json
from .timing import TIME_BUDGET_MS

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
# CPU runs exist to test the benchmark's logic; bigger problems would only make the test slow.
_MAX_CPU_SCORES = 1 << 22
CPU_SMOKE_FLAGS = "--device cpu --tokens 64 --hidden 32 --seqlens 16 32 --head-dims 8 16"


def exit_without_cuda(command: str, cpu_alternative: str) -> None:
    """One line instead of a traceback where a GPU benchmark is asked for on a machine without CUDA."""
    if not torch.cuda.is_available():
        raise SystemExit(
            f"{command} times the Hopper kernel and needs a CUDA GPU (none visible here); "
            f"to try its logic on the CPU: {cpu_alternative}"
        )


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
    parser.add_argument("--device", default="cuda", help="default %(default)s; cpu only tests the benchmark's logic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("fa2_bench.json"), help="default %(default)s")
    parser.add_argument("--plot", type=Path, default=Path("fa2_bench.png"), help="default %(default)s")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only redraw --plot from a saved JSON")
    parser.add_argument(
        "--sites", action="store_true",
        help="one attention site with real models' masks and head shapes: the op against SDPA with HF's dense mask "
        "(GPU time per call); the pass's short-sequence rule comes from it",
    )
    parser.add_argument("--sites-wall", action="store_true", help="--sites: time calls back to back (CPU cost included)")
    parser.add_argument(
        "--overhead", action="store_true",
        help="microseconds per call at a tiny shape (B=1, H=2, S=128, D=64, bf16), calls back to back: the op "
        "(no mask; key mask + causal; with ALL_KEYS) next to SDPA, under no_grad and inference_mode; writes --json",
    )
    parser.add_argument(
        "--masks", action="store_true",
        help="only the attention-mask rows (bf16, D=128, --tokens/--hidden shapes): causal as a bool mask vs "
        "is_causal, padding vs no mask at the same visible keys and vs one CTA per tile, sliding window vs SDPA, "
        f"HF/T5 additive masks, pre-pass cost; --seqlens default {MASK_ROWS_SEQLENS}; writes --json. "
        "With --backward: the masked training rows instead (see --backward)",
    )
    parser.add_argument(
        "--score-mods", action="store_true",
        help="only the soft-capping and sinks rows (causal, bf16, --head-dims at 2k and 8k): their cost against "
        "the plain kernel and FlexAttention's soft-capping; writes --json",
    )
    parser.add_argument(
        "--decode", action="store_true",
        help="only the decode-step rows (Sq=1, GQA 32/8, d128, bf16, contexts 512-32k, batches 1-32, dynamic and "
        "static KV cache): microseconds per call of the op and every SDPA backend; writes --json",
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=list(DECODE_CONTEXTS),
                        help="--decode: the filled cache lengths (default %(default)s)")
    parser.add_argument("--batches", type=int, nargs="+", default=list(DECODE_BATCHES),
                        help="--decode: the batch sizes (default %(default)s)")
    parser.add_argument("--peers", nargs="+", choices=list(DECODE_PEERS), default=list(DECODE_PEERS),
                        help="--decode: the SDPA backends timed beside the op (default %(default)s)")
    parser.add_argument("--splits", type=int, nargs="+", default=[], metavar="N",
                        help="--decode: also time the op with its key split count forced to each N (the kernel's "
                        "FA2_INDUCTOR_DECODE_SPLITS), in the same turns")
    parser.add_argument(
        "--profile", type=Path, metavar="TXT",
        help="--decode or --backward: each cell's calls (--backward: the backward alone) once more under "
        f"torch.profiler ({PROFILED_CALLS} calls each), the kernels' times appended to TXT: where a call's time goes "
        "(split and combine kernels; the backward's mainloop and the light kernels around it; launch gaps)",
    )
    parser.add_argument(
        "--backward", action="store_true",
        help="training rows instead: forward+backward and backward alone of fa2_inductor, sdpa_flash and "
        "sdpa_cudnn on the sweep's cells (gradients checked first); writes --json and two plots beside --plot. "
        "With --masks: masked training instead, forward+backward of our masks (causal as a bool tensor and "
        "is_causal, a 1024-key sliding window as window_left and as a bool tensor, a padding key mask, padding + "
        f"causal) next to FlexAttention's block masks (bf16, D=128, --tokens/--hidden shapes, --seqlens default "
        f"{MASKED_TRAINING_SEQLENS}); TFLOP/s over the visible pairs; --impls with fa2_per_tile adds our forms "
        "launched one CTA per tile; writes --json; --device cpu tests its logic",
    )
    return parser


def masked_training(args: argparse.Namespace) -> bool:
    return args.backward and args.masks


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    defaults = QUICK_SWEEP if args.quick else FULL_SWEEP
    if masked_training(args):
        defaults = {**defaults, "seqlens": MASKED_TRAINING_SEQLENS}
    elif args.masks:
        defaults = {**defaults, "seqlens": MASK_ROWS_SEQLENS}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.impls = list(dict.fromkeys(args.impls))
    _validate(parser, args)
    return args


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.seqlens) < 1 or args.tokens < 1 or args.hidden < 1:
        parser.error("seqlens, --tokens and --hidden must be positive")
    if min(args.contexts) < 1 or min(args.batches) < 1 or min(args.splits, default=1) < 1:
        parser.error("--contexts, --batches and --splits must be positive")
    if not args.decode and args.splits:
        parser.error("--splits is a --decode option")
    if args.profile and not (args.decode or (args.backward and not args.masks)):
        parser.error("--profile is a --decode or --backward (without --masks) option")
    if not all(1 <= d <= 256 for d in args.head_dims):
        parser.error("head dims must be between 1 and 256")
    if args.warmup < 0 or args.reps < 1:
        parser.error("--warmup must be >= 0 and --reps >= 1")
    if torch.device(args.device).type == "cpu" and args.replot is None and not args.overhead:
        cells = sweep_cells(args.seqlens, args.head_dims, args.dtypes, (False,), args.tokens, args.hidden)
        if max(c.batch * c.heads * c.seqlen * c.seqlen for c in cells) > _MAX_CPU_SCORES:
            parser.error(f"on the CPU the benchmark only tests its own logic; give tiny shapes, e.g. {CPU_SMOKE_FLAGS}")


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("seqlens", "head_dims", "dtypes", "causal", "impls", "warmup", "reps", "check", "tokens", "hidden", "seed")
    return {
        **{key: getattr(args, key) for key in keys},
        "time_budget_ms": TIME_BUDGET_MS,
        "tolerances": {name: TOLERANCES[dtype] for name, dtype in DTYPES.items()},
    }


def run(args: argparse.Namespace) -> list[CellResult]:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the timers synchronise and record on the current device
    causal_flags = CAUSAL_CHOICES[args.causal]
    cells = sweep_cells(args.seqlens, args.head_dims, args.dtypes, causal_flags, args.tokens, args.hidden)
    env = environment(device)
    print(environment_line(env))
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
    for line in ratio_summary(results, args.impls):
        print(line)
    if draw_plot(document["results"], args.impls, args.plot, plot_title(env)):
        print(f"plot: {args.plot}")
    return results


def replot(json_path: Path, plot_path: Path) -> None:
    document = json.loads(json_path.read_text())
    if draw_plot(document["results"], document["settings"]["impls"], plot_path, plot_title(document["environment"])):
        print(f"plot: {plot_path}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status 1 when any implementation was WRONG or failed, so a script running the sweep notices."""
    args = parse_args(argv)
    modes = [flag for flag in ("masks", "sites", "backward", "score_mods", "decode") if getattr(args, flag)]
    device_type = torch.device(args.device).type
    mode = "".join(f" --{flag.replace('_', '-')}" for flag in modes)
    # Masked training is the one mode whose logic also runs on the CPU (with the reference as our op).
    cpu_logic = masked_training(args) and device_type == "cpu"
    if args.replot is None and not cpu_logic and (modes or device_type == "cuda"):
        smoke_mode = mode if masked_training(args) else ""
        exit_without_cuda(f"python -m fa2_inductor.bench{mode}",
                          f"python -m fa2_inductor.bench{smoke_mode} {CPU_SMOKE_FLAGS}")
    if args.overhead:
        run_overhead(args)
        return 0
    if masked_training(args):
        return masked_backward_rows(args)
    if args.masks:
        return mask_rows(args)
    if args.sites:
        run_sites(args)
        return 0
    if args.backward:
        return backward_rows(args)
    if args.score_mods:
        return score_mod_rows(args)
    if args.decode:
        return decode_rows(args)
    if args.replot is not None:
        replot(args.replot, args.plot)
        return 0
    results = run(args)
    failed = [m for r in results for m in r.measurements.values() if m.status in ("WRONG", "error")]
    return 1 if failed else 0
