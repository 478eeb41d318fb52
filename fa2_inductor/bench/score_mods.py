"""``--score-mods``: what soft-capping and attention sinks cost the kernel, and FlexAttention doing the same.

Per head dim (causal, bf16, --tokens/--hidden shapes): our op without either, with ``softcap`` (Gemma 2's 50),
with per-head ``sinks`` (gpt-oss), and FlexAttention compiled with the same soft-capping as a score_mod (the
only peer that soft-caps; none takes sinks). Outputs are checked against the reference before timing.
"""

from __future__ import annotations

import argparse

import torch

from .. import reference
from .report import environment, environment_line, write_json
from .timing import every_median, medians_in_turns

SOFTCAP = 50.0
SEQLENS = (2048, 8192)
DTYPE = torch.bfloat16


def _flex_softcap(scale: float):
    """FlexAttention with ``SOFTCAP * tanh(s / SOFTCAP)`` on the scaled scores, causal through its block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v):
        block_mask = create_block_mask(causal, None, None, q.shape[2], k.shape[2], device=q.device)
        return lambda: compiled(q, k, v, score_mod=softcap, block_mask=block_mask, scale=scale)

    return run


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return (got.float() - expected.float()).abs().max().item() <= 3e-2 + 3e-2 * expected.float().abs().max().item()


def score_mod_rows(args: argparse.Namespace) -> int:
    """Exit status 1 when an output disagrees with the reference."""
    device = torch.device(args.device)
    env = environment(device)
    print(environment_line(env))
    op = torch.ops.fa2_inductor.flash_attention_fwd
    reps, warmup = max(args.reps, 10), max(args.warmup, 3)
    records, failed = [], False
    print(f"{'cell':<26}{'plain':>10}{'softcap':>10}{'sinks':>10}{'flex softcap':>14}  softcap cost  vs flex")
    for d in args.head_dims:
        for seqlen in SEQLENS:
            heads, batch = max(1, args.hidden // d), max(1, args.tokens // seqlen)
            g = torch.Generator(device=device).manual_seed(args.seed)
            q, k, v = (torch.randn(batch, heads, seqlen, d, device=device, dtype=DTYPE, generator=g) for _ in range(3))
            sinks = torch.linspace(-1.0, 2.0, heads, device=device)
            scale = d ** -0.5
            calls = {
                "plain": lambda: op(q, k, v, None, scale, True),
                "softcap": lambda: op(q, k, v, None, scale, True, -1, 0, SOFTCAP),
                "sinks": lambda: op(q, k, v, None, scale, True, -1, 0, 0.0, sinks),
                "flex_softcap": _flex_softcap(scale)(q, k, v),
            }
            small = (slice(None), slice(None), slice(0, 256))
            for name, extra in (("softcap", {"softcap": SOFTCAP}), ("sinks", {"sinks": sinks})):
                expected, _ = reference.attention_reference(q[small], k[small], v[small], None, scale, True, **extra)
                got = op(q[small].contiguous(), k[small].contiguous(), v[small].contiguous(), None, scale, True,
                         -1, 0, extra.get("softcap", 0.0), extra.get("sinks"))[0]
                if not _close(got, expected):
                    print(f"d={d} s={seqlen} {name}: WRONG against the reference")
                    failed = True
            ms = every_median(medians_in_turns(calls, [()], device, warmup=warmup, reps=reps))
            flops = 4 * batch * heads * seqlen * seqlen * d / 2
            record = {"head_dim": d, "seqlen": seqlen, "batch": batch, "heads": heads, "ms": ms,
                      "tflops": {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items()},
                      "softcap_cost": ms["softcap"] / ms["plain"] - 1, "vs_flex": ms["flex_softcap"] / ms["softcap"]}
            records.append(record)
            write_json(args.json, {"environment": env, "score_mod_rows": records})  # a run cut short keeps these
            t = record["tflops"]
            print(f"d={d:<4} s={seqlen:<6} b={batch:<4}{t['plain']:>10.0f}{t['softcap']:>10.0f}{t['sinks']:>10.0f}"
                  f"{t['flex_softcap']:>14.0f}  {100 * record['softcap_cost']:+10.1f}%  x{record['vs_flex']:.2f}")
    print("(TFLOP/s, causal; softcap cost = softcap / plain time - 1; vs flex = flex time / ours, > 1: ours faster)")
    print(f"JSON: {args.json}")
    return 1 if failed else 0
