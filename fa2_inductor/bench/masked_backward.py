"""``--backward --masks``: masked training, forward+backward of our masks next to FlexAttention's block masks.

One shape family (bf16, head dim 128, batch·seqlen = --tokens, heads·128 = --hidden) at each seqlen of
``SEQLENS`` (or --seqlens). Four masks, each in the forms our op takes and as a Flex block mask: causal
(a bool [1,1,S,S] tensor, and is_causal), a sliding window of ``WINDOW`` keys (window_left, and a bool
[1,1,S,S] tensor), padding (a key mask [B,1,1,S] with seeded per-sequence lengths) and padding with causal
(the key mask and is_causal). Every call is timed as its forward then one ``out.backward(grad)`` (median;
a mask's implementations timed in turns, so that clock drift reaches them alike);
its gradients are first checked against SDPA's with the same mask as a dense bool tensor, and a mismatch
is WRONG and not timed. FLOPs count the visible (query, key) pairs only: forward 4·B·H·pairs·D, backward
2.5x that. Flex is ``flex_attention`` compiled once, with its block mask built before timing; where Flex
does not run (its CPU path has no backward) its column is n/a with the reason. With ``fa2_per_tile`` among
--impls, each of our forms also runs launched one CTA per tile (what the persistent grids gain or lose on
masks), in the same turns.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _cuda
from ..ops import flash_attention
from .backward import MODES, gradients_close
from .implementations import FA2, one_cta_per_tile
from .measure import describe_exception, timing_row
from .report import environment, environment_line, write_json
from .timing import keep_busy, medians_in_turns

DTYPE, HEAD_DIM = torch.bfloat16, 128
SEQLENS = [2048, 8192]
# Keys a query sees in the sliding-window rows: itself and the WINDOW - 1 before it (at most half the
# sequence, so that below 2·WINDOW the window still differs from causal).
WINDOW = 1024
# Each padded sequence keeps a seeded, uniform share of the S keys in this range.
PADDED_LENGTHS = (0.5, 1.0)
FLEX = "flex"
PER_TILE = "fa2_per_tile"


@dataclass(frozen=True)
class Form:
    """One way of giving our op a mask: flash_attention's arguments besides q, k, v and scale."""

    name: str
    attn_mask: Optional[Tensor] = None
    is_causal: bool = False
    window_left: int = -1


@dataclass(frozen=True)
class MaskCase:
    """One mask: its meaning as a dense bool tensor, our forms of it and Flex's mask_mod."""

    name: str
    dense: Tensor  # bool, broadcastable to [B, 1, S, S]: SDPA's reference mask and the visible-pair count
    forms: list[Form]
    mask_mod: Callable
    flex_batch: Optional[int]  # None: one block mask for every sequence
    key_lengths: Optional[list[int]] = None


