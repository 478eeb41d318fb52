"""``python -m fa2_inductor.demo``: the main job, end to end on a small Hugging Face Llama.

It builds a Llama from a config (random weights, nothing downloaded), reports every attention site the
pass found, compiles the model with ``backend="fa2_inductor"``, checks the logits against the
uncompiled model and, on a Hopper GPU with the kernel, times it against plain Inductor. On a CPU the
pass is told to rewrite CPU graphs too (``config.rewrite_on_cpu``), so the whole path runs.
"""

from __future__ import annotations

import statistics

import torch

from . import config, explain
from ._cuda import kernel_unsupported_reason
from .info import describe

# Tolerance on logits, relative to their largest magnitude.
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def build_llama(device: str, dtype: torch.dtype):
    """On a GPU the end-to-end benchmark's Llama (hidden 2048, 16 heads, 8 KV heads, 4 layers): big enough
    for the GPU to be the bottleneck (a toy model's forward is bound by kernel launches, not attention).
    On a CPU a small one, so the demo finishes in seconds."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from .bench_e2e import LLAMA_SHAPE

    small = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048)
    llama_config = LlamaConfig(**(LLAMA_SHAPE if device == "cuda" else small))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval(), llama_config


def median_times_ms(*fns) -> list[float]:
    """GPU time of each call, median over two alternating rounds of 15, after half a second of calls (the
    GPU clocks down while a model compiles)."""
    from .bench.timing import keep_busy, time_cuda

    keep_busy(fns[0], torch.device("cuda"))
    samples = [[] for _ in fns]
    for _ in range(2):
        for times, fn in zip(samples, fns):
            times += time_cuda(fn, warmup=5, reps=15)
    return [statistics.median(times) for times in samples]


def main() -> None:
    print(describe())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config.rewrite_on_cpu = device == "cpu"
    model, llama_config = build_llama(device, dtype)
    seq_len = 2048 if device == "cuda" else 128
    input_ids = torch.randint(0, llama_config.vocab_size, (1, seq_len), device=device)

    with torch.no_grad():
        print(explain(model, input_ids))
        compiled = torch.compile(model, backend="fa2_inductor")
        expected = model(input_ids).logits.float()
        got = compiled(input_ids).logits.float()
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"logits vs the uncompiled model: max relative difference {error:.2e}")
    if not error <= _TOLERANCE[dtype]:
        raise SystemExit("fa2_inductor's compiled model disagrees with the uncompiled model")

    probe = torch.empty(1, 8, 16, 128, device=device, dtype=dtype)
    if device == "cuda" and kernel_unsupported_reason(probe, probe, probe, None, True) is None:
        inductor = torch.compile(model)
        with torch.no_grad():
            inductor(input_ids)
            ours, theirs = median_times_ms(lambda: compiled(input_ids), lambda: inductor(input_ids))
        print(f"forward, {seq_len} tokens: fa2_inductor {ours:.2f} ms, plain Inductor {theirs:.2f} ms ({theirs / ours:.2f}x)")


if __name__ == "__main__":
    main()
