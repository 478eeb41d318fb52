"""Tiny HF models of every family, compiled with backend="fa2_inductor" on CPU (config.rewrite_on_cpu).

For each family × {eager, sdpa}: every attention site is rewritten (counted against the number of sites
computed from the config) and the logits equal the uncompiled model's. Families whose attention cannot be
computed exactly by the op (Longformer's sliding chunks) must be refused with a reason instead.
The post-grad graph is inspected too: K/V reach the op with their own (un-repeated) heads, and a purely
causal mask becomes is_causal=True.

Compile time dominates: the models are tiny, Inductor's caches are off so every run really compiles, and
vectorised C++ is turned off because scalar kernels compile about twice as fast (the pass sees the same graph).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

pytest.importorskip("transformers")
if importlib.util.find_spec("fa2_inductor.backend") is None:
    pytest.skip("fa2_inductor.backend (the compile backend) is not written yet", allow_module_level=True)

import fa2_inductor  # noqa: E402
from fa2_inductor.passes import support  # noqa: E402
from tests.hf_families import FAMILIES, HEADS, VOCAB, Family, model_output  # noqa: E402
from tests.pass_checks import OP_IN_CODE  # noqa: E402

FLASH_FWD = torch.ops.fa2_inductor.flash_attention_fwd.default
IMPLS = ("eager", "sdpa")
# Variants: the family's own inputs (right padding where the family has a padding mask); Llama with no
# mask at all, whose mask HF builds as a pure causal one; Llama with left padding, whose padded query rows
# see no key at all (eager gives them finite values: the compiled model must too).
CASES = [(name, impl, "padded") for name, family in FAMILIES.items() for impl in family.impls] + [
    ("llama", impl, variant) for variant in ("causal", "left_padded") for impl in IMPLS
]
# The longest cases of the default run (20-30 s each on 2 cores) run in the long mode only: Longformer (its
# refusal is also in the coverage test), Pegasus-X (its block-local attention's form is in
# test_pass_concat_keys) and the eager twins of the generate() tests (sdpa's stay).
LONG_CASES = {("longformer", "eager", "padded"), ("pegasus_x", "eager", "padded")}
LONG_IMPLS = {"eager"}


def _params(cases, long_cases):
    return [pytest.param(*case, id="-".join(case), marks=[pytest.mark.slow] if case in long_cases else [])
            for case in cases]


@dataclass(frozen=True)
class OpCall:
    """What the pass handed the op at one site."""

    k_heads: int
    v_heads: int
    has_mask: bool
    is_causal: bool


class CaptureOpCalls(CustomGraphPass):
    """Records the fa2_inductor op calls of each post-grad graph (after the fa2_inductor pass ran)."""

    def __init__(self):
        self.calls: list[OpCall] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.op == "call_function" and node.target is FLASH_FWD:
                _q, k, v, attn_mask, _scale, is_causal = node.args[:6]
                heads = (k.meta["val"].shape[1], v.meta["val"].shape[1])
                self.calls.append(OpCall(*heads, attn_mask is not None, bool(is_causal)))

    def __deepcopy__(self, memo):
        return self  # Inductor deep-copies its config per compile; the records must land here

    def uuid(self):
        return None  # never cached: the tests disable Inductor's caches anyway


@pytest.fixture
def compile_on_cpu(monkeypatch):
    """Fresh Dynamo state and counters, the pass enabled on CPU, Inductor's caches off."""
    monkeypatch.setattr(fa2_inductor.config, "rewrite_on_cpu", True)
    capture = CaptureOpCalls()
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(force_disable_caches=True, post_grad_custom_post_pass=capture):
        yield capture
    torch._dynamo.reset()


def _inputs(family: Family, config, variant: str) -> dict:
    inputs = family.make_inputs(config, torch.device("cpu"))
    if variant == "causal":
        del inputs["attention_mask"]
    if variant == "left_padded":
        inputs["attention_mask"] = inputs["attention_mask"].flip(-1)
    return inputs


def _refusals(reason_word: str) -> int:
    return sum(n for key, n in counters["fa2_inductor"].items() if key.startswith("refused:") and reason_word in key)


