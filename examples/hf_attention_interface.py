"""Use the op as a transformers attention implementation: no torch.compile needed.

    python examples/hf_attention_interface.py

``fa2_inductor.hf.register()`` adds attn_implementation="fa2_inductor" to transformers. The model here is a
small Llama with random weights, built from a config (nothing is downloaded); it generates greedily with a
KV cache and must produce the same tokens as the eager implementation.
"""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import fa2_inductor.hf

fa2_inductor.hf.register()

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
config = LlamaConfig(
    vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,  # head_dim 128, GQA
)


def build(attn_implementation: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.to(device).eval()


prompt = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
settings = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": 16, "do_sample": False, "pad_token_id": 0}
with torch.no_grad():
    ours = build("fa2_inductor").generate(prompt, **settings)
    eager = build("eager").generate(prompt, **settings)

print("fa2_inductor:", ours[0, -16:].tolist())
print("eager:       ", eager[0, -16:].tolist())
same = (ours == eager).float().mean().item()
print(f"{same:.0%} of generated tokens equal eager's")
# bf16 on the GPU may flip a near-tie token; float32 on CPU must match exactly.
assert same == 1.0 or dtype == torch.bfloat16
