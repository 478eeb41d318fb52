"""``python -m fa2_inductor.bench_e2e``: a whole Llama-shaped model, fa2_inductor against its peers.

A random-weight Llama (hidden 2048, 16 heads, 8 KV heads, 4 layers, bf16) runs, in every variant below
and in the same process, over ``--seqlens`` tokens. Inference phases (the default): a forward pass
(prefill; batch 1, no padding), one decode step (1 token against a static or a dynamic KV cache of that
many tokens) and ``generate()`` of 32 greedy tokens after a prompt of that many (one static cache per model,
reset before each call, its decode steps compiled the way transformers compiles them: CUDA graphs, the
variant's backend; timed per new token).
Training phases (``--phases train train_padded``): one training step without an optimizer (forward with
labels, the loss, ``loss.backward()``; the model in train mode, gradients set to None before each step),
called as a tokenizer and a collator feed it: ``train`` is batch 1 with an ``attention_mask`` of ones,
``train_padded`` batch 2 whose second row is right-padded to 3/4 of the length (mask 0 and labels -100 on
the padding). Each is checked against uncompiled SDPA (logits; generate: the tokens; training: the loss and
the gradients of the first layer's q/k/v projections and the last layer's o_proj), then all the variants of a
phase and length are timed together, in turns (median of up to ``--reps``; ``run_phase`` says why):

    eager                      attn_implementation="eager", no compile
    eager-attn + Inductor      "eager",  torch.compile(backend="inductor")
    sdpa                       "sdpa", no compile
    sdpa + Inductor            "sdpa",   torch.compile(backend="inductor")
    fa2_inductor (eager attn)  "eager",  torch.compile(backend="fa2_inductor")
    fa2_inductor (sdpa attn)   "sdpa",   torch.compile(backend="fa2_inductor")
    fa2_inductor interface     attn_implementation="fa2_inductor" (fa2_inductor.hf), no compile

It prints ms and the ratio to "sdpa + Inductor" per phase and length, with how many attention sites the
pass rewrote (decode steps must never be slower than plain Inductor) and how many op calls fell back
(to the reference; training: backward calls that did not run our backward kernel), and writes everything,
with every fa2_inductor counter, to ``--json`` (rewritten after every phase and length: a run cut short keeps
what it finished). ``--tiny`` runs a 2-layer float32 model on CPU with the pass
enabled there (``config.rewrite_on_cpu``), which is what the test uses.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch._dynamo.utils import counters

from . import config as fa2_config
from . import hf
from .bench import environment, exit_without_cuda, time_calls, write_json, zoo
from .bench.profiling import PROFILE_HEADER, profile_calls
from .bench.timing import medians, time_compiled_in_turns, turn_order

BASELINE = "sdpa + Inductor"
INFERENCE_PHASES = ("prefill", "decode", "decode_dynamic", "generate")
TRAINING_PHASES = ("train", "train_padded")
PHASES = INFERENCE_PHASES + TRAINING_PHASES
GENERATED_TOKENS = 32  # new tokens per timed generate() call
PADDED_ROW_FRACTION = 0.75  # train_padded: the second row's tokens, as a fraction of seqlen; padding after them
IGNORED_LABEL = -100  # what a collator puts in the labels where the loss must not look (transformers' ignore_index)


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
    phase: str  # "prefill": the whole sequence; "decode": one token against a cache of seqlen tokens; ...
    variant: str
    seqlen: int
    median_ms: Optional[float] = None
    rewrites: int = 0
    # Counted over the first (checked) call of the phase, which every timed call repeats:
    reference_fallbacks: int = 0  # op calls that ran the slow reference on the GPU (should be 0)
    backward_fallbacks: int = 0  # op backward calls that did not run our backward kernel
    counters: dict = field(default_factory=dict)  # every fa2_inductor counter (rewrite forms, refusals, fallbacks)
    max_abs_diff: Optional[float] = None  # max|Δlogits|
    tokens_differing: Optional[int] = None  # generate: new tokens unlike uncompiled SDPA's
    loss_diff: Optional[float] = None  # training: |Δloss|
    grad_rel_diff: Optional[float] = None  # training: max over checked_gradients() of max|Δgrad| / max|grad|
    profile_wall_ms: Optional[float] = None  # --profile: one more call under the profiler, start to end
    profile_device_ms: Optional[float] = None  # --profile: the time the GPU was busy with that call's kernels
    error: Optional[str] = None


def build_model(shape: dict, attn_implementation: str, dtype: torch.dtype, device: torch.device, max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same weights in every variant
    cfg = LlamaConfig(**shape, max_position_embeddings=max_len)
    # Initialised where it runs: on the CPU the benchmark model's 320M weights took 5 s per build (2 cores), and a
    # phase builds the reference and every variant.
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


class Workload:
    """One inference phase at one length: the call to time, and the uncompiled SDPA logits it must reproduce.

    Decode phases run one new token against a KV cache already holding seqlen tokens: a StaticCache
    ("decode", the cache transformers compiles with; its mask depends on the cache position at run time)
    or a DynamicCache ("decode_dynamic": the keys are exactly the filled ones). Each call first rewinds
    the cache to seqlen tokens (the same cheap step in every variant), so every timed step sees the same state.
    """

    training = False

    def __init__(self, phase: str, shape: dict, dtype, device, seqlen: int):
        from transformers import DynamicCache, StaticCache

        self.phase, self.seqlen, self.max_len = phase, seqlen, seqlen + 1
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

    def check(self, result: Result, logits: torch.Tensor, model) -> None:
        result.max_abs_diff = (logits.float() - self.reference.float()).abs().max().item()


def checked_gradients(model) -> dict:
    """The parameter gradients a training step is checked on: the first layer's q/k/v projections (the
    attention backward's dq, dk, dv, padding keys included) and the last layer's o_proj (the attention output)."""
    last = model.config.num_hidden_layers - 1
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    names.append(f"model.layers.{last}.self_attn.o_proj.weight")
    grads = {name: model.get_parameter(name).grad for name in names}
    missing = [name for name, grad in grads.items() if grad is None]
    if missing:
        raise RuntimeError(f"the training step left no gradient on {', '.join(missing)}")
    return grads


class TrainingStep:
    """One training step at one length, without an optimizer: gradients set to None, forward with labels (the
    model computes the loss), ``loss.backward()``; the step's loss and checked gradients are what uncompiled
    SDPA's must match. The model is called as a tokenizer and a collator feed it, with an ``attention_mask``:

    "train": batch 1, seqlen tokens, the mask all ones (the prefill's shape, for training);
    "train_padded": batch 2 of seqlen, the second row right-padded after PADDED_ROW_FRACTION of seqlen
    (pad token 0, mask 0 and labels IGNORED_LABEL on the padding). The tokens are fixed per length.
    No KV cache (``use_cache=False``): a training step has no use for one.
    """

    training = True

    def __init__(self, phase: str, shape: dict, dtype, device, seqlen: int):
        self.phase, self.seqlen, self.max_len = phase, seqlen, seqlen
        batch = 2 if phase == "train_padded" else 1
        ids = torch.randint(0, shape["vocab_size"], (batch, seqlen), generator=torch.Generator().manual_seed(1))
        attention_mask = torch.ones_like(ids)
        if phase == "train_padded":
            attention_mask[1, int(seqlen * PADDED_ROW_FRACTION):] = 0
        padding = attention_mask == 0
        self.kwargs = {"input_ids": ids.masked_fill(padding, 0).to(device), "attention_mask": attention_mask.to(device),
                       "labels": ids.masked_fill(padding, IGNORED_LABEL).to(device), "use_cache": False}
        reference_model = build_model(shape, "sdpa", dtype, device, self.max_len).train()
        self.loss = self(reference_model)
        self.gradients = checked_gradients(reference_model)

    def __call__(self, forward) -> torch.Tensor:
        forward.zero_grad(set_to_none=True)  # a compiled model's parameters are its module's
        loss = forward(**self.kwargs).loss
        loss.backward()
        return loss.detach()

    def check(self, result: Result, loss: torch.Tensor, model) -> None:
        result.loss_diff = (loss.float() - self.loss.float()).abs().item()
        relative = []
        for name, grad in checked_gradients(model).items():
            reference = self.gradients[name].float()
            relative.append(((grad.float() - reference).abs().max() / reference.abs().max()).item())
        result.grad_rel_diff = max(relative)


def _record_counters(result: Result) -> None:
    """Every fa2_inductor counter so far, the sites rewritten and how many op calls fell back (to the
    reference; in the backward, away from our kernel)."""
    result.counters = dict(counters["fa2_inductor"])
    result.rewrites = result.counters.get("rewrites", 0)
    result.reference_fallbacks = sum(n for key, n in result.counters.items() if key.startswith("reference_fallback:"))
    result.backward_fallbacks = sum(n for key, n in result.counters.items() if key.startswith("backward_fallback:"))


def _release_memory(device: torch.device) -> None:
    """Gives a finished variant's model, gradients and compiled graphs back before the next one is built
    (eager attention's training step at 8k tokens needs tens of GB of its own)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error_line(exc: Exception) -> str:
    """A failed variant's exception in one short line for the table and the JSON."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' | '.join(lines[:2])}"[:300]


class Generation:
    """``generate()`` of GENERATED_TOKENS greedy tokens after a prompt of seqlen tokens, with a StaticCache.

    transformers compiles the decode steps itself (CompileConfig, mode "reduce-overhead": CUDA graphs on a GPU)
    with the variant's backend, and leaves the prefill uncompiled; uncompiled variants run with disable_compile.
    Each model keeps one StaticCache across its generate() calls, reset before each, as a serving loop does:
    a cache made per call (generate()'s own) gives the CUDA graphs new static input addresses, and the
    graphs are re-recorded in the first decode step of a call whenever the allocator does not hand the old
    ones back, a cost that swamps the attention's.
    Timed per new token: generate(GENERATED_TOKENS) minus generate(1), over the decode steps between.
    """

    phase = "generate"

    def __init__(self, shape: dict, dtype, device, seqlen: int):
        self.seqlen = seqlen
        self.caches = weakref.WeakKeyDictionary()  # model -> its StaticCache
        ids = torch.randint(0, shape["vocab_size"], (1, seqlen), generator=torch.Generator().manual_seed(1))
        self.ids = ids.to(device)
        reference_model = build_model(shape, "sdpa", dtype, device, seqlen + GENERATED_TOKENS)
        with torch.no_grad():
            self.reference = self.tokens(reference_model, None, GENERATED_TOKENS)

    def tokens(self, model, backend: Optional[str], count: int) -> torch.Tensor:
        from transformers import CompileConfig, StaticCache

        if model not in self.caches:
            self.caches[model] = StaticCache(config=model.config, max_cache_len=self.seqlen + GENERATED_TOKENS)
        cache = self.caches[model]
        cache.reset()
        options = {"max_new_tokens": count, "min_new_tokens": count, "do_sample": False,
                   "past_key_values": cache, "pad_token_id": 0}
        if backend is None:
            options["disable_compile"] = True
        else:
            options["compile_config"] = CompileConfig(backend=backend, dynamic=False)
            options["compile_config"]._compile_all_devices = True  # the CPU smoke run compiles too
        output = model.generate(self.ids, attention_mask=torch.ones_like(self.ids), **options)
        return output[:, self.seqlen:]


def run_generations(variants: list[Variant], workload: Generation, shape: dict, dtype, device, args) -> list[Result]:
    """Every variant's generate(): each model built and its decode step compiled first (rewrites, fallbacks and
    tokens recorded then), then all timed together in ``--reps`` rounds, the order reversed every round: a run
    drifts (host clocks, caches; generate() is host-bound at this size), and timing one variant after the
    other gave later variants up to 1.7x better times whatever they were. Per new token: the median over the
    rounds of generate(GENERATED_TOKENS) minus generate(1), over the decode steps between."""
    results, ready = [], []
    torch._dynamo.reset()
    recompile_limit = torch._dynamo.config.recompile_limit + len(variants)  # one decode-step entry per model
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=recompile_limit):
        for variant in variants:
            result = Result(workload.phase, variant.name, workload.seqlen)
            counters.clear()
            try:
                model = build_model(shape, variant.attn_implementation, dtype, device, workload.seqlen + GENERATED_TOKENS)
                tokens = workload.tokens(model, variant.backend, GENERATED_TOKENS)  # compiles the decode step
                result.tokens_differing = int((tokens != workload.reference).sum())
                _record_counters(result)
                ready.append((variant, result, model, []))
            except Exception as exc:
                result.error = _error_line(exc)
            results.append(result)
        for round_index in range(args.reps):
            for variant, result, model, per_token in turn_order(ready, round_index):
                if result.error:
                    continue
                try:
                    ms = {}
                    for count in (GENERATED_TOKENS, 1):
                        call = lambda: workload.tokens(model, variant.backend, count)  # noqa: E731
                        warmup = args.warmup if round_index == 0 else 0
                        ms[count] = statistics.median(time_calls(call, [()], device, warmup=warmup, reps=1))
                    per_token.append((ms[GENERATED_TOKENS] - ms[1]) / (GENERATED_TOKENS - 1))
                except Exception as exc:
                    result.error = _error_line(exc)
    for _, result, _, per_token in ready:
        if not result.error:
            result.median_ms = statistics.median(per_token)
    del ready
    _release_memory(device)
    return results


def _prepare(variant: Variant, workload, result: Result, shape: dict, dtype, device) -> Callable[[], object]:
    """The variant's model built (and compiled) and called once: the call's counters recorded and its output
    checked. Returns the call to time."""
    model = build_model(shape, variant.attn_implementation, dtype, device, workload.max_len).train(workload.training)
    forward = model if variant.backend is None else torch.compile(model, backend=variant.backend, dynamic=False)
    output = workload(forward)  # compiles, and gives the output to check
    _record_counters(result)  # of this one call: the timed calls repeat it
    workload.check(result, output, model)
    return lambda: workload(forward)


def run_phase(variants: list[Variant], workload, shape: dict, dtype, device, args) -> list[Result]:
    """Every variant on one phase and length: each model built, compiled, called and checked first, then all
    timed together in turns (``time_compiled_in_turns``: one call of each per round, the order reversed every other
    round), so that the GPU's clocks drifting over the phase reach every variant alike. Timed one after the
    other, a variant's time depended on what ran before it: the zoo's t5-base, every site refused and so
    plain Inductor's code, read 1.20x and 1.72x the time of plain Inductor on the H200. The models and
    compiled graphs are gone when this returns."""
    results, calls = [], {}
    torch._dynamo.reset()
    # The compiled models share their class's code, each with a cache entry of its own (guarded by its
    # backend and attention implementation).
    recompile_limit = torch._dynamo.config.recompile_limit + len(variants)
    with torch._dynamo.config.patch(recompile_limit=recompile_limit), torch.set_grad_enabled(workload.training):
        for variant in variants:
            result = Result(workload.phase, variant.name, workload.seqlen)
            counters.clear()
            try:
                calls[variant.name] = _prepare(variant, workload, result, shape, dtype, device)
            except Exception as exc:  # one failing variant (e.g. out of memory) must not lose the others
                result.error = _error_line(exc)
            results.append(result)
        timed = medians(time_compiled_in_turns(calls, device, warmup=args.warmup, reps=args.reps))
        title = f"{workload.phase} {workload.seqlen}"
        profiles = profile_calls(args.profile, calls, title, device) if args.profile else {}
    for result in results:
        median, profile = timed.get(result.variant), profiles.get(result.variant)
        if isinstance(median, Exception):
            result.error = _error_line(median)
        elif median is not None:
            result.median_ms = median
        if profile is not None:
            result.profile_wall_ms, result.profile_device_ms = profile.wall_ms, profile.device_ms
    del calls
    _release_memory(device)
    return results


def _print_progress(r: Result) -> None:
    status = r.error or f"{r.median_ms:.3f} ms {r.counters or ''}"
    print(f"{r.phase:<12}{r.seqlen:>6} {r.variant:<28} {status}", flush=True)


def _phase_title(phase: str, seqlen: int) -> str:
    if phase == "train":
        return f"one training step (forward, loss, backward), {seqlen} tokens"
    if phase == "train_padded":
        return (f"one training step, batch 2 of {seqlen} tokens, the second row padded after "
                f"{int(seqlen * PADDED_ROW_FRACTION)}")
    return {"prefill": f"{seqlen} tokens", "generate": f"ms per new token after a prompt of {seqlen}"}.get(
        phase, f"1 token after {seqlen}")


def _checked_columns(phase: str) -> dict:
    """The table's columns after the rewrites for a phase: header -> Result field."""
    if phase == "generate":
        return {"tokens ≠": "tokens_differing", "fallbacks": "reference_fallbacks"}
    if phase in TRAINING_PHASES:
        return {"|Δloss|": "loss_diff", "max rel Δgrad": "grad_rel_diff", "fallbacks": "reference_fallbacks",
                "bwd fallbacks": "backward_fallbacks"}
    return {"max|Δlogits|": "max_abs_diff", "fallbacks": "reference_fallbacks"}


def format_table(results: list[Result]) -> str:
    lines = []
    for phase, seqlen in dict.fromkeys((r.phase, r.seqlen) for r in results):
        rows = [r for r in results if (r.phase, r.seqlen) == (phase, seqlen)]
        base = next((r.median_ms for r in rows if r.variant == BASELINE and r.median_ms), None)
        columns = _checked_columns(phase)
        if any(r.profile_wall_ms is not None for r in rows):
            columns.update({"profiled ms": "profile_wall_ms", "GPU busy ms": "profile_device_ms"})
        lines.append(f"\n{phase}: {_phase_title(phase, seqlen)}")
        lines.append(f"{'variant':<28}{'ms':>10}{'vs ' + BASELINE:>22}{'rewrites':>10}"
                     + "".join(f"{header:>15}" for header in columns))
        for r in rows:
            if r.error:
                lines.append(f"{r.variant:<28}{'failed: ' + r.error}")
                continue
            ratio = f"{base / r.median_ms:.2f}x" if base else "-"
            values = [getattr(r, name) for name in columns.values()]
            checked = "".join(f"{v:>15.3g}" if isinstance(v, float) else f"{v:>15}" for v in values)
            lines.append(f"{r.variant:<28}{r.median_ms:>10.2f}{ratio:>22}{r.rewrites:>10}{checked}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", help="default: 2048 8192 (16 32 with --tiny)")
    parser.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS], default=[v.name for v in VARIANTS])
    parser.add_argument(
        "--phases", nargs="+", choices=PHASES, default=list(INFERENCE_PHASES),
        help="default: the inference phases. decode: static KV cache; decode_dynamic: DynamicCache; generate: "
             "generate() with a static cache; train: one training step (forward, loss, backward), batch 1 with an "
             "attention_mask of ones; train_padded: the same, batch 2, the second row right-padded to 3/4"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path, default=Path("bench_e2e.json"))
    parser.add_argument(
        "--profile", type=Path, metavar="TXT",
        help="after the timing, one more call of every variant (zoo: backend) under torch.profiler: its wall time "
             "and the time the GPU was busy with its kernels in the table and JSON, the profiler's table of its "
             "busiest kernels in TXT (not for generate, whose decode steps run as CUDA graphs)"
    )
    parser.add_argument("--tiny", action="store_true", help="2-layer float32 model on CPU (for tests)")
    zoo.add_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> list:
    args = parse_args(argv)
    if not args.tiny:
        exit_without_cuda("python -m fa2_inductor.bench_e2e", "python -m fa2_inductor.bench_e2e --tiny")
    if args.profile:
        args.profile.write_text(PROFILE_HEADER)
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
    document = {
        "environment": environment(device),
        "model": {**shape, "dtype": str(dtype), "batch": 1},  # train_padded: 2
        "settings": {"phases": args.phases, "seqlens": seqlens, "warmup": args.warmup, "reps": args.reps, "tiny": args.tiny},
        "results": [],
    }
    results = []

    def keep(finished: list) -> None:
        """Adds results and rewrites the JSON, so a run cut short keeps every phase and length it finished."""
        results.extend(finished)
        document["results"].extend(asdict(r) for r in finished)
        write_json(args.json, document)

    for phase in args.phases:
        for seqlen in seqlens:
            if phase == "generate":
                workload = Generation(shape, dtype, device, seqlen)
            elif phase in TRAINING_PHASES:
                workload = TrainingStep(phase, shape, dtype, device, seqlen)
            else:
                workload = Workload(phase, shape, dtype, device, seqlen)
            _release_memory(device)  # the reference model
            run_variants = run_generations if phase == "generate" else run_phase
            finished = run_variants(variants, workload, shape, dtype, device, args)
            for r in finished:
                _print_progress(r)
            keep(finished)
            del workload
    print(format_table(results))
    print(f"\nwrote {args.json}")
    return results


if __name__ == "__main__":
    main()