@pytest.mark.parametrize("name, impl, variant", _params(CASES, LONG_CASES))
def test_compiled_model_rewrites_every_attention_site(compile_on_cpu, name, impl, variant):
    family = FAMILIES[name]
    model = family.build(impl)
    inputs = _inputs(family, model.config, variant)
    sites = family.count_attention_sites(model.config)
    with torch.no_grad():
        expected = model_output(model(**inputs))
        got = model_output(torch.compile(model, backend="fa2_inductor")(**inputs))

    # The refused form (sliding chunks) is in the eager graphs only.
    must_refuse = family.refusal is not None and impl == "eager"
    rewrites = counters["fa2_inductor"]["rewrites"]
    if must_refuse:
        assert rewrites == 0, f"{name}/{impl}: {family.refusal} sites must not be rewritten"
        assert _refusals(family.refusal) == sites, dict(counters["fa2_inductor"])
    else:
        assert rewrites == sites, f"{name}/{impl}: {rewrites} of {sites} sites rewritten; {dict(counters['fa2_inductor'])}"
        _check_op_arguments(compile_on_cpu.calls, sites, model.config, variant)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _check_op_arguments(calls: list[OpCall], sites: int, config, variant: str) -> None:
    """K/V keep their own heads (no repeat_kv copy); a mask-free causal model gets is_causal=True."""
    assert len(calls) == sites, f"{len(calls)} op calls in the post-grad graphs for {sites} sites"
    kv_heads = getattr(config, "num_key_value_heads", None)
    for call in calls:
        if kv_heads is not None:
            assert (call.k_heads, call.v_heads) == (kv_heads, kv_heads), f"{call}: K/V not mapped back to {kv_heads} heads"
        if variant == "causal":
            assert not call.has_mask and call.is_causal, f"{call}: a provably causal mask must become is_causal=True"


TRAINING_CASES = [("llama", "sdpa"), ("bert", "eager")]


@pytest.mark.parametrize("name, impl", TRAINING_CASES, ids=["-".join(c) for c in TRAINING_CASES])
def test_training_step_matches_eager(compile_on_cpu, name, impl):
    family = FAMILIES[name]
    no_dropout = {"attention_dropout": 0.0, "attention_probs_dropout_prob": 0.0, "hidden_dropout_prob": 0.0}
    eager = family.build(impl, **no_dropout).train()
    compiled_model = family.build(impl, **no_dropout).train()
    inputs = family.make_inputs(eager.config, torch.device("cpu"))

    def loss_of(model):
        return model_output(model(**inputs)).float().square().mean()

    expected = loss_of(eager)
    expected.backward()
    got = loss_of(torch.compile(compiled_model, backend="fa2_inductor"))
    got.backward()

    assert counters["fa2_inductor"]["rewrites"] == family.count_attention_sites(eager.config)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    expected_grads = {n: p.grad for n, p in eager.named_parameters()}
    for param_name, param in compiled_model.named_parameters():
        expected_grad = expected_grads[param_name]
        if expected_grad is None:  # outside the loss (BERT's pooler): compiled code may give zeros instead
            assert param.grad is None or not param.grad.any(), param_name
        else:
            torch.testing.assert_close(param.grad, expected_grad, atol=1e-5, rtol=1e-4, msg=param_name)


