"""What the pass must leave alone: each refusal is counted with its reason and compiled == eager."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fa2_inductor
from fa2_inductor.passes import report, support
from tests.pass_checks import compile_and_compare, pass_counts, qkv

D = 16


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(D)


def _softmax_over_queries(q, k, v):
    return _scores(q, k).softmax(dim=-2) @ v


def _returns_weights(q, k, v):
    probs = _scores(q, k).softmax(-1)
    return probs @ v, probs


def _returns_scores(q, k, v):
    scores = _scores(q, k)
    return scores.softmax(-1) @ v, scores


def _active_dropout(q, k, v):
    return F.dropout(_scores(q, k).softmax(-1), p=0.3, training=True) @ v


def _softcap(q, k, v):
    """A cap that scales the tanh by another value than it divides the scores by: not the op's softcap."""
    return (torch.tanh(_scores(q, k) / 50.0) * 30.0).softmax(-1) @ v


def _scale_after_mask(q, k, v):
    """A tensor scale after the mask (a number one is folded into the mask: test_pass_gaps)."""
    bias = torch.zeros(q.shape[-2], k.shape[-2])
    return ((q @ k.transpose(-2, -1) + bias) * torch.tensor(D**-0.5)).softmax(-1) @ v


def _finite_fill(q, k, v):
    visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return _scores(q, k).masked_fill(~visible, -1e4).softmax(-1) @ v


def _sdpa_dropout(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)


REFUSED = {
    "softmax_not_last_dim": (_softmax_over_queries, {}),
    "probs_used_elsewhere": (_returns_weights, {}),
    "intermediate_used_elsewhere": (_returns_scores, {}),
    "softcap": (_softcap, {}),
    "scale_after_mask": (_scale_after_mask, {}),
    "finite_fill_value": (_finite_fill, {}),
    "dtype": (lambda q, k, v: _scores(q, k).softmax(-1) @ v, {"dtype": torch.float64}),
}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("reason", REFUSED)
def test_refused_and_counted(cpu_pass, reason, train):
    if reason == "dtype" and train and torch.__version__ < "2.13":
        pytest.skip("Inductor 2.11 itself fails float64 attention training on CPU (also without this pass)")
    fn, make = REFUSED[reason]
    compile_and_compare(fn, *qkv(train=train, **make), rewrites=0, train=train)
    assert pass_counts() == {f"refused:{reason}": 1}


def test_probabilities_read_elsewhere_name_their_readers(cpu_pass):
    (site,) = fa2_inductor.explain(_returns_weights, *qkv()).sites
    assert site.reason == "probs_used_elsewhere" and site.detail.startswith("read by "), site
    assert "the graph's output" in site.detail, site


# --- op arguments that change the math (each once rewritten into a wrong answer; alpha: test_pass_variants) --
def _floor_divided_scores(q, k, v):
    return (q @ k.transpose(-2, -1)).div(4.0, rounding_mode="floor").softmax(-1) @ v


def _trunc_divided_scores(q, k, v):
    return (q @ k.transpose(-2, -1)).div(4.0, rounding_mode="trunc").softmax(-1) @ v


def _int_cast_scores(q, k, v):
    return (q @ k.transpose(-2, -1) / 5.6).to(torch.int32).to(torch.float32).softmax(-1) @ v


def _probs_floor_divided_by_sum(q, k, v):
    """A hand-written softmax whose normalisation rounds: not a softmax."""
    e = torch.exp(_scores(q, k) - _scores(q, k).amax(-1, keepdim=True))
    return torch.div(e, e.sum(-1, keepdim=True), rounding_mode="floor") @ v


MATH_CHANGING = {
    "div_floor": (_floor_divided_scores, "unsupported_argument"),
    "div_trunc": (_trunc_divided_scores, "unsupported_argument"),
    "int_cast": (_int_cast_scores, "value_changing_cast"),
}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", MATH_CHANGING)
def test_math_changing_arguments_are_refused(cpu_pass, name, train):
    fn, reason = MATH_CHANGING[name]
    compile_and_compare(fn, *qkv(seq_q=16, dim=32, train=train), rewrites=0, train=train and name != "int_cast")
    assert pass_counts() == {f"refused:{reason}": 1}


