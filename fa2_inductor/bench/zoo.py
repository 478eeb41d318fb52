"""``python -m fa2_inductor.bench_e2e --zoo``: real model shapes, called as users call them.

Every entry is a Hugging Face model built from a config (random weights, nothing downloaded) at the
shape of a real checkpoint, with fewer layers (the per-layer cost is what the backend changes; fewer
layers keep the compiles short), in bfloat16, and is always called with the ``attention_mask`` a
tokenizer returns: all ones, right-padded or left-padded rows. Each entry runs, in one process and on
the same inputs:

    eager          the model uncompiled
    inductor       torch.compile(backend="inductor")
    fa2_inductor   torch.compile(backend="fa2_inductor")

for each attention implementation the family has (``sdpa``, and ``eager`` where it differs). Every
compiled output is checked against the uncompiled one; the three are then timed in turns (one call of each
per round, so the GPU's drift over an entry reaches all alike); the table shows the median forward time, the
ratio of fa2_inductor to the best of eager and Inductor (same attention implementation), and the pass's
counters (rewrites, their forms, refusals). ``--profile TXT`` adds one profiled call of each (the JSON's
runs get its wall and kernel time, TXT the busiest kernels). The JSON is rewritten after every entry, so a run cut
short (``--budget-s``) keeps what it measured; ``--plot`` draws the ratios.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch._dynamo.utils import counters

from .profiling import profile_calls
from .report import environment, write_json
from .timing import medians, time_compiled_in_turns

BACKENDS = ("eager", "inductor", "fa2_inductor")


@dataclass(frozen=True)
class ZooEntry:
    name: str
    family: str  # key of FAMILIES
    config: dict  # overrides of the family's config: the real checkpoint's shape, fewer layers
    batch: int
    seqlen: int
    padding: str = "none"  # "none" (all ones), "right", "left", "none-no-mask" (no attention_mask at all)
    impls: tuple = ("sdpa", "eager")
    note: str = ""


@dataclass
class Run:
    entry: str
    impl: str
    backend: str
    median_ms: Optional[float] = None
    max_abs_diff: Optional[float] = None
    counters: dict = field(default_factory=dict)
    profile_wall_ms: Optional[float] = None  # --profile: one more call under the profiler, start to end
    profile_device_ms: Optional[float] = None  # --profile: the time the GPU was busy with that call's kernels
    error: Optional[str] = None


# ---- families: config class, model class, inputs ---------------------------------------------------


def _decoder(config_name: str, model_name: str):
    def build(overrides: dict, impl: str):
        import transformers

        config = getattr(transformers, config_name)(**overrides)
        return getattr(transformers, model_name)._from_config(config, attn_implementation=impl, dtype=torch.bfloat16)

    return build


def _text_inputs(entry: ZooEntry, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (entry.batch, entry.seqlen), generator=g)
    if entry.padding == "none-no-mask":
        return {"input_ids": ids.to(device)}
    mask = torch.ones(entry.batch, entry.seqlen, dtype=torch.long)
    lengths = torch.randint(entry.seqlen // 4, entry.seqlen, (entry.batch,), generator=g)
    lengths[0] = entry.seqlen  # one full row, as a batch of real prompts has
    for row, length in enumerate(lengths.tolist()):
        if entry.padding == "right":
            mask[row, length:] = 0
        elif entry.padding == "left":
            mask[row, : entry.seqlen - length] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _vision_inputs(entry: ZooEntry, config, device) -> dict:
    g = torch.Generator().manual_seed(0)
    size = config.image_size
    pixels = torch.randn(entry.batch, config.num_channels, size, size, generator=g)
    return {"pixel_values": pixels.to(device, torch.bfloat16)}


def _seq2seq_inputs(entry: ZooEntry, vocab: int, device) -> dict:
    inputs = _text_inputs(entry, vocab, device)
    g = torch.Generator().manual_seed(1)
    decoder_len = max(16, entry.seqlen // 4)
    inputs["decoder_input_ids"] = torch.randint(3, vocab, (entry.batch, decoder_len), generator=g).to(device)
    return inputs


def _whisper_inputs(entry: ZooEntry, config, device) -> dict:
    g = torch.Generator().manual_seed(0)
    frames = 2 * config.max_source_positions
    features = torch.randn(entry.batch, config.num_mel_bins, frames, generator=g).to(device, torch.bfloat16)
    ids = torch.randint(3, config.vocab_size, (entry.batch, entry.seqlen), generator=g).to(device)
    return {"input_features": features, "decoder_input_ids": ids}


@dataclass(frozen=True)
class Family:
    build: Callable
    inputs: Callable  # (entry, model config, device) -> kwargs


FAMILIES = {
    "llama": Family(_decoder("LlamaConfig", "LlamaModel"), lambda e, c, d: _text_inputs(e, c.vocab_size, d)),
    "qwen2": Family(_decoder("Qwen2Config", "Qwen2Model"), lambda e, c, d: _text_inputs(e, c.vocab_size, d)),
    "mistral": Family(_decoder("MistralConfig", "MistralModel"), lambda e, c, d: _text_inputs(e, c.vocab_size, d)),
    "gpt2": Family(_decoder("GPT2Config", "GPT2Model"), lambda e, c, d: _text_inputs(e, c.vocab_size, d)),
    "bert": Family(_decoder("BertConfig", "BertModel"), lambda e, c, d: _text_inputs(e, c.vocab_size, d)),
    "vit": Family(_decoder("ViTConfig", "ViTModel"), _vision_inputs),
    "t5": Family(_decoder("T5Config", "T5Model"), lambda e, c, d: _seq2seq_inputs(e, c.vocab_size, d)),
    "whisper": Family(_decoder("WhisperConfig", "WhisperModel"), _whisper_inputs),
}

_LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=32000, max_position_embeddings=16384, num_hidden_layers=2)
_LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=32000, max_position_embeddings=16384, num_hidden_layers=2)
_QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                  vocab_size=32000, max_position_embeddings=16384, num_hidden_layers=4)
_MISTRAL_SW = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                   vocab_size=32000, max_position_embeddings=16384, sliding_window=2048, num_hidden_layers=2)
_GPT2_MEDIUM = dict(n_embd=1024, n_head=16, n_layer=4, vocab_size=32000, n_positions=1024)
_BERT_BASE = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=4,
                  attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
_VIT_B16 = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=4,
                image_size=224, patch_size=16)
_VIT_L16 = dict(hidden_size=1024, num_attention_heads=16, intermediate_size=4096, num_hidden_layers=4,
                image_size=224, patch_size=16)
_T5_BASE = dict(d_model=768, d_kv=64, d_ff=3072, num_heads=12, num_layers=2, num_decoder_layers=2,
                vocab_size=32128, dropout_rate=0.0)
_WHISPER_SMALL = dict(d_model=768, encoder_attention_heads=12, decoder_attention_heads=12, encoder_layers=2,
                      decoder_layers=2, encoder_ffn_dim=3072, decoder_ffn_dim=3072, vocab_size=51865,
                      max_target_positions=448, dropout=0.0, attention_dropout=0.0)

ZOO = (
    ZooEntry("llama3.2-1b 8k", "llama", _LLAMA_1B, 1, 8192, "none"),
    ZooEntry("llama3.2-1b 8k, no attention_mask", "llama", _LLAMA_1B, 1, 8192, "none-no-mask", ("sdpa",),
             "the same model without attention_mask"),
    ZooEntry("llama3.2-1b 4x2k left-padded", "llama", _LLAMA_1B, 4, 2048, "left"),
    ZooEntry("qwen2-0.5b 4k", "qwen2", _QWEN2_05B, 1, 4096, "none"),
    ZooEntry("gpt2-medium 8x1k", "gpt2", _GPT2_MEDIUM, 8, 1024, "none"),
    ZooEntry("mistral sliding-window 8k", "mistral", _MISTRAL_SW, 1, 8192, "none"),
    ZooEntry("llama3-8b 4x4k right-padded", "llama", _LLAMA_8B, 4, 4096, "right"),
    ZooEntry("bert-base 128x128 padded", "bert", _BERT_BASE, 128, 128, "right"),
    ZooEntry("bert-base 32x512 padded", "bert", _BERT_BASE, 32, 512, "right"),
    ZooEntry("vit-b16 64x197", "vit", _VIT_B16, 64, 197, impls=("sdpa", "eager")),
    ZooEntry("vit-l16 32x197", "vit", _VIT_L16, 32, 197, impls=("sdpa",)),
    ZooEntry("t5-base 16x512 padded", "t5", _T5_BASE, 16, 512, "right"),
    ZooEntry("whisper-small 16x448", "whisper", _WHISPER_SMALL, 16, 448, impls=("sdpa",)),
)
TINY_OVERRIDES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=128, num_hidden_layers=1)


def _last_hidden(output) -> torch.Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def run_entry(entry: ZooEntry, device: torch.device, args, on_run: Callable[[Run], None]) -> None:
    family = FAMILIES[entry.family]
    for impl in (i for i in entry.impls if not args.impls or i in args.impls):
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it runs (bench_e2e.build_model says why)
            model = family.build(entry.config, impl).eval()
        inputs = family.inputs(entry, model.config, device)
        with torch.no_grad():
            expected = _last_hidden(model(**inputs)).float()
        torch._dynamo.reset()
        runs, calls = {}, {}
        for backend in BACKENDS:
            runs[backend], call = _compile_and_check(entry, impl, backend, model, inputs, expected)
            if call is not None:
                calls[backend] = call
        # compiled on the same model: timed in turns so the GPU's drift over the entry reaches all alike
        timed = medians(time_compiled_in_turns(calls, device, warmup=args.warmup, reps=args.reps))
        for backend, median in timed.items():
            if isinstance(median, Exception):
                runs[backend].error = _error_text(median)
            else:
                runs[backend].median_ms = median
        if args.profile:
            for backend, profile in profile_calls(args.profile, calls, f"{entry.name} {impl}", device).items():
                runs[backend].profile_wall_ms, runs[backend].profile_device_ms = profile.wall_ms, profile.device_ms
        for run in runs.values():
            on_run(run)
        del model, expected, calls


def _compile_and_check(entry, impl, backend, model, inputs, expected) -> tuple[Run, Optional[Callable]]:
    """The run's record (checked output, the pass's counters) and the call to time, or None after an error.
    Each backend compiles the same model object: Dynamo keeps one cache entry per backend."""
    run = Run(entry.name, impl, backend)
    counters.clear()
    try:
        forward = model if backend == "eager" else torch.compile(model, backend=backend, dynamic=False)
        with torch.no_grad():
            out = _last_hidden(forward(**inputs)).float()
        run.max_abs_diff = (out - expected).abs().max().item()
        run.counters = dict(counters["fa2_inductor"])
    except Exception as exc:  # one failing run (e.g. out of memory) must not lose the others
        run.error = _error_text(exc)
        return run, None

    def call():
        with torch.no_grad():
            forward(**inputs)

    return run, call


def _error_text(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' | '.join(lines[:2])}"[:300]


def ratios(runs: list[Run]) -> list[dict]:
    """Per (entry, impl): fa2_inductor's time over Inductor's, over eager's and over the best of both."""
    rows = []
    for entry, impl in dict.fromkeys((r.entry, r.impl) for r in runs):
        ms = {r.backend: r.median_ms for r in runs if (r.entry, r.impl) == (entry, impl) and r.median_ms}
        fa2 = ms.get("fa2_inductor")
        best = min((ms[b] for b in ("eager", "inductor") if b in ms), default=None)
        row = {"entry": entry, "impl": impl, **{f"{b}_ms": ms.get(b) for b in BACKENDS}}
        row["fa2_vs_inductor"] = fa2 / ms["inductor"] if fa2 and "inductor" in ms else None
        row["fa2_vs_eager"] = fa2 / ms["eager"] if fa2 and "eager" in ms else None
        row["fa2_vs_best"] = fa2 / best if fa2 and best else None
        fa2_run = next((r for r in runs if (r.entry, r.impl, r.backend) == (entry, impl, "fa2_inductor")), None)
        row["counters"] = fa2_run.counters if fa2_run else {}
        rows.append(row)
    return rows


