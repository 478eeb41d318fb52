"""``python -m fa2_inductor.bench_e2e``: forward time of a whole Llama-shaped model, fa2_inductor against its peers.

A random-weight Llama (hidden 2048, 16 heads, 8 KV heads, 4 layers, bf16) runs, in every variant below
and in the same process, a forward pass over ``--seqlens`` tokens (prefill; batch 1, no padding), one
decode step (1 token against a static or a dynamic KV cache of that many tokens) and ``generate()`` of
32 greedy tokens after a prompt of that many (a static cache, its decode steps compiled the way transformers
compiles them: CUDA graphs, the variant's backend; timed per new token). Each is checked against
uncompiled SDPA (logits; generate: the tokens), then timed (median of ``--reps``):

    eager                      attn_implementation="eager", no compile
    eager-attn + Inductor      "eager",  torch.compile(backend="inductor")
    sdpa                       "sdpa", no compile
    sdpa + Inductor            "sdpa",   torch.compile(backend="inductor")
    fa2_inductor (eager attn)  "eager",  torch.compile(backend="fa2_inductor")
    fa2_inductor (sdpa attn)   "sdpa",   torch.compile(backend="fa2_inductor")
    fa2_inductor interface     attn_implementation="fa2_inductor" (fa2_inductor.hf), no compile

It prints ms and the ratio to "sdpa + Inductor" per phase and length, with how many attention sites the
pass rewrote (decode steps must never be slower than plain Inductor), and writes everything to ``--json``.
``--tiny`` runs a 2-layer float32 model on CPU with the pass enabled there (``config.rewrite_on_cpu``),
which is what the test uses.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch._dynamo.utils import counters

from . import config as fa2_config
from . import hf
from .bench import environment, exit_without_cuda, time_calls, write_json, zoo
from .bench.timing import keep_busy

BASELINE = "sdpa + Inductor"
PHASES = ("prefill", "decode", "decode_dynamic", "generate")
GENERATED_TOKENS = 32  # new tokens per timed generate() call


@dataclass(frozen=True)
class Variant:
    name: str
    attn_implementation: str
    backend: Optional[str]  # torch.compile backend; None runs the model uncompiled


VARIANTS = (
    Variant("eager", "eager", None),
    Variant("eager-attn + Inductor", "eager", "inductor"),
    Variant("sdpa", "sdpa", None),
    Variant(BASELINE, "sdpa", "inductor"),
    Variant("fa2_inductor (eager attn)", "eager", "fa2_inductor"),
    Variant("fa2_inductor (sdpa attn)", "sdpa", "fa2_inductor"),
    Variant("fa2_inductor interface", hf.NAME, None),
)

LLAMA_SHAPE = dict(
    hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, num_hidden_layers=4,
    intermediate_size=5632, vocab_size=32000,
)
TINY_SHAPE = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
    intermediate_size=128, vocab_size=128,
)


@dataclass
class Result:
    phase: str  # "prefill": the whole sequence; "decode": one token against a cache of seqlen tokens
    variant: str
    seqlen: int
    median_ms: Optional[float] = None
    rewrites: int = 0
    reference_fallbacks: int = 0  # op calls that ran the slow reference on the GPU (should be 0)
    counters: dict = field(default_factory=dict)  # every fa2_inductor counter (rewrite forms, refusals)
    max_abs_diff: Optional[float] = None
    tokens_differing: Optional[int] = None  # generate: new tokens unlike uncompiled SDPA's
    error: Optional[str] = None


def build_model(shape: dict, attn_implementation: str, dtype: torch.dtype, device: torch.device, max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same weights in every variant
    cfg = LlamaConfig(**shape, max_position_embeddings=max_len)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    return model.to(device).eval()


class Workload:
    """One phase at one length: the call to time, and the uncompiled SDPA logits it must reproduce.

    Decode phases run one new token against a KV cache already holding seqlen tokens: a StaticCache
    ("decode", the cache transformers compiles with; its mask depends on the cache position at run time)
    or a DynamicCache ("decode_dynamic": the keys are exactly the filled ones). Each call first rewinds
    the cache to seqlen tokens (the same cheap step in every variant), so every timed step sees the same state.
    """

    def __init__(self, phase: str, shape: dict, dtype, device, seqlen: int):
        from transformers import DynamicCache, StaticCache

        self.phase, self.seqlen = phase, seqlen
        ids = torch.randint(0, shape["vocab_size"], (1, seqlen + 1), generator=torch.Generator().manual_seed(1))
        ids = ids.to(device)
        reference_model = build_model(shape, "sdpa", dtype, device, seqlen + 1)
        self.kwargs = {"input_ids": ids[:, :seqlen]}
        if phase != "prefill":
            if phase == "decode":
                self.cache = StaticCache(config=reference_model.config, max_cache_len=seqlen + 1)
            else:
                self.cache = DynamicCache(config=reference_model.config)
            with torch.no_grad():
                reference_model(input_ids=ids[:, :seqlen], past_key_values=self.cache, use_cache=True)
            position = torch.tensor([seqlen], device=device)
            self.kwargs = {"input_ids": ids[:, seqlen:], "past_key_values": self.cache, "cache_position": position}
        with torch.no_grad():
            self.reference = self(reference_model)

    def __call__(self, forward) -> torch.Tensor:
        if self.phase == "decode":
            for layer in self.cache.layers:
                layer.cumulative_length.fill_(self.seqlen)
        elif self.phase == "decode_dynamic":
            self.cache.crop(self.seqlen)
        return forward(**self.kwargs).logits


def _record_counters(result: Result) -> None:
    """Every fa2_inductor counter of the variant's run, and how many op calls fell back to the reference."""
    result.counters = dict(counters["fa2_inductor"])
    result.reference_fallbacks = sum(n for key, n in result.counters.items() if key.startswith("reference_fallback:"))