def test_a_rounding_normalisation_is_no_softmax(cpu_pass):
    compile_and_compare(_probs_floor_divided_by_sum, *qkv(), rewrites=0)
    assert "rewrites" not in pass_counts()


def test_active_dropout_is_refused(cpu_pass):
    """Random, so only the refusal and the absence of the op are checked, not values."""
    torch._dynamo.reset()
    counters.clear()
    torch.compile(_active_dropout, backend="fa2_inductor")(*qkv(train=True))
    assert pass_counts() == {"refused:dropout_active": 1}


def test_sdpa_with_dropout_is_refused(cpu_pass):
    torch._dynamo.reset()
    counters.clear()
    torch.compile(_sdpa_dropout, backend="fa2_inductor")(*qkv())
    assert pass_counts() == {"refused:dropout_active": 1}


def test_value_head_dim_differs(cpu_pass):
    q, k, _ = qkv()
    v = torch.randn(2, 4, 8, 32)
    compile_and_compare(lambda q, k, v: _scores(q, k).softmax(-1) @ v, q, k, v, rewrites=0)
    assert pass_counts() == {"refused:not_computable": 1}


def test_cpu_left_alone_by_default():
    assert fa2_inductor.config.rewrite_on_cpu is False
    with torch._inductor.config.patch(force_disable_caches=True):
        compile_and_compare(lambda q, k, v: _scores(q, k).softmax(-1) @ v, *qkv(), rewrites=0)
    assert pass_counts() == {"refused:cpu_device": 1}


def test_softmax_without_matmuls_is_not_a_site(cpu_pass):
    compile_and_compare(lambda x, y, z: (x * 2).softmax(-1) + y - z, *qkv(), rewrites=0)
    assert pass_counts() == {}


def test_inductor_fuse_attention_bug_guarded(cpu_pass):
    """pytorch issue 196468: Inductor rewrites softmax(dim=-2) attention as dim=-1 attention.

    The fa2_inductor backend, and the default backend with the pass enabled, must match eager.
    """
    q, k, v = qkv(seq_q=16, seq_k=16)
    expected = _softmax_over_queries(q, k, v)
    torch._dynamo.reset()
    got = torch.compile(_softmax_over_queries, backend="fa2_inductor")(q, k, v)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    with fa2_inductor.enabled():
        got = torch.compile(_softmax_over_queries)(q, k, v)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# --- decode steps: the CUDA rule, proven on CPU ----------------------------------------------------
@pytest.fixture
def cuda_rules(cpu_pass, monkeypatch):
    """CPU sites judged by the CUDA rules, with a kernel that takes every call (what a Hopper GPU decides)."""
    monkeypatch.setattr(support, "_kernel_reason", lambda call: None)
    monkeypatch.setitem(support._DEVICE_RULES, "cpu", support._cuda_refusal)


def _decode_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def _decode_hand_written(q, k, v):
    return _scores(q, k).softmax(-1) @ v


SEQ_K = 2 * support.MIN_KEYS  # long enough for the short-sequence rule without a mask, too short for a decode step
MASKED_SEQ = support.MIN_KEYS_SMALL_HEADS_WITH_MASK  # long enough for it with a mask at any head dim
ROWS, KEYS = support.DECODE_MAX_QUERY_ROWS, support.DECODE_MIN_KEYS
DECODE_CASES = [(1, KEYS - 1, "refused"), (1, KEYS, "rewritten"), (ROWS, KEYS - 1, "refused"), (ROWS, KEYS, "rewritten"),
                (ROWS + 1, SEQ_K, "rewritten")]