def _counter_text(found: dict) -> str:
    parts = [f"{k.split(':', 1)[1] if ':' in k else k}={v}" for k, v in sorted(found.items())
             if k.startswith(("rewrites", "refused:", "reference_fallback:"))]
    return " ".join(parts)


def format_table(rows: list[dict]) -> str:
    def cell(x, fmt):
        return format(x, fmt) if x is not None else "-"

    lines = [f"{'entry':<36}{'attn':<7}{'eager ms':>10}{'inductor':>10}{'fa2':>10}{'fa2/ind':>9}{'fa2/best':>9}  counters"]
    for r in rows:
        lines.append(
            f"{r['entry']:<36}{r['impl']:<7}{cell(r['eager_ms'], '.2f'):>10}{cell(r['inductor_ms'], '.2f'):>10}"
            f"{cell(r['fa2_inductor_ms'], '.2f'):>10}{cell(r['fa2_vs_inductor'], '.2f'):>9}{cell(r['fa2_vs_best'], '.2f'):>9}"
            f"  {_counter_text(r['counters'])}")
    return "\n".join(lines)


def draw(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["fa2_vs_best"]]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(shown) + 1.5))
    labels = [f"{r['entry']} ({r['impl']})" for r in shown]
    ax.barh(labels, [r["fa2_vs_best"] for r in shown], color=["tab:green" if r["fa2_vs_best"] <= 1 else "tab:red" for r in shown])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("fa2_inductor time / best of eager and Inductor (lower is better)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--zoo", action="store_true", help="real model shapes called with attention_mask (this module)")
    parser.add_argument("--models", nargs="+", help="zoo entries to run (substrings of their names); default all")
    parser.add_argument("--impls", nargs="+", choices=("sdpa", "eager"), help="zoo: attention implementations to run")
    parser.add_argument("--budget-s", type=float, default=None, help="zoo: stop starting entries after this many seconds")
    parser.add_argument("--plot", type=Path, default=None, help="zoo: PNG of the per-entry ratios")


