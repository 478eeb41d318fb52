"""``python -m fa2_inductor.bench --sites``: one attention site, the op against what Inductor would run there.

The graph pass must never make a site slower than plain Inductor. For the masks real models pass (key
padding, causal + key padding, causal, a decoder's cross-attention over padded encoder keys), at the head
shapes of real models and sequence lengths from 64 up, this times each call on the GPU (CUDA events,
median; the op's per-call CPU cost is left out, as a model hides it behind the GPU work of its other
layers: ``--sites-wall`` times calls back to back instead):

    op      torch.ops.fa2_inductor.flash_attention_fwd with the structured arguments the pass gives it
    sdpa    F.scaled_dot_product_attention with the dense additive [B, 1, Sq, Sk] mask Hugging Face builds
            (what Inductor calls for the site when the pass leaves it)

and prints op / sdpa per cell, and per shape and mask the shortest sequence from which the op is at least
as fast at every longer one: the threshold the pass's rule (``passes/support.py``) is set from.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..reference import EmptyRows
from .report import environment, write_json
from .timing import time_cuda

# (name, heads, kv heads, head dim): the attention shapes of the zoo's models.
HEAD_SHAPES = (("bert/gpt2 (12-16 x d64)", 12, 12, 64), ("llama-1b (32/8 x d64)", 32, 8, 64),
               ("llama-8b (32/8 x d128)", 32, 8, 128))
SEQLENS = (64, 128, 256, 512, 1024, 2048)
# cross+key_padding: a decoder's cross-attention over an encoder's padded keys (T5, BART, Whisper), with
# CROSS_QUERY_FRACTION as many queries as keys (the zoo's seq2seq decoders).
MASKS = ("key_padding", "causal+key_padding", "causal", "cross+key_padding")
CROSS_QUERY_FRACTION = 1 / 4
TOKENS = 16384  # batch x seqlen per cell


@dataclass
class SiteCell:
    shape: str
    mask: str
    batch: int
    seqlen: int  # keys (and queries, but for cross-attention)
    seqlen_q: int
    op_us: float
    sdpa_us: float

    @property
    def ratio(self) -> float:
        return self.op_us / self.sdpa_us


def _per_call_us(fn, calls: int, wall: bool) -> float:
    if not wall:
        return 1e3 * statistics.median(time_cuda(fn, warmup=3, reps=calls))
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _cell(shape, mask_kind: str, seqlen: int, calls: int, wall: bool) -> SiteCell:
    name, hq, hkv, d = shape
    batch = max(1, TOKENS // seqlen)
    seqlen_q = max(1, int(seqlen * CROSS_QUERY_FRACTION)) if mask_kind.startswith("cross") else seqlen
    g = torch.Generator(device="cuda").manual_seed(seqlen)
    q = torch.randn(batch, seqlen_q, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k, v = (torch.randn(batch, seqlen, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
            for _ in range(2))
    lengths = torch.randint(seqlen // 2, seqlen + 1, (batch,), device="cuda", generator=g)
    keys = torch.arange(seqlen, device="cuda")[None, :] < lengths[:, None]
    causal = "causal" in mask_kind
    key_mask = keys[:, None, None, :] if "key_padding" in mask_kind else None
    visible = torch.ones(seqlen_q, seqlen, dtype=torch.bool, device="cuda")
    if causal:
        visible = visible.tril()
    visible = visible[None, None] if key_mask is None else visible[None, None] & key_mask
    dense = torch.where(visible, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)
    k_rep, v_rep = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))  # HF's repeat_kv before SDPA
    op = torch.ops.fa2_inductor.flash_attention_fwd
    scale = d**-0.5
    empty_rows = int(EmptyRows.ALL_KEYS) if key_mask is not None else 0  # what cuDNN's -65504 fill asks for

    def run_op():
        op(q, k, v, key_mask, scale, causal, -1, empty_rows)

    def run_sdpa():
        F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=dense, scale=scale)

    return SiteCell(name, mask_kind, batch, seqlen, seqlen_q, _per_call_us(run_op, calls, wall),
                    _per_call_us(run_sdpa, calls, wall))


def crossovers(cells: list[SiteCell]) -> dict:
    """Per (shape, mask): the shortest seqlen from which the op is never slower at any longer one."""
    found = {}
    for key in dict.fromkeys((c.shape, c.mask) for c in cells):
        row = sorted((c for c in cells if (c.shape, c.mask) == key), key=lambda c: c.seqlen)
        safe = None
        for cell in reversed(row):
            if cell.ratio > 1.0:
                break
            safe = cell.seqlen
        found[f"{key[0]} | {key[1]}"] = safe
    return found


def run_sites(args) -> list[SiteCell]:
    cells = []
    print(f"{'shape':<26}{'mask':<20}{'B x Sq x Sk':>16}{'op us':>10}{'sdpa us':>10}{'op/sdpa':>9}")
    for shape in HEAD_SHAPES:
        for mask_kind in MASKS:
            for seqlen in SEQLENS:
                cell = _cell(shape, mask_kind, seqlen, calls=max(args.reps, 20), wall=args.sites_wall)
                cells.append(cell)
                sizes = f"{cell.batch}x{cell.seqlen_q}x{cell.seqlen}"
                print(f"{cell.shape:<26}{cell.mask:<20}{sizes:>16}{cell.op_us:>10.1f}{cell.sdpa_us:>10.1f}"
                      f"{cell.ratio:>9.2f}", flush=True)
    found = crossovers(cells)
    print("\nshortest seqlen from which the op is never slower:")
    for key, seqlen in found.items():
        print(f"  {key}: {seqlen if seqlen is not None else 'never'}")
    if args.json:
        write_json(args.json, {"environment": environment(torch.device("cuda")),
                               "cells": [{**asdict(c), "ratio": c.ratio} for c in cells], "crossovers": found})
    return cells
