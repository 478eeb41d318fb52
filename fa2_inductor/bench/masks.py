"""``--masks``: the masked kernel on one shape family, each mask kind next to what it should be as fast as."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _cuda
from .implementations import one_cta_per_tile
from .measure import describe_exception
from .report import environment, environment_line, write_json
from .timing import every_median, medians_in_turns

DTYPE, HEAD_DIM = torch.bfloat16, 128
SEQLENS = [1024, 2048, 4096, 8192]  # or --seqlens
# Sliding window, T5 bias and random masks are timed at this seqlen only.
WINDOW_SEQLEN = 4096


def _kernel_times_ms(fn: Callable, calls: int = 10) -> dict[str, float]:
    """Mean device time per call of each kernel ``fn`` launches (torch.profiler), by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        total_us = getattr(event, "device_time_total", None)
        if total_us is None:
            total_us = getattr(event, "cuda_time_total", 0.0)
        if total_us:
            times[event.key] = total_us / 1e3 / calls
    return times


class _MaskRows:
    """The rows' shared settings, and the records and failures collected so far."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.device, self.seed, self.tokens = device, args.seed, args.tokens
        self.heads = max(1, args.hidden // HEAD_DIM)
        self.op = torch.ops.fa2_inductor.flash_attention_fwd
        self.reps, self.warmup = max(args.reps, 10), max(args.warmup, 3)
        self.records: list[dict] = []
        self.failed = False

    def pair(self, ours: Callable, other: Callable) -> tuple[float, float]:
        """Median ms of our call and its comparison, timed in turns (``medians_in_turns``); raises as one fails."""
        ms = every_median(medians_in_turns({"ours": ours, "other": other}, [()], self.device, warmup=self.warmup,
                                           reps=self.reps))
        return ms["ours"], ms["other"]

    def against_best_sdpa(self, ours: Callable, q, k, v, mask, scale) -> tuple[float, str, float]:
        """(our median ms, the fastest SDPA backend that takes the mask, its median ms), timed in turns."""
        calls = {}
        for name, backend in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def call(backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            try:
                call()
            except Exception:  # the backend refuses this mask / shape
                continue
            calls[name] = call
        ms = medians_in_turns({"ours": ours, **calls}, [()], self.device, warmup=self.warmup, reps=self.reps)
        ours_ms = ms.pop("ours")
        if isinstance(ours_ms, Exception):
            raise ours_ms
        sdpa = {name: t for name, t in ms.items() if not isinstance(t, Exception)}
        best = min(sdpa, key=sdpa.get) if sdpa else "none"
        return ours_ms, best, sdpa.get(best, float("nan"))

    def inputs(self, seqlen_q: int, seqlen_k: int, batch: int):
        g = torch.Generator(device=self.device).manual_seed(self.seed)
        q = torch.randn(batch, self.heads, seqlen_q, HEAD_DIM, device=self.device, dtype=DTYPE, generator=g)
        k = torch.randn(batch, self.heads, seqlen_k, HEAD_DIM, device=self.device, dtype=DTYPE, generator=g)
        v = torch.randn(batch, self.heads, seqlen_k, HEAD_DIM, device=self.device, dtype=DTYPE, generator=g)
        return q, k, v

    def check(self, name: str, q, k, v, mask, scale) -> bool:
        reason = _cuda.kernel_unsupported_reason(q, k, v, mask, False)
        if reason is not None:
            print(f"{name}: kernel refused the mask ({reason})")
            self.failed = True
            return False
        out, _ = self.op(q, k, v, mask, scale, False)
        ref_mask = mask if mask.dtype == torch.bool else mask.to(q.dtype)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask, scale=scale)
        err = (out.float() - ref.float()).abs().max().item()
        ok = err <= 3e-2 + 3e-2 * ref.float().abs().max().item()
        if not ok:
            print(f"{name}: WRONG, max |ours - sdpa| = {err:.3e}")
            self.failed = True
        return ok

    def row(self, name: str, ours_ms: float, other: str, other_ms: float, note: str = "", **extra):
        ratio = other_ms / ours_ms if ours_ms > 0 else float("nan")
        print(f"{name:<44} ours {ours_ms:8.3f} ms | {other:<28} {other_ms:8.3f} ms | x{ratio:5.2f} {note}")
        self.records.append({"row": name, "ours_ms": ours_ms, "other": other, "other_ms": other_ms,
                             "speedup": ratio, **extra})

    def split_prepass(self, call: Callable) -> None:
        """Adds the pre-pass (classification + visit lists) and main-kernel device times to the last row."""
        try:
            kt = _kernel_times_ms(call)
        except Exception as exc:  # profiler unavailable: the row itself still stands
            print(f"{'':<44} pre-pass not measured: {describe_exception(exc)}")
            return
        pre = sum(ms for name, ms in kt.items() if "classify_mask_blocks" in name or "list_visited_blocks" in name)
        main = sum(ms for name, ms in kt.items() if "fwd_kernel_sm90" in name)
        print(f"{'':<44} pre-pass {pre:.4f} ms, main kernel {main:.4f} ms (profiler, per call)")
        self.records[-1].update(prepass_ms=pre, main_kernel_ms=main)

    def at_seqlen(self, seqlen: int) -> None:
        """Every row of one seqlen; its tensors are freed on return, before the next seqlen allocates."""
        op, pair, check, row = self.op, self.pair, self.check, self.row
        batch = max(1, self.tokens // seqlen)
        scale = HEAD_DIM ** -0.5
        q, k, v = self.inputs(seqlen, seqlen, batch)
        i = torch.arange(seqlen, device=self.device)
        causal = (i[None, :] <= i[:, None])[None, None]
        if check(f"causal bool {seqlen}", q, k, v, causal, scale):
            t_mask, t_causal = pair(lambda: op(q, k, v, causal, scale, False), lambda: op(q, k, v, None, scale, True))
            row(f"causal as bool [1,1,S,S] S={seqlen}", t_mask, "ours is_causal=True", t_causal,
                "(target: ours within 10%, i.e. x >= 0.91)", seqlen=seqlen, batch=batch)
            self.split_prepass(lambda: op(q, k, v, causal, scale, False))
        hf = torch.where(causal, 0.0, torch.finfo(torch.float32).min).to(torch.float32).expand(batch, 1, seqlen, seqlen)
        if check(f"hf additive {seqlen}", q, k, v, hf, scale):
            t_mask, t_causal = pair(lambda: op(q, k, v, hf, scale, False), lambda: op(q, k, v, None, scale, True))
            row(f"HF causal float32 finfo.min [B,1,S,S] S={seqlen}", t_mask, "ours is_causal=True", t_causal,
                seqlen=seqlen, batch=batch)
        # padding: half the keys of every sequence visible vs no mask over exactly those keys
        visible = seqlen // 2
        pad = (i < visible)[None, None, None, :].expand(batch, 1, 1, seqlen)
        if check(f"padding {seqlen}", q, k, v, pad, scale):
            kk, vv = k[:, :, :visible].contiguous(), v[:, :, :visible].contiguous()
            t_mask, t_plain = pair(lambda: op(q, k, v, pad, scale, False), lambda: op(q, kk, vv, None, scale, False))
            row(f"padding [B,1,1,S] S={seqlen} ({visible} visible)", t_mask, f"ours no mask Sk={visible}", t_plain,
                "(target: x >= 0.91)", seqlen=seqlen, batch=batch)
            self.split_prepass(lambda: op(q, k, v, pad, scale, False))
            padded = functools.partial(op, q, k, v, pad, scale, False)
            t_mask, t_per_tile = pair(padded, one_cta_per_tile(padded))
            row(f"padding [B,1,1,S] S={seqlen}, persistent", t_mask, "ours one CTA per tile", t_per_tile,
                seqlen=seqlen, batch=batch)
        sliding = ((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 1024))[None, None]
        if seqlen == WINDOW_SEQLEN and check(f"sliding {seqlen}", q, k, v, sliding, scale):
            t_mask, name, t_sdpa = self.against_best_sdpa(lambda: op(q, k, v, sliding, scale, False), q, k, v, sliding,
                                                          scale)
            row(f"sliding window 1k bool [1,1,S,S] S={seqlen}", t_mask, f"sdpa {name} same mask", t_sdpa,
                "(target: x > 1)", seqlen=seqlen, batch=batch)
            bias = (-(i[:, None] - i[None, :]).abs().float() * 0.01)[None, None].expand(1, self.heads, seqlen, seqlen)
            bias = bias.to(DTYPE).contiguous()
            if check(f"t5 bias {seqlen}", q, k, v, bias, scale):
                t_mask, name, t_sdpa = self.against_best_sdpa(lambda: op(q, k, v, bias, scale, False), q, k, v, bias,
                                                              scale)
                row(f"T5-like bias bf16 [1,H,S,S] S={seqlen} (all partial)", t_mask, f"sdpa {name} same mask",
                    t_sdpa, seqlen=seqlen, batch=batch)
            rnd = torch.rand(batch, 1, seqlen, seqlen, device=self.device) < 0.5
            rnd[..., 0] = True
            if check(f"random {seqlen}", q, k, v, rnd, scale):
                t_mask, t_plain = pair(lambda: op(q, k, v, rnd, scale, False), lambda: op(q, k, v, None, scale, False))
                row(f"random bool [B,1,S,S] S={seqlen} (worst case)", t_mask, "ours no mask", t_plain,
                    seqlen=seqlen, batch=batch)


def mask_rows(args: argparse.Namespace) -> int:
    """Masked-kernel rows on one shape family (bf16, D=128, batch·seqlen = --tokens, heads·D = --hidden).

    Each row times our op through ``flash_attention_fwd`` (CUDA events, median) in turns with its comparison,
    after checking the output against SDPA. Exit status 1 when a check fails or the kernel refused a mask.
    """
    device = torch.device(args.device)
    if device.type != "cuda":
        print("--masks times the masked Hopper kernel: it needs --device cuda")
        return 1
    rows = _MaskRows(args, device)
    env = environment(device)
    print(environment_line(env))
    print(f"mask rows: bf16, D={HEAD_DIM}, heads={rows.heads}, batch*seqlen={args.tokens}; median of {rows.reps}, "
          "timed in turns")
    for seqlen in args.seqlens:
        rows.at_seqlen(seqlen)
        write_json(args.json, {"environment": env, "mask_rows": rows.records})  # a run cut short keeps these
    print(f"JSON: {args.json}")
    return 1 if rows.failed else 0