@pytest.mark.parametrize("seq_q, seq_k, verdict", DECODE_CASES, ids=[f"sq{q}-sk{k}" for q, k, _ in DECODE_CASES])
@pytest.mark.parametrize("fn", [_decode_sdpa, _decode_hand_written], ids=["sdpa", "hand_written"])
@pytest.mark.parametrize("batch", [1, 2], ids=["b1", "b2"])  # b1 sq1: the bmm's batch and row dims both have size 1
def test_short_decode_steps_stay_with_inductor_on_cuda(cuda_rules, fn, seq_q, seq_k, verdict, batch):
    """Up to 16 query rows the decode kernel takes the site from DECODE_MIN_KEYS keys on."""
    q, k, v = qkv(batch=batch, seq_q=seq_q, seq_k=seq_k)
    compile_and_compare(fn, q, k, v, rewrites=int(verdict == "rewritten"))
    counts = pass_counts()
    assert counts.get("refused:decode_step", 0) == int(verdict == "refused"), counts


@pytest.mark.parametrize("seq_q, verdict", [(8, "refused"), (32, "rewritten")])
def test_decode_rule_reads_the_size_hint_of_a_symbolic_sq(cuda_rules, seq_q, verdict):
    q, k, v = qkv(seq_q=seq_q, seq_k=SEQ_K)
    with report.collecting() as records:
        compile_and_compare(_decode_sdpa, q, k, v, rewrites=int(verdict == "rewritten"), dynamic=True)
    (record,) = records
    if verdict == "refused":
        assert (record.reason, record.detail.split(" ")[0]) == ("decode_step", f"Sq={seq_q}")
    else:
        assert record.rewritten, record


def test_decode_steps_are_explained_as_rewritten(cuda_rules):
    text = str(fa2_inductor.explain(_decode_sdpa, *qkv(seq_q=1, seq_k=KEYS)))
    assert "rewritten" in text and "decode_step" not in text, text


def test_decode_refusal_is_explained(cuda_rules):
    text = str(fa2_inductor.explain(_decode_sdpa, *qkv(seq_q=1, seq_k=SEQ_K)))
    assert (f"refused: decode_step (Sq=1 query rows against Sk={SEQ_K} keys: below {KEYS} keys the decode kernel's "
            "fixed cost is not measured to pay") in text, text


def _key_padded_sdpa(q, k, v):
    keep = torch.ones(q.shape[0], 1, 1, k.shape[-2], dtype=torch.bool)
    keep[0, ..., -3:] = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


SMALL, LARGE = support.SMALL_HEAD_DIM, 2 * support.SMALL_HEAD_DIM
SHORT_CASES = [  # (fn, head dim, Sq, Sk, verdict)
    (_decode_sdpa, SMALL, support.MIN_KEYS - 1, support.MIN_KEYS - 1, "refused"),
    (_decode_sdpa, SMALL, support.MIN_KEYS, support.MIN_KEYS, "rewritten"),
    (_key_padded_sdpa, LARGE, support.MIN_KEYS - 1, support.MIN_KEYS - 1, "refused"),
    (_key_padded_sdpa, LARGE, support.MIN_KEYS, support.MIN_KEYS, "rewritten"),
    (_key_padded_sdpa, SMALL, support.MIN_KEYS_SMALL_HEADS_WITH_MASK - 1, support.MIN_KEYS_SMALL_HEADS_WITH_MASK - 1,
     "refused"),
    (_key_padded_sdpa, SMALL, support.MIN_KEYS_SMALL_HEADS_WITH_MASK, support.MIN_KEYS_SMALL_HEADS_WITH_MASK,
     "rewritten"),
    (_key_padded_sdpa, SMALL, 64, support.MIN_KEYS_SMALL_HEADS_CROSS_WITH_MASK - 1, "refused"),
    (_key_padded_sdpa, SMALL, 64, support.MIN_KEYS_SMALL_HEADS_CROSS_WITH_MASK, "rewritten"),
]
SHORT_IDS = ["plain-short", "plain", "masked-d128-short", "masked-d128", "masked-d64-short", "masked-d64",
             "cross-masked-d64-short", "cross-masked-d64"]