def main(args) -> list[dict]:
    from .. import config as fa2_config

    if args.tiny:
        device = torch.device("cpu")
        fa2_config.rewrite_on_cpu = True
        entries = [ZooEntry("tiny llama 2x16 left-padded", "llama", TINY_OVERRIDES, 2, 16, "left")]
    else:
        device = torch.device("cuda")
        entries = [e for e in ZOO if not args.models or any(m in e.name for m in args.models)]
    start, runs = time.perf_counter(), []

    def on_run(run: Run) -> None:
        runs.append(run)
        status = run.error or f"{run.median_ms:.3f} ms, max|diff| {run.max_abs_diff:.3g} {_counter_text(run.counters)}"
        print(f"{run.entry:<36}{run.impl:<7}{run.backend:<14}{status}", flush=True)
        write_json(args.json, {"environment": environment(device), "settings": {"warmup": args.warmup, "reps": args.reps},
                               "entries": [asdict(e) for e in entries], "runs": [asdict(r) for r in runs],
                               "ratios": ratios(runs)})

    for entry in entries:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            print(f"budget spent: skipping {entry.name}", flush=True)
            continue
        run_entry(entry, device, args, on_run)
    rows = ratios(runs)
    print("\n" + format_table(rows))
    if args.plot is not None and rows:
        draw(rows, args.plot)
        print(f"wrote {args.plot}")
    print(f"wrote {args.json}")
    return rows