@pytest.mark.parametrize("impl", _params([(i,) for i in IMPLS], {(i,) for i in LONG_IMPLS}))
def test_generate_with_static_cache_matches_eager_greedy(compile_on_cpu, impl):
    """Prefill (Sq = prompt) and decode (Sq = 1) graphs both compile; the tokens are eager's."""
    family = FAMILIES["llama"]
    model = family.build(impl)
    prompt = family.make_inputs(model.config, torch.device("cpu"))
    settings = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "cache_implementation": "static"}
    with torch.no_grad():
        expected = family.build("eager").generate(**prompt, **settings)
        model.forward = torch.compile(model.forward, backend="fa2_inductor")
        got = model.generate(**prompt, **settings)
    # On CPU (no decode rule) the prefill graph's sites and the decode graph's are all rewritten.
    counts = dict(counters["fa2_inductor"])
    assert counts["rewrites"] >= 2 * family.count_attention_sites(model.config), counts
    assert not any(key.startswith("refused:") for key in counts), counts
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("impl", _params([(i,) for i in IMPLS], {(i,) for i in LONG_IMPLS}))
def test_generate_under_the_cuda_rules_leaves_decode_steps_to_inductor(compile_on_cpu, monkeypatch, impl):
    """What a Hopper GPU decides (CPU sites judged by the CUDA rules, a kernel that takes every call):
    every decode step (Sq = 1) against a cache shorter than DECODE_MIN_KEYS compiles to plain Inductor's code
    line for line, so it cannot be slower than Inductor there; the prefill's sites take the op where generate() hands the model a bool mask (sdpa) and
    stay with Inductor where it hands over eager's additive finfo.min mask, built outside the compiled
    forward, so no structure can be read from it (dense_additive_mask); the tokens are eager's."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(support, "_kernel_reason", lambda call: None)
    monkeypatch.setitem(support._DEVICE_RULES, "cpu", support._cuda_refusal)
    family = FAMILIES["llama"]
    hidden = HEADS * 2 * support.SMALL_HEAD_DIM  # head dim 128: the op takes a masked prefill from MIN_KEYS keys
    prompt_len = support.MIN_KEYS  # and its decode cache stays shorter than DECODE_MIN_KEYS
    prompt = {"input_ids": torch.randint(3, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(1))}
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "cache_implementation": "static"}
    code = {}
    with torch.no_grad():
        expected = family.build(impl, hidden=hidden).generate(**prompt, **settings)
        for backend in ("inductor", "fa2_inductor"):  # counters then hold the fa2_inductor run's
            torch._dynamo.reset()
            counters.clear()
            model = family.build(impl, hidden=hidden)
            model.forward = torch.compile(model.forward, backend=backend)
            got, code[backend] = run_and_get_code(model.generate, **prompt, **settings)
            torch.testing.assert_close(got, expected)
    sites = family.count_attention_sites(model.config)
    counts = dict(counters["fa2_inductor"])
    prefill_refusal = {"eager": {"refused:dense_additive_mask"}, "sdpa": set()}[impl]
    assert counts.get("rewrites", 0) == (0 if prefill_refusal else sites), counts  # the prefill graph
    refusals = {key for key in counts if key.startswith("refused:")}
    assert counts.get("refused:decode_step", 0) >= sites and refusals == {"refused:decode_step"} | prefill_refusal, counts
    (fa2_prefill, *fa2_decode), (inductor_prefill, *inductor_decode) = code["fa2_inductor"], code["inductor"]
    assert fa2_decode and _code_lines(fa2_decode) == _code_lines(inductor_decode)
    assert (OP_IN_CODE in fa2_prefill) == (not prefill_refusal) and OP_IN_CODE not in inductor_prefill


def _code_lines(code: list[str]) -> list[str]:
    """Inductor's generated code without comments (they name the traced source nodes, which differ)."""
    return [line for text in code for line in text.splitlines() if not line.lstrip().startswith("#")]


def test_eager_and_sdpa_attention_compile_to_the_same_code(compile_on_cpu):
    """bench_e2e's prefill (batch 1, no padding, bf16): once the pass has run, HF's eager attention leaves
    nothing behind that sdpa does not (no finfo.min mask, float32 softmax, repeat_kv copy or extra transpose)."""
    from torch._inductor.utils import run_and_get_code

    family = FAMILIES["llama"]
    input_ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    code = {}
    for impl in IMPLS:
        torch._dynamo.reset()
        model = family.build(impl, dtype=torch.bfloat16)
        with torch.no_grad():
            _, code[impl] = run_and_get_code(torch.compile(model, backend="fa2_inductor"), input_ids=input_ids)
    sites = 2 * family.count_attention_sites(model.config)
    assert counters["fa2_inductor"]["rewrites"] == counters["fa2_inductor"]["rewrites:is_causal"] == sites
    calls = compile_on_cpu.calls
    assert all(not c.has_mask and c.is_causal for c in calls), calls
    assert _code_lines(code["eager"]) == _code_lines(code["sdpa"])
