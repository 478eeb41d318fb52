"""HF models on the Hopper kernel: compiled with backend="fa2_inductor", and through attn_implementation.

Skipped unless an sm_90 GPU and fa2_inductor._C exist. Models are small (2 layers, hidden 512, head_dim
128, bf16) so the kernel, not the reference, runs. Without a padding mask every decoder's mask is provably
causal and every site must be rewritten; with padding, a site is rewritten only where the kernel takes
its mask (the pass's call), so only the logits are asserted and the counters are printed. Inductor's
caches stay on: the counts must hold for a cached compile too (tests/conftest.py resets Dynamo and the
counters before each test).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)
pytest.importorskip("transformers")

import fa2_inductor.hf  # noqa: E402
from fa2_inductor.passes import support  # noqa: E402
from fa2_inductor import _extension  # noqa: E402
from tests.hf_families import FAMILIES, CountOpCalls, model_output  # noqa: E402

if _extension.C is None:
    pytest.skip(f"fa2_inductor._C not loaded: {_extension.status}", allow_module_level=True)

HIDDEN = 512  # 4 heads of head_dim 128
SEQ = 256
DEVICE = torch.device("cuda")
CAUSAL_DECODERS = ["llama", "qwen2", "gpt2", "gpt_neox", "phi", "gemma"]
PADDED = ["llama", "mistral", "bert", "bart", "t5", "vit"]
IMPLS = ("eager", "sdpa")


def _tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(1)).to(DEVICE)


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    # bf16 logits through 2 layers: compare on the scale of the logits.
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2 * max(scale, 1.0), rtol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", CAUSAL_DECODERS)
def test_causal_decoder_attention_is_rewritten(name, impl):
    family = FAMILIES[name]
    model = family.build(impl, dtype=torch.bfloat16, device=DEVICE, hidden=HIDDEN)
    input_ids = _tokens(2, SEQ)
    with torch.no_grad():
        expected = model_output(model(input_ids=input_ids))
        got = model_output(torch.compile(model, backend="fa2_inductor")(input_ids=input_ids))
    assert counters["fa2_inductor"]["rewrites"] == family.count_attention_sites(model.config), dict(
        counters["fa2_inductor"]
    )
    _close(got, expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", PADDED)
def test_padded_models_stay_correct(name, impl):
    family = FAMILIES[name]
    model = family.build(impl, dtype=torch.bfloat16, device=DEVICE, hidden=HIDDEN)
    inputs = family.make_inputs(model.config, DEVICE)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    with torch.no_grad():
        expected = model_output(model(**inputs))
        got = model_output(torch.compile(model, backend="fa2_inductor")(**inputs))
    print(f"{name}/{impl}: {dict(counters['fa2_inductor'])}")
    _close(got, expected)


def test_attention_interface_runs_the_kernel_and_matches_sdpa():
    fa2_inductor.hf.register()
    family = FAMILIES["llama"]
    sdpa = family.build("sdpa", dtype=torch.bfloat16, device=DEVICE, hidden=HIDDEN)
    ours = family.build("fa2_inductor", dtype=torch.bfloat16, device=DEVICE, hidden=HIDDEN)
    input_ids = _tokens(2, SEQ)
    with torch.no_grad():
        expected = model_output(sdpa(input_ids=input_ids))
        with CountOpCalls(torch.ops.fa2_inductor.flash_attention_fwd.default) as calls:
            got = model_output(ours(input_ids=input_ids))
    assert calls.calls == family.count_attention_sites(ours.config)
    _close(got, expected)


def test_compiled_generate_matches_eager_greedy():
    family = FAMILIES["llama"]
    model = family.build("sdpa", dtype=torch.bfloat16, device=DEVICE, hidden=HIDDEN)
    prompt = {"input_ids": _tokens(1, support.MIN_KEYS)}  # long enough for the op's prefill rule at head dim 128
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "cache_implementation": "static"}
    with torch.no_grad():
        expected = model.generate(**prompt, **settings)
        model.forward = torch.compile(model.forward, backend="fa2_inductor")
        got = model.generate(**prompt, **settings)
    assert counters["fa2_inductor"]["rewrites"] >= family.count_attention_sites(model.config)
    # bf16: a near-tie may flip a late token; the first new ones must agree.
    prompt_len = prompt["input_ids"].shape[1]
    torch.testing.assert_close(got[:, : prompt_len + 4], expected[:, : prompt_len + 4])


def test_compiled_generate_runs_its_decode_steps_on_the_decode_kernel():
    """A static cache of at least DECODE_MIN_KEYS slots: the decode step's sites are rewritten too (the split-KV
    kernel, its mask hiding the unfilled slots), with no reference fallback, and greedy tokens agree."""
    family = FAMILIES["llama"]
    model = family.build("sdpa", dtype=torch.bfloat16, device=DEVICE, hidden=HIDDEN)
    prompt = {"input_ids": _tokens(2, support.DECODE_MIN_KEYS)}
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "cache_implementation": "static"}
    with torch.no_grad():
        expected = model.generate(**prompt, **settings)
        model.forward = torch.compile(model.forward, backend="fa2_inductor")
        got = model.generate(**prompt, **settings)
    counts = dict(counters["fa2_inductor"])
    assert counts["rewrites"] >= 2 * family.count_attention_sites(model.config), counts  # prefill and decode graphs
    assert "refused:decode_step" not in counts, counts
    assert not any(key.startswith("reference_fallback") for key in counts), counts
    prompt_len = prompt["input_ids"].shape[1]
    torch.testing.assert_close(got[:, : prompt_len + 4], expected[:, : prompt_len + 4])
