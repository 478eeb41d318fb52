"""``--decode``: one decode step's attention (Sq = 1) against a KV cache, our op next to every SDPA backend.

Llama-style GQA (Hq/Hkv 32/8, head dim 128, bf16) at contexts 512-32k and batches 1-32, in the two forms a
decode step takes in transformers:
- ``dynamic``: the cache holds exactly the context, no mask (DynamicCache);
- ``static``: a cache of ``STATIC_CACHE_LEN`` slots of which the context is filled, and the bool mask
  [B, 1, 1, slots] that hides the rest (StaticCache, what ``generate()`` compiles with).
Decode reads each K/V element once, so besides microseconds per call the table gives the bandwidth of the K/V
bytes the step must read (the filled slots). A peer that cannot run a form (flash takes no mask) is left out of
that row; one that takes no GQA runs on repeated K/V, as transformers calls it. ``--splits N ...`` adds our op with
its key split count forced to each N, timed in the same turns (the split planner's choices against the curve).
Each output is checked against the math backend before timing; input sets rotate past the L2 cache.
"""

from __future__ import annotations

import argparse
import os
import warnings
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .measure import describe_exception
from .profiling import PROFILED_CALLS, profile_calls, repeated
from .report import environment, environment_line, write_json
from .timing import input_set_count, medians_in_turns

CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
BATCHES = (1, 8, 32)
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
STATIC_CACHE_LEN = 32768
DTYPE = torch.bfloat16
L2_BYTES = 50 * 2**20
SPLITS_VARIABLE = "FA2_INDUCTOR_DECODE_SPLITS"
PEERS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}


def _inputs(batch: int, slots: int, context: int, static: bool, device, generator):
    q = torch.randn(batch, HEADS_Q, 1, HEAD_DIM, device=device, dtype=DTYPE, generator=generator)
    k, v = (torch.randn(batch, HEADS_KV, slots, HEAD_DIM, device=device, dtype=DTYPE, generator=generator)
            for _ in range(2))
    mask = None
    if static:
        mask = (torch.arange(slots, device=device) < context).view(1, 1, 1, slots).expand(batch, 1, 1, slots)
        mask = mask.contiguous()
    return q, k, v, mask


def _ours(q, k, v, mask):
    return torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, mask, HEAD_DIM ** -0.5, False)[0]


def _ours_with_splits(splits: int):
    """``_ours`` with its key split count forced (the kernel reads SPLITS_VARIABLE at each call)."""
    def call(q, k, v, mask):
        with mock.patch.dict(os.environ, {SPLITS_VARIABLE: str(splits)}):
            return _ours(q, k, v, mask)
    return call


def _peer_forms(backend: SDPBackend) -> tuple:
    """SDPA on one backend, in the forms to try in order: with enable_gqa, else on K/V repeated to Hq heads (as
    transformers calls a backend without GQA; the repeat is timed with the call)."""
    def native(q, k, v, mask):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def repeated(q, k, v, mask):
        group = q.shape[1] // k.shape[1]
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                  attn_mask=mask)

    return native, repeated


def _first_that_runs(forms: tuple, inputs: tuple):
    """(the first form that runs these inputs, its output), or (None, None) where none does. A backend that
    declines a form says why in warnings before it raises: expected here, so not printed per row."""
    for form in forms:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return form, form(*inputs)
        except RuntimeError:  # this backend does not take this form (e.g. flash and a mask)
            continue
    return None, None


def _expected(q, k, v, mask):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)


def decode_rows(args: argparse.Namespace) -> int:
    """Exit status 1 when our output disagrees with the math backend's."""
    device = torch.device(args.device)
    env = environment(device)
    print(environment_line(env))
    reps, warmup = max(args.reps, 20), max(args.warmup, 5)
    impls = {"fa2_inductor": (_ours,), **{f"fa2_inductor splits={n}": (_ours_with_splits(n),) for n in args.splits},
             **{name: _peer_forms(PEERS[name]) for name in args.peers}}
    records, failed = [], False
    if args.profile:
        args.profile.write_text(f"{PROFILED_CALLS} calls of each implementation per cell under torch.profiler, "
                                "after the timing\n")
    widths = {name: max(16, len(name) + 2) for name in impls}
    print(f"{'form':<8}{'ctx':>6}{'B':>4}" + "".join(f"{name:>{widths[name]}}" for name in impls)
          + "   best peer / ours  ours GB/s")
    for form in ("dynamic", "static"):
        for context in args.contexts:
            for batch in args.batches:
                slots = max(STATIC_CACHE_LEN, context) if form == "static" else context
                g = torch.Generator(device=device).manual_seed(args.seed)
                set_bytes = 2 * batch * HEADS_KV * slots * HEAD_DIM * DTYPE.itemsize
                sets = [_inputs(batch, slots, context, form == "static", device, g)
                        for _ in range(input_set_count(set_bytes, L2_BYTES, max_sets=4))]
                expected = _expected(*sets[0])
                checked = {}
                for name, forms in impls.items():
                    fn, got = _first_that_runs(forms, sets[0])  # chosen once per cell, not per timed call
                    if fn is None:
                        continue
                    if (got.float() - expected).abs().max().item() > 2e-2:
                        print(f"{form} ctx={context} B={batch} {name}: WRONG against the math backend")
                        failed |= name.startswith("fa2_inductor")
                        continue
                    checked[name] = fn
                us = {}
                for name, ms in medians_in_turns(checked, sets, device, warmup=warmup, reps=reps).items():
                    if isinstance(ms, Exception):
                        print(f"{form} ctx={context} B={batch} {name}: {describe_exception(ms)}")
                        failed |= name.startswith("fa2_inductor")
                    else:
                        us[name] = 1e3 * ms
                if args.profile:
                    profile_calls(args.profile, {name: repeated(fn, sets) for name, fn in checked.items()},
                                  f"{form} ctx={context} B={batch}", device)
                peers = {name: t for name, t in us.items() if name in PEERS}
                best = min(peers, key=peers.get) if peers else None
                read_bytes = 2 * batch * HEADS_KV * context * HEAD_DIM * DTYPE.itemsize
                record = {"form": form, "context": context, "batch": batch, "slots": slots, "us": us,
                          "best_peer": best,
                          "speedup_vs_best": peers[best] / us["fa2_inductor"] if best and "fa2_inductor" in us else None,
                          "ours_gbps": read_bytes / (us["fa2_inductor"] * 1e-6) / 1e9 if "fa2_inductor" in us else None}
                records.append(record)
                cells = "".join(f"{us[name]:>{widths[name]}.1f}" if name in us else f"{'-':>{widths[name]}}"
                                for name in impls)
                ratio = f"{record['speedup_vs_best']:.2f}x ({best})" if record["speedup_vs_best"] else "-"
                gbps = f"{record['ours_gbps']:.0f}" if record["ours_gbps"] else "-"
                print(f"{form:<8}{context:>6}{batch:>4}{cells}   {ratio:<18}{gbps:>8}")
                write_json(args.json, {"environment": env, "decode_rows": records})
    print(f"(microseconds per call, median of {reps}, timed in turns; Hq/Hkv {HEADS_Q}/{HEADS_KV}, d{HEAD_DIM}, bf16, "
          f"Sq 1; static: {STATIC_CACHE_LEN}-slot cache with a bool mask; GB/s: filled K/V bytes over our time)")
    print(f"JSON: {args.json}")
    return 1 if failed else 0