def window_keys(seqlen: int) -> int:
    return max(1, min(WINDOW, seqlen // 2))


def padded_lengths(batch: int, seqlen: int, seed: int) -> Tensor:
    """Each sequence's visible key count (on the CPU, the same on every device)."""
    low, high = (max(1, math.ceil(share * seqlen)) for share in PADDED_LENGTHS)
    return torch.randint(low, high + 1, (batch,), generator=torch.Generator().manual_seed(seed))


def mask_cases(batch: int, seqlen: int, device: torch.device, seed: int) -> list[MaskCase]:
    i = torch.arange(seqlen, device=device)
    causal = (i[None, :] <= i[:, None])[None, None]
    window = window_keys(seqlen)
    sliding = causal & (i[:, None] - i[None, :] < window)[None, None]
    lengths_cpu = padded_lengths(batch, seqlen, seed)
    lengths = lengths_cpu.to(device)
    keys = (i[None, :] < lengths[:, None])[:, None, None, :]

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    def padding_mod(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    def padded_causal_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx < lengths[b])

    square = "bool [1,1,S,S]"
    return [
        MaskCase("causal", causal, [Form(square, causal), Form("is_causal", is_causal=True)], causal_mod, None),
        MaskCase(f"sliding window {window}", sliding,
                 [Form(f"window_left={window - 1}", is_causal=True, window_left=window - 1), Form(square, sliding)],
                 sliding_mod, None),
        MaskCase("padding", keys, [Form("key mask [B,1,1,S]", keys)], padding_mod, batch, lengths_cpu.tolist()),
        MaskCase("padding + causal", keys & causal, [Form("key mask [B,1,1,S] + is_causal", keys, is_causal=True)],
                 padded_causal_mod, batch, lengths_cpu.tolist()),
    ]


def _kernel_gap(q: Tensor, k: Tensor, v: Tensor, form: Form) -> Optional[str]:
    """Why our kernels do not run this form on a GPU (their fallback would be timed otherwise), else None.
    On the CPU the reference runs: there the mode only tests its own logic."""
    if q.device.type != "cuda":
        return None
    return (_cuda.kernel_unsupported_reason(q, k, v, form.attn_mask, form.is_causal, form.window_left)
            or _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, form.attn_mask, form.is_causal, False,
                                                        form.window_left))


class _Runner:
    """The run's settings and inputs at one seqlen; measures each implementation of a mask."""

    def __init__(self, args: argparse.Namespace, device: torch.device, flex: Callable):
        self.args, self.device, self.flex = args, device, flex
        self.heads = max(1, args.hidden // HEAD_DIM)
        self.scale = HEAD_DIM ** -0.5

    def inputs(self, batch: int, seqlen: int) -> None:
        gen = torch.Generator(device=self.device).manual_seed(self.args.seed)
        shape = (batch, self.heads, seqlen, HEAD_DIM)
        self.q, self.k, self.v = (torch.randn(shape, device=self.device, dtype=DTYPE, generator=gen)
                                  .requires_grad_(True) for _ in range(3))
        self.grad = torch.randn(shape, device=self.device, dtype=DTYPE, generator=gen)

    def reference_gradients(self, dense: Tensor) -> tuple[Tensor, ...]:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=dense, scale=self.scale)
        return torch.autograd.grad(out, (self.q, self.k, self.v), self.grad)

    def step(self, forward: Callable[[], Tensor]) -> Callable[[], None]:
        """What is timed: a forward, then one backward into fresh .grad tensors."""
        q, k, v, grad = self.q, self.k, self.v, self.grad

        def call():
            q.grad = k.grad = v.grad = None
            forward().backward(grad)

        return call

    def checked(self, forward: Callable[[], Tensor], reference,
                per_tile: bool = False) -> tuple[Optional[Callable[[], None]], dict]:
        """(the step to time, its row so far) when its gradients agree with ``reference``, else (None, its
        WRONG row); raises as the implementation fails. per_tile: our kernels launched one CTA per tile."""
        call = one_cta_per_tile(self.step(forward)) if per_tile else self.step(forward)
        call()
        error, ok = gradients_close((self.q.grad, self.k.grad, self.v.grad), reference, DTYPE)
        return (call, {"max_abs_error": error}) if ok else (None, {"status": "WRONG", "max_abs_error": error})

    def ours(self, form: Form, reference, impl: str) -> tuple[Optional[Callable[[], None]], dict]:
        q, k, v = self.q, self.k, self.v
        gap = _kernel_gap(q, k, v, form)
        if gap is not None:
            return None, {"status": "n/a", "reason": f"our kernels do not cover this form ({gap})"}
        try:
            return self.checked(lambda: flash_attention(q, k, v, attn_mask=form.attn_mask, scale=self.scale,
                                                        is_causal=form.is_causal, window_left=form.window_left),
                                reference, per_tile=impl == PER_TILE and q.is_cuda)
        except Exception as exc:  # recorded, so the run goes on and the JSON says what broke
            return None, {"status": "error", "reason": describe_exception(exc)}

    def flex_attention(self, case: MaskCase, reference) -> tuple[Optional[Callable[[], None]], dict]:
        from torch.nn.attention.flex_attention import create_block_mask

        q, k, v = self.q, self.k, self.v
        try:
            block_mask = create_block_mask(case.mask_mod, case.flex_batch, None, q.shape[2], k.shape[2],
                                           device=q.device)
            return self.checked(lambda: self.flex(q, k, v, block_mask=block_mask, scale=self.scale), reference)
        except Exception as exc:  # e.g. no Flex backward on the CPU: the column is left out, the rows go on
            return None, {"status": "n/a", "reason": describe_exception(exc)}

    def timed(self, calls: dict, rows: dict, flops: float) -> None:
        """Times the checked calls in turns (``medians_in_turns``) and completes their rows."""
        keep_busy(lambda: [call() for call in calls.values()], self.device)  # Flex's compile clocked the GPU down
        for name, ms in medians_in_turns(calls, [()], self.device, warmup=self.args.warmup,
                                         reps=self.args.reps).items():
            rows[name].update(timing_row(ms, flops))

    def record(self, case: MaskCase, batch: int, seqlen: int) -> dict:
        visible = int(case.dense.expand(batch, 1, seqlen, seqlen).sum())
        flops = MODES["fwd+bwd"] * 4.0 * self.heads * visible * HEAD_DIM  # visible counts every sequence's pairs
        reference = self.reference_gradients(case.dense)
        ours = [FA2, PER_TILE] if PER_TILE in self.args.impls else [FA2]
        checked = {(impl, form.name): self.ours(form, reference, impl) for impl in ours for form in case.forms}
        checked[(FLEX, "block mask")] = self.flex_attention(case, reference)
        rows = {key: row for key, (_, row) in checked.items()}
        self.timed({key: call for key, (call, _) in checked.items() if call is not None}, rows, flops)
        flex = rows[(FLEX, "block mask")]
        measurements = [{"impl": impl, "form": form, **row} for (impl, form), row in rows.items()]
        for m in measurements:
            if m["impl"] != FLEX and m["status"] == "ok" and flex["status"] == "ok":
                m["speedup_vs_flex"] = flex["ms"] / m["ms"]
        record = {"mask": case.name, "seqlen": seqlen, "batch": batch, "heads": self.heads, "head_dim": HEAD_DIM,
                  "visible_pairs": visible, "visible_share": visible / (batch * seqlen * seqlen), "flops": flops,
                  "measurements": measurements}
        if case.key_lengths is not None:
            record["key_lengths"] = case.key_lengths
        return record


def _print_record(record: dict, notes: set) -> None:
    for m in record["measurements"]:
        numbers = f"{m['ms']:10.3f}{m['tflops']:10.3g}" if m["status"] == "ok" else f"{m['status']:>10}{'':>10}"
        speedup = f"x{m['speedup_vs_flex']:.2f}" if "speedup_vs_flex" in m else ""
        print(f"{record['mask']:<22}{record['seqlen']:>7}{record['batch']:>6}{record['visible_share']:>9.1%}  "
              f"{m['impl'] + ' ' + m['form']:<45}{numbers}{speedup:>10}")
        note = (m["impl"], m.get("reason"))
        if m.get("reason") and note not in notes:
            notes.add(note)
            print(f"{'':>7}note: {m['impl']} {m['status']}: {m['reason']}")


def masked_backward_rows(args: argparse.Namespace) -> int:
    """Exit status 1 when one of our calls was WRONG or failed."""
    from torch.nn.attention.flex_attention import flex_attention

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    env = environment(device)
    print(environment_line(env))
    runner = _Runner(args, device, torch.compile(flex_attention, dynamic=False))
    print(f"masked training: bf16, D={HEAD_DIM}, heads={runner.heads}, batch·seqlen={args.tokens}; forward + "
          f"backward, median of {args.reps} after {args.warmup} warm-up calls, timed in turns; TFLOP/s over the "
          "visible pairs "
          f"({MODES['fwd+bwd']} x 4·B·H·pairs·D); xN = Flex's time over ours (above 1: ours faster)")
    print(f"{'mask':<22}{'seqlen':>7}{'batch':>6}{'visible':>9}  {'implementation':<45}{'ms':>10}{'TFLOP/s':>10}"
          f"{'vs flex':>10}")
    settings = {"dtype": "bf16", "head_dim": HEAD_DIM, "tokens": args.tokens, "hidden": args.hidden,
                "seqlens": args.seqlens, "window": WINDOW, "padded_lengths": PADDED_LENGTHS, "warmup": args.warmup,
                "reps": args.reps, "seed": args.seed, "fwd_bwd_flops_factor": MODES["fwd+bwd"]}
    records, notes = [], set()
    for seqlen in args.seqlens:
        batch = max(1, args.tokens // seqlen)
        runner.inputs(batch, seqlen)
        cases = mask_cases(batch, seqlen, device, args.seed)
        # Each mask and seqlen compiles Flex anew; past the limit Dynamo would run Flex uncompiled.
        limit = torch._dynamo.config.recompile_limit + len(cases) * len(args.seqlens)
        with torch._dynamo.config.patch(recompile_limit=limit):
            for case in cases:
                records.append(runner.record(case, batch, seqlen))
                _print_record(records[-1], notes)
                write_json(args.json, {"environment": env, "settings": settings, "masked_backward": records})
        del cases
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"JSON: {args.json}")
    failed = any(m["impl"] != FLEX and m["status"] in ("WRONG", "error")
                 for r in records for m in r["measurements"])
    return 1 if failed else 0
