"""Compile a Hugging Face model with backend="fa2_inductor": its attention runs on the op.

    python examples/compile_hf_model.py [--attn eager|sdpa]

A random-weight Llama (built from a config, nothing downloaded) is compiled with the fa2_inductor backend;
the pass replaces every attention subgraph that transformers traced (eager softmax chain or SDPA call) by
the fa2_inductor op. On a Hopper GPU the op runs the kernel; on CPU this script turns on
``fa2_inductor.config.rewrite_on_cpu`` so the rewrite can be seen without a GPU.
"""

import argparse

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig

import fa2_inductor

parser = argparse.ArgumentParser()
parser.add_argument("--attn", choices=("eager", "sdpa"), default="sdpa", help="transformers attn_implementation")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
if device == "cpu":
    fa2_inductor.config.rewrite_on_cpu = True

config = LlamaConfig(
    vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn, dtype=dtype).to(device).eval()
input_ids = torch.randint(0, config.vocab_size, (2, 256), device=device)

compiled = torch.compile(model, backend="fa2_inductor")
with torch.no_grad():
    expected = model(input_ids).logits
    logits = compiled(input_ids).logits

stats = dict(counters["fa2_inductor"])
print(f"attention sites rewritten: {stats.get('rewrites', 0)} of {config.num_hidden_layers}")
print("refused:", {k: v for k, v in stats.items() if k.startswith("refused:")} or "none")
difference = (logits.float() - expected.float()).abs().max().item()
print(f"max |compiled - uncompiled| logits: {difference:.2e}")
tolerance = 5e-2 * expected.float().abs().max().item() if dtype == torch.bfloat16 else 1e-4
assert difference <= tolerance, "the compiled model disagrees with the uncompiled one"