@pytest.mark.parametrize("fn, head_dim, seq_q, seq_k, verdict", SHORT_CASES, ids=SHORT_IDS)
def test_short_sequences_stay_with_inductor_on_cuda(cuda_rules, fn, head_dim, seq_q, seq_k, verdict):
    """Masked sites need more keys at small head dims, cross-attention more still (bench --sites)."""
    q, k, v = qkv(batch=1, heads=2, seq_q=seq_q, seq_k=seq_k, dim=head_dim)
    compile_and_compare(fn, q, k, v, rewrites=int(verdict == "rewritten"))
    assert pass_counts().get("refused:short_sequence", 0) == int(verdict == "refused"), pass_counts()


def test_dense_additive_masks_stay_with_inductor_on_cuda(cuda_rules):
    """A bias with no structure (T5's relative positions) would be read per score: Inductor keeps it."""

    def biased(q, k, v):
        bias = torch.arange(k.shape[-2], dtype=q.dtype) * -0.01
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(q.shape[-2], -1))

    compile_and_compare(biased, *qkv(batch=1, heads=2, seq_q=MASKED_SEQ), rewrites=0)
    assert pass_counts() == {"refused:dense_additive_mask": 1}


def _t5_eager(q, k, v):
    """T5's eager attention: unscaled scores plus a position bias, a float32 softmax cast back."""
    bias = torch.arange(k.shape[-2], dtype=q.dtype) * -0.01
    scores = q @ k.transpose(-2, -1) + bias
    return scores.float().softmax(-1).type_as(scores) @ v


def _code_lines(code: str) -> list[str]:
    """Generated code without comments (they name the compile's id and the traced source nodes)."""
    return [line for line in code.splitlines() if not line.lstrip().startswith("#")]


@pytest.mark.parametrize("seq", [support.MIN_KEYS - 1, MASKED_SEQ], ids=["short_sequence", "dense_additive_mask"])
def test_a_refused_site_compiles_to_plain_inductors_code(cuda_rules, seq):
    """Refusing leaves the graph as Inductor would have it: the backend cannot be slower there."""
    q, k, v = qkv(batch=1, heads=2, seq_q=seq)
    ours = compile_and_compare(_t5_eager, q, k, v, rewrites=0)
    assert set(pass_counts()) == {f"refused:{'short_sequence' if seq < support.MIN_KEYS else 'dense_additive_mask'}"}
    inductor = compile_and_compare(_t5_eager, q, k, v, rewrites=0, backend="inductor")
    assert _code_lines(ours) == _code_lines(inductor)


@pytest.mark.parametrize("fn", [_decode_sdpa, _decode_hand_written], ids=["sdpa", "hand_written"])
def test_decode_steps_still_rewritten_on_cpu(cpu_pass, fn):
    """The rule is about the Hopper kernel's speed: CPU graphs (config.rewrite_on_cpu) keep exercising the op."""
    compile_and_compare(fn, *qkv(batch=1, seq_q=1, seq_k=SEQ_K), rewrites=1)


# --- training graphs on CUDA: the op's backward must be the fast one too -----------------------------
@pytest.fixture
def cuda_training_rules(cpu_pass, monkeypatch):
    """CPU sites judged as on a Hopper GPU: the forward kernel takes every call, and the backward goes to
    PyTorch's flash backward except with a mask (the rule of ``_cuda.backward_unsupported_reason``)."""
    monkeypatch.setattr(support, "_kernel_reason", lambda call: None)
    monkeypatch.setitem(support._DEVICE_RULES, "cpu", support._cuda_refusal)
    monkeypatch.setattr(support._cuda, "backward_unsupported_reason",
                        lambda q, k, v, mask, *options: "attn_mask" if mask is not None else None)
    monkeypatch.setitem(support._BACKWARD_RULES, "cpu", support._cuda_backward_refusal)


def _padded_sdpa(q, k, v):
    visible = torch.ones(q.shape[0], 1, 1, k.shape[-2], dtype=torch.bool)
    visible[0, ..., -3:] = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