def _error_line(exc: Exception) -> str:
    """A failed variant's exception in one short line for the table and the JSON."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' | '.join(lines[:2])}"[:300]


class Generation:
    """``generate()`` of GENERATED_TOKENS greedy tokens after a prompt of seqlen tokens, with a StaticCache.

    transformers compiles the decode steps itself (CompileConfig, mode "reduce-overhead": CUDA graphs on a GPU)
    with the variant's backend, and leaves the prefill uncompiled; uncompiled variants run with disable_compile.
    Timed per new token: generate(GENERATED_TOKENS) minus generate(1), over the decode steps between.
    """

    phase = "generate"

    def __init__(self, shape: dict, dtype, device, seqlen: int):
        self.seqlen = seqlen
        ids = torch.randint(0, shape["vocab_size"], (1, seqlen), generator=torch.Generator().manual_seed(1))
        self.ids = ids.to(device)
        reference_model = build_model(shape, "sdpa", dtype, device, seqlen + GENERATED_TOKENS)
        with torch.no_grad():
            self.reference = self.tokens(reference_model, None, GENERATED_TOKENS)

    def tokens(self, model, backend: Optional[str], count: int) -> torch.Tensor:
        from transformers import CompileConfig

        options = {"max_new_tokens": count, "min_new_tokens": count, "do_sample": False,
                   "cache_implementation": "static", "pad_token_id": 0}
        if backend is None:
            options["disable_compile"] = True
        else:
            options["compile_config"] = CompileConfig(backend=backend, dynamic=False)
            options["compile_config"]._compile_all_devices = True  # the CPU smoke run compiles too
        output = model.generate(self.ids, attention_mask=torch.ones_like(self.ids), **options)
        return output[:, self.seqlen:]


def run_generation(variant: Variant, workload: Generation, shape: dict, dtype, device, args) -> Result:
    result = Result(workload.phase, variant.name, workload.seqlen)
    torch._dynamo.reset()
    counters.clear()
    try:
        model = build_model(shape, variant.attn_implementation, dtype, device, workload.seqlen + GENERATED_TOKENS)
        with torch.no_grad():
            tokens = workload.tokens(model, variant.backend, GENERATED_TOKENS)  # compiles the decode step
            result.rewrites = counters["fa2_inductor"]["rewrites"]
            result.tokens_differing = int((tokens != workload.reference).sum())
            ms = {}
            for count in (GENERATED_TOKENS, 1):
                call = lambda: workload.tokens(model, variant.backend, count)  # noqa: E731
                ms[count] = statistics.median(time_calls(call, [()], device, warmup=args.warmup, reps=args.reps))
        result.median_ms = (ms[GENERATED_TOKENS] - ms[1]) / (GENERATED_TOKENS - 1)
        _record_counters(result)
    except Exception as exc:  # one failing variant must not lose the others
        result.error = _error_line(exc)
    return result


def run_variant(variant: Variant, workload: Workload, shape: dict, dtype, device, args) -> Result:
    result = Result(workload.phase, variant.name, workload.seqlen)
    torch._dynamo.reset()
    counters.clear()
    try:
        model = build_model(shape, variant.attn_implementation, dtype, device, workload.seqlen + 1)
        forward = model if variant.backend is None else torch.compile(model, backend=variant.backend, dynamic=False)
        with torch.no_grad():
            logits = workload(forward)  # compiles, and gives the output to check
            result.rewrites = counters["fa2_inductor"]["rewrites"]
            result.max_abs_diff = (logits.float() - workload.reference.float()).abs().max().item()
            del logits
            keep_busy(lambda: workload(forward), device)  # after the compile: GPU clocks back up
            times = time_calls(lambda: workload(forward), [()], device, warmup=args.warmup, reps=args.reps)
        result.median_ms = statistics.median(times)
        _record_counters(result)
    except Exception as exc:  # one failing variant (e.g. out of memory) must not lose the others
        result.error = _error_line(exc)
    return result


def format_table(results: list[Result]) -> str:
    lines = []
    for phase, seqlen in dict.fromkeys((r.phase, r.seqlen) for r in results):
        rows = [r for r in results if (r.phase, r.seqlen) == (phase, seqlen)]
        base = next((r.median_ms for r in rows if r.variant == BASELINE and r.median_ms), None)
        title = {"prefill": f"{seqlen} tokens", "generate": f"ms per new token after a prompt of {seqlen}"}.get(
            phase, f"1 token after {seqlen}")
        check = "tokens ≠" if phase == "generate" else "max|Δlogits|"
        lines.append(f"\n{phase}: {title}")
        lines.append(f"{'variant':<28}{'ms':>10}{'vs ' + BASELINE:>22}{'rewrites':>10}{check:>14}{'fallbacks':>11}")
        for r in rows:
            if r.error:
                lines.append(f"{r.variant:<28}{'failed: ' + r.error}")
                continue
            ratio = f"{base / r.median_ms:.2f}x" if base else "-"
            checked = f"{r.tokens_differing:>14}" if r.tokens_differing is not None else f"{r.max_abs_diff:>14.3g}"
            lines.append(f"{r.variant:<28}{r.median_ms:>10.2f}{ratio:>22}{r.rewrites:>10}{checked}{r.reference_fallbacks:>11}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", help="default: 2048 8192 (16 32 with --tiny)")
    parser.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS], default=[v.name for v in VARIANTS])
    parser.add_argument(
        "--phases", nargs="+", choices=PHASES, default=list(PHASES),
        help="decode: static KV cache; decode_dynamic: DynamicCache; generate: generate() with a static cache"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path, default=Path("bench_e2e.json"))
    parser.add_argument("--tiny", action="store_true", help="2-layer float32 model on CPU (for tests)")
    zoo.add_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> list:
    args = parse_args(argv)
    if not args.tiny:
        exit_without_cuda("python -m fa2_inductor.bench_e2e", "python -m fa2_inductor.bench_e2e --tiny")
    if args.zoo:
        return zoo.main(args)
    hf.register()
    if args.tiny:
        shape, dtype, device = TINY_SHAPE, torch.float32, torch.device("cpu")
        fa2_config.rewrite_on_cpu = True
    else:
        shape, dtype, device = LLAMA_SHAPE, torch.bfloat16, torch.device("cuda")
    seqlens = args.seqlens or ([16, 32] if args.tiny else [2048, 8192])
    variants = [v for v in VARIANTS if v.name in args.variants]
    results = []
    for phase in args.phases:
        for seqlen in seqlens:
            if phase == "generate":
                workload, run = Generation(shape, dtype, device, seqlen), run_generation
            else:
                workload, run = Workload(phase, shape, dtype, device, seqlen), run_variant
            for variant in variants:
                results.append(run(variant, workload, shape, dtype, device, args))
                r = results[-1]
                status = r.error or f"{r.median_ms:.3f} ms {r.counters or ''}"
                print(f"{phase:<8}{seqlen:>6} {variant.name:<28} {status}", flush=True)
            del workload
    print(format_table(results))
    document = {
        "environment": environment(device),
        "model": {**shape, "dtype": str(dtype), "batch": 1},
        "settings": {"phases": args.phases, "seqlens": seqlens, "warmup": args.warmup, "reps": args.reps, "tiny": args.tiny},
        "results": [asdict(r) for r in results],
    }
    write_json(args.json, document)
    print(f"\nwrote {args.json}")
    return results


if __name__ == "__main__":
    main()
