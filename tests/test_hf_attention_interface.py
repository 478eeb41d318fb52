"""attn_implementation="fa2_inductor" (fa2_inductor.hf) without torch.compile, on CPU (the reference path)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import fa2_inductor.hf  # noqa: E402
from tests.hf_families import FAMILIES, CountOpCalls, model_output  # noqa: E402

FLASH_FWD = torch.ops.fa2_inductor.flash_attention_fwd.default
SUPPORTED = [name for name, family in FAMILIES.items() if family.refusal is None and "sdpa" in family.impls
             and "outside_attention_interface" not in family.tags]


@pytest.fixture(scope="module", autouse=True)
def registered():
    fa2_inductor.hf.register()


def test_register_is_idempotent():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    fa2_inductor.hf.register()
    fa2_inductor.hf.register()
    assert AttentionInterface._global_mapping["fa2_inductor"] is fa2_inductor.hf.attention_forward
    assert "fa2_inductor" in AttentionMaskInterface._global_mapping


def test_importing_fa2_inductor_does_not_import_transformers():
    code = "import sys, fa2_inductor, fa2_inductor.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", SUPPORTED)
def test_every_attention_layer_runs_the_op_and_matches_eager(name):
    family = FAMILIES[name]
    eager = family.build("eager")
    model = family.build("fa2_inductor")
    assert model.config._attn_implementation == "fa2_inductor"
    inputs = family.make_inputs(eager.config, torch.device("cpu"))
    with torch.no_grad():
        expected = model_output(eager(**inputs))
        with CountOpCalls(FLASH_FWD) as counter:
            got = model_output(model(**inputs))
    assert counter.calls == family.count_attention_sites(model.config)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_additive_4d_mask_is_used_as_given():
    """A user's own float mask [B, 1, Sq, Sk] reaches the op unchanged, as it reaches eager attention."""
    family = FAMILIES["llama"]
    eager, model = family.build("eager"), family.build("fa2_inductor")
    input_ids = family.make_inputs(eager.config, torch.device("cpu"))["input_ids"]
    seq = input_ids.shape[1]
    bias = torch.randn(2, 1, seq, seq, generator=torch.Generator().manual_seed(2))
    bias = bias.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = eager(input_ids=input_ids, attention_mask=bias).logits
        got = model(input_ids=input_ids, attention_mask=bias).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_training_with_attention_dropout_is_refused():
    family = FAMILIES["llama"]
    model = family.build("fa2_inductor", attention_dropout=0.1).train()
    inputs = family.make_inputs(model.config, torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="dropout"):
        model(**inputs)


def test_training_gradients_match_eager():
    family = FAMILIES["llama"]
    losses, grads = [], []
    for impl in ("eager", "fa2_inductor"):
        model = family.build(impl).train()
        inputs = family.make_inputs(model.config, torch.device("cpu"))
        loss = model(**inputs, labels=inputs["input_ids"]).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0])
    for name, expected in grads[0].items():
        torch.testing.assert_close(grads[1][name], expected, atol=1e-5, rtol=1e-4, msg=name)


def test_generate_with_kv_cache_and_left_padding_matches_eager():
    family = FAMILIES["llama"]
    tokens = []
    for impl in ("eager", "fa2_inductor"):
        model = family.build(impl)
        prompt = family.make_inputs(model.config, torch.device("cpu"))
        # Left padding, as batched generation uses: row 1's first quarter is padding.
        prompt["attention_mask"] = prompt["attention_mask"].flip(-1)
        with torch.no_grad():
            tokens.append(model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))
    torch.testing.assert_close(tokens[1], tokens[0])


@pytest.mark.parametrize("name, plain_causal", [("llama", True), ("mistral", False)])
def test_compiled_causal_mask_stays_implicit(name, plain_causal):
    """Under torch.compile transformers materialises masks; a plain causal one must stay None + is_causal."""
    calls = []

    def record_op_args(gm, example_inputs):
        calls.extend(n.args for n in gm.graph.nodes if n.op == "call_function" and n.target is FLASH_FWD)
        return gm.forward

    family = FAMILIES[name]
    model = family.build("fa2_inductor")
    input_ids = family.make_inputs(model.config, torch.device("cpu"))["input_ids"]
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=record_op_args)(input_ids=input_ids)
    assert len(calls) == family.count_attention_sites(model.config)
    for _q, _k, _v, attn_mask, _scale, is_causal in (call[:6] for call in calls):
        # Mistral's sliding window (6 < 12 tokens) is a real mask.
        assert (attn_mask is None and is_causal) == plain_causal
