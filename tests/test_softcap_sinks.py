"""The op's logit soft-capping (``softcap``) and attention sinks (``sinks``) on CPU (the reference path):
numerics against float64 eager formulas, gradients, opcheck, bad input, and the Hugging Face models that
use them (Gemma 2, gpt-oss) through ``attn_implementation="fa2_inductor"``."""

from __future__ import annotations

import math

import pytest
import torch

import fa2_inductor
from fa2_inductor import EmptyRows

op = torch.ops.fa2_inductor.flash_attention_fwd.default
bwd = torch.ops.fa2_inductor.flash_attention_bwd.default


def _qkv(b=2, hq=4, hkv=2, sq=13, sk=19, d=16, dtype=torch.float32, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    make = lambda *shape: (torch.randn(*shape, generator=gen) * 2).to(dtype).requires_grad_(requires_grad)  # noqa: E731
    return make(b, hq, sq, d), make(b, hkv, sk, d), make(b, hkv, sk, d)


def _eager(q, k, v, mask=None, scale=None, is_causal=False, softcap=0.0, sinks=None):
    """Gemma 2's and gpt-oss's eager attention, in float64: cap, mask, softmax with the sink as one more logit."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.double()
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    if sinks is None:
        return torch.softmax(scores, -1).nan_to_num(0.0) @ v
    sink = sinks.double().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return probs @ v


@pytest.mark.parametrize("softcap", [1.0, 5.0, 50.0])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_softcap_matches_eager(softcap, is_causal):
    q, k, v = _qkv()
    out, _ = op(q, k, v, None, 0.25, is_causal, -1, 0, softcap, None)
    torch.testing.assert_close(out.double(), _eager(q, k, v, None, 0.25, is_causal, softcap), atol=2e-5, rtol=2e-5)


def test_softcap_is_applied_before_an_additive_mask():
    q, k, v = _qkv()
    mask = torch.randn(2, 1, 13, 19) * 3
    out = fa2_inductor.flash_attention(q, k, v, attn_mask=mask, softcap=2.0)
    torch.testing.assert_close(out.double(), _eager(q, k, v, mask, softcap=2.0), atol=2e-5, rtol=2e-5)


def test_all_keys_rows_are_soft_capped_too():
    """ALL_KEYS gives a row with no visible key the attention over all keys, with the call's soft-capping."""
    q, k, v = _qkv()
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    mask[3] = False
    out, _ = op(q, k, v, mask, 0.25, False, -1, int(EmptyRows.ALL_KEYS), 5.0)
    unmasked = _eager(q, k, v, scale=0.25, softcap=5.0)
    expected = torch.where(mask.any(-1)[:, None], _eager(q, k, v, mask, 0.25, softcap=5.0), unmasked)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sinks_match_eager(is_causal):
    q, k, v = _qkv()
    sinks = torch.tensor([0.5, -1.0, 3.0, 8.0])
    out, lse = op(q, k, v, None, 0.25, is_causal, -1, 0, 0.0, sinks)
    torch.testing.assert_close(out.double(), _eager(q, k, v, None, 0.25, is_causal, sinks=sinks), atol=2e-5, rtol=2e-5)
    # The lse counts the sink: it is the log of the whole denominator.
    scores = _qkv_scores(q, k, 0.25, is_causal)
    expected_lse = torch.logsumexp(torch.cat([scores, sinks.double().reshape(1, -1, 1, 1).expand(2, 4, 13, 1)], -1), -1)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


def _qkv_scores(q, k, scale, is_causal):
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q.double() @ k.transpose(-2, -1) * scale
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return scores


def test_a_row_with_no_visible_key_gives_all_its_weight_to_the_sink():
    q, k, v = _qkv()
    mask = torch.ones(2, 1, 13, 19, dtype=torch.bool)
    mask[1, :, 4] = False
    sinks = torch.zeros(4)
    out, lse = op(q, k, v, mask, 0.25, False, -1, 0, 0.0, sinks)
    assert torch.equal(out[1, :, 4], torch.zeros_like(out[1, :, 4]))
    assert torch.equal(lse[1, :, 4], torch.zeros(4))  # log(exp(sink)) with the sink at 0
    torch.testing.assert_close(out.double(), _eager(q, k, v, mask, 0.25, sinks=sinks), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_twice_pytorchs_own_error(dtype):
    """FlashAttention's rule: the op's error is at most twice PyTorch's own error in the input dtype."""
    q, k, v = _qkv(dtype=dtype)
    sinks = torch.tensor([0.5, -1.0, 3.0, 8.0], dtype=dtype)
    exact = _eager(q, k, v, None, 0.25, True, 5.0, sinks)
    out, _ = op(q, k, v, None, 0.25, True, -1, 0, 5.0, sinks)
    ours = (out.double() - exact).abs().max()
    # PyTorch's own computation of the same formula in the input dtype.
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.tanh(q @ kk.transpose(-2, -1) * 0.25 / 5.0) * 5.0
    scores = scores.masked_fill(torch.ones(13, 19, dtype=torch.bool).triu(1), -math.inf)
    probs = torch.softmax(torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(2, 4, 13, 1)], -1), -1)[..., :-1]
    theirs = ((probs @ vv).double() - exact).abs().max()
    assert ours <= 2 * theirs + 1e-6, (ours, theirs)