def _causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_masked_training_stays_with_inductor_on_cuda(cuda_training_rules):
    """The masked backward would run the op's reference: slower than Inductor's own, so the site stays."""
    compile_and_compare(_padded_sdpa, *qkv(seq_q=MASKED_SEQ, train=True), rewrites=0, train=True)
    assert pass_counts() == {"refused:backward_unsupported": 1}


def test_training_with_a_fast_backward_is_rewritten_on_cuda(cuda_training_rules):
    compile_and_compare(_causal_sdpa, *qkv(seq_q=SEQ_K, train=True), rewrites=1, train=True)


def test_masked_inference_is_rewritten_on_cuda(cuda_training_rules):
    """The backward rule is for training graphs only: the forward kernel takes the mask."""
    compile_and_compare(_padded_sdpa, *qkv(seq_q=MASKED_SEQ), rewrites=1)


def test_masks_have_no_fast_backward_on_cuda():
    q, k, v = qkv()
    assert fa2_inductor._cuda.backward_unsupported_reason(q, k, v, torch.ones(8, 8, dtype=torch.bool), False) == "attn_mask"


# --- gradients the op does not compute ----------------------------------------------------------------
@pytest.mark.parametrize("bias", [None, torch.tensor(0.5)], ids=["no_mask", "0d_mask"])
def test_a_learned_temperature_keeps_its_gradient(cpu_pass, bias):
    """A 0-d scale that requires grad: the op would fold it into q and drop d(temperature) (nor is its
    gradient a 0-d mask's, whatever the shapes say)."""
    temperature = torch.tensor(0.3, requires_grad=True)

    def attention(q, k, v, temperature):
        scores = q @ k.transpose(-2, -1) * temperature
        return (scores if bias is None else scores + bias).softmax(-1) @ v

    compile_and_compare(attention, *qkv(train=True), temperature, rewrites=0, train=True)
    assert pass_counts() == {"refused:training_gradient_unmapped": 1}


# --- sites left to Inductor are kept from its own wrong fusions --------------------------------------
def _mask_added_with_alpha(q, k, v, mask):
    return torch.add(q @ k.transpose(-2, -1) / 5.6, mask, alpha=0.5).softmax(-1) @ v


@pytest.mark.parametrize("divisor, kept", [(5.6, False), (4.0, True)], ids=["other", "sqrt_head_dim"])
def test_a_scale_divisor_other_than_sqrt_head_dim_becomes_a_reciprocal(divisor, kept):
    """torch 2.11's masked fusion takes any number divisor of the scores for sqrt(head dim) and runs SDPA with its
    default scale; the shield hands it a product instead (same value up to rounding), except for sqrt(head dim)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fa2_inductor.passes.inductor_guards import shield_attention_chains

    q, k, v = qkv(seq_q=16, dim=16)  # sqrt(16) = 4.0
    mask = torch.randn(1, 1, 16, 16)

    def fn(q, k, v, mask):
        return (q @ k.transpose(-2, -1) / divisor + mask).softmax(-1) @ v

    module = make_fx(fn, tracing_mode="fake")(q, k, v, mask)
    assert shield_attention_chains(module.graph) is not kept
    module.graph.eliminate_dead_code()
    module.recompile()
    divisions = [n for n in module.graph.nodes if n.target is torch.ops.aten.div.Tensor and n.args[1] == divisor]
    assert bool(divisions) is kept
    torch.testing.assert_close(module(q, k, v, mask), fn(q, k, v, mask))


def test_a_refused_site_keeps_its_alpha(monkeypatch):
    """On CPU by default every site stays with Inductor, whose fusion drops a mask's alpha (torch 2.13:
    errors of ~1); the pass folds the alpha into the mask first."""
    monkeypatch.setattr(fa2_inductor.config, "rewrite_on_cpu", False)
    q, k, v = qkv(seq_q=16)
    with torch._inductor.config.patch(force_disable_caches=True):
        compile_and_compare(_mask_added_with_alpha, q, k, v, torch.randn(1, 1, 16, 16) * 4, rewrites=0)
    assert pass_counts() == {"refused:cpu_device": 1}