def test_gradients_match_float64_autograd():
    q, k, v = _qkv(dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.5, -1.0, 3.0, 1.0], dtype=torch.float64, requires_grad=True)
    mask = (torch.randn(2, 1, 13, 19, dtype=torch.float64) * 2).requires_grad_()
    grad = torch.randn(2, 4, 13, 16, dtype=torch.float64)
    ours = torch.autograd.grad(fa2_inductor.flash_attention(q, k, v, attn_mask=mask, softcap=3.0, sinks=sinks,
                                                            is_causal=False), (q, k, v, sinks, mask), grad)
    theirs = torch.autograd.grad(_eager(q, k, v, mask, softcap=3.0, sinks=sinks), (q, k, v, sinks, mask), grad)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks", "dmask"), ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=name)


def test_gradcheck():
    q, k, v = _qkv(b=1, hq=2, hkv=1, sq=5, sk=6, d=4, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v, s: fa2_inductor.flash_attention(q, k, v, is_causal=True, softcap=1.5, sinks=s)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_backward_op_returns_empty_sinks_gradient_without_sinks():
    q, k, v = _qkv()
    out, lse = op(q, k, v, None, 0.25, False)
    grads = bwd(torch.ones_like(out), q, k, v, out, lse, None, 0.25, False, False)
    assert len(grads) == 5 and grads[4].numel() == 0


def test_opcheck():
    q, k, v = _qkv()
    sinks = torch.randn(4)
    torch.library.opcheck(op, (q, k, v, None, 0.25, True, -1, 0, 2.0, sinks))
    q, k, v = _qkv(requires_grad=True)
    torch.library.opcheck(op, (q, k, v, torch.randn(13, 19), 0.25, False, -1, 0, 0.0, sinks.requires_grad_()))


@pytest.mark.parametrize("kwargs, message", [
    ({"softcap": -1.0}, "softcap must be finite and >= 0"),
    ({"softcap": math.inf}, "softcap must be finite and >= 0"),
    ({"softcap": math.nan}, "softcap must be finite and >= 0"),
    ({"sinks": torch.zeros(3)}, r"sinks must be a floating tensor of shape \[Hq\] = \[4\], got torch.float32 of shape \(3,\)"),
    ({"sinks": torch.zeros(1, 4)}, r"sinks must be a floating tensor of shape \[Hq\]"),
    ({"sinks": torch.zeros(4, dtype=torch.int64)}, r"sinks must be a floating tensor of shape \[Hq\]"),
    ({"sinks": torch.zeros(4), "empty_rows": EmptyRows.MEAN_V}, "empty_rows must be EmptyRows.ZERO"),
], ids=["negative", "inf", "nan", "sinks_short", "sinks_2d", "sinks_int", "sinks_mean_v"])
def test_bad_input_names_the_problem(kwargs, message):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=message):
        fa2_inductor.flash_attention(q, k, v, **kwargs)


# --- Hugging Face models that use them ----------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def _tiny(config_class, **extra):
    return config_class(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, **extra)


MODELS = {
    "gemma2": lambda: (transformers.Gemma2ForCausalLM, _tiny(transformers.Gemma2Config, attn_logit_softcapping=5.0,
                                                           query_pre_attn_scalar=16, sliding_window=8)),
    "gpt_oss": lambda: (transformers.GptOssForCausalLM, _tiny(transformers.GptOssConfig, num_local_experts=4,
                                                            num_experts_per_tok=2, sliding_window=8)),
}


def _build(name, impl):
    model_class, config = MODELS[name]()
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation=impl)
    if name == "gpt_oss":  # the sinks start at zero: make them matter
        for module in model.modules():
            if hasattr(module, "sinks"):
                torch.nn.init.normal_(module.sinks, std=2.0)
    return model


def _inputs():
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name", MODELS)
def test_hf_attention_interface_matches_eager(name):
    import fa2_inductor.hf

    fa2_inductor.hf.register()
    eager, ours = _build(name, "eager").eval(), _build(name, "fa2_inductor").eval()
    with torch.no_grad():
        expected = eager(**_inputs()).logits
        got = ours(**_inputs()).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", MODELS)
def test_hf_attention_interface_training_gradients_match_eager(name):
    import fa2_inductor.hf

    fa2_inductor.hf.register()
    grads = []
    for impl in ("eager", "fa2_inductor"):
        model = _build(name, impl).train()
        inputs = _inputs()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for key, expected in grads[0].items():
        torch.testing.assert_close(grads[1][key], expected, atol=1e-5, rtol=1e-4, msg=key)
