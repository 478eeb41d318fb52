"""Differential fuzzing: random attention-like programs, compiled with the pass == eager, whatever it decides.

Each case is drawn, from its seed, out of a grammar of ops *and their arguments*: where the scale goes
(and whether it rounds, is per head or per row), masks (additive with alpha, -inf and finite fills,
inverted, swapped where-branches, in place, through a 4-D view of 3-D scores), casts (int, fp16, bf16,
float32, float64) on scores and probabilities, clamps and softcaps, transposed scores or probabilities,
probabilities used twice, safe and hand-written softmaxes, SDPA and SDPA's math path.

Most cases run the backend's graph passes (Inductor's joint passes with ours) and execute the resulting
graphs eagerly: every decision of the pass is exercised at a fraction of a second per case. A few also
run through the whole backend (Inductor's code generation). ``FA2_INDUCTOR_FUZZ_CASES=5000`` runs more.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fa2_inductor
from tests.pass_checks import TOLERANCE, graph_passes_backend

CASES = int(os.environ.get("FA2_INDUCTOR_FUZZ_CASES", "200"))
# Whole-backend cases cost ~5 s each (C++ code generation): one in forty, at least four.
BACKEND_CASES = max(4, CASES // 40)
_LOW = (torch.float16, torch.bfloat16)
_CASTS = {"half": torch.float16, "bfloat16": torch.bfloat16}  # the grammar's casting ops


def draw_case(seed: int) -> dict:
    """One program of the grammar, as the choices that build it (printed when a case fails)."""
    rng = random.Random(seed)
    pick = rng.choice
    case = {
        "seed": seed,
        "batch": pick([1, 2]),
        "kv_heads": pick([1, 2]),
        "n_rep": pick([1, 1, 2]),
        "seq_q": rng.randint(1, 9),
        # Sk >= 2: over a single key, ATen computes the matmuls as broadcast multiplies.
        "seq_k": rng.randint(2, 9),
        "dim": pick([8, 16]),
        "dtype": pick([torch.float32, torch.float32, torch.bfloat16, torch.float16]),
        "bshd": rng.random() < 0.3,
        "gqa": pick(["repeat_kv", "repeat_interleave"]),
        "matmul": pick(["matmul", "matmul", "bmm3", "einsum", "sdpa", "sdpa_math", "upcast_math", "baddbmm"]),
        "k_transpose": pick(["transpose", "mT", "permute"]),
        "scale": pick(["none", "div", "div", "mul", "q", "k", "split", "tensor0d", "per_head", "per_row",
                       "div_floor", "div_trunc", "inplace_div"]),
        "scale_after_mask": rng.random() < 0.1,
        "mask": pick(["none", "none", "additive", "additive_alpha", "alpha_on_scores", "sub", "inplace_add",
                      "masked_fill", "where", "where_swapped", "blocked_fill", "hf_min", "finite_fill",
                      "causal_tril", "causal_arange", "bool_added", "int_added"]),
        "mask_shape": pick(["b1qk", "11qk", "qk", "111k", "bhqk"]),
        "mask_float32": rng.random() < 0.3,
        "fill": pick(["dtype_min", "float32_min", -1e9, -1e4, 0.0]),
        "empty_row": rng.random() < 0.3,
        "view_4d": rng.random() < 0.5,
        "score_ops": rng.sample(["float", "to_dtype", "half", "bfloat16", "double_float", "int", "clamp",
                                 "softcap", "neg", "transpose"], k=pick([0, 0, 0, 1, 1, 2])),
        "softmax": pick(["softmax", "softmax", "float32", "safe", "manual", "manual_no_keepdim", "dim_-2"]),
        "prob_ops": rng.sample(["to_dtype", "float", "half", "clone", "dropout0", "mul1", "mul2", "clamp",
                                "transpose"], k=pick([0, 0, 1, 1, 2])),
        "use_probs_twice": pick([None, None, None, None, "return", "second_matmul"]),
        "k_elsewhere": pick([None, None, None, "returned", "used"]),  # the site's k also read by others
        "train": rng.random() < 0.3,
        "mask_grad": rng.random() < 0.5,  # in training, an additive mask that requires grad
        "dynamic": rng.random() < 0.1,
    }
    # A query row with no visible key: eager's softmax gives NaN over -inf, and its float16 rounding of
    # s + finfo.min is meaningless (some sums overflow to -inf, the others keep a few bits of s); compared only
    # where eager's answer is defined. A finite fill must stay finite in every dtype the scores take (-1e9 is
    # -inf in float16).
    dtypes = _cast_dtypes(case, "score_ops")
    case["empty_row"] = case["empty_row"] and (
        (case["mask"] == "finite_fill" and all(math.isfinite(_fill_in(case, d)) for d in dtypes))
        or (case["mask"] == "hf_min" and torch.float16 not in dtypes)
        or (case["softmax"] == "safe" and case["mask"] != "hf_min"))
    return case


def _cast_dtypes(case, *op_lists) -> list:
    """The case's dtype and those its casts in the named op lists take."""
    return [case["dtype"]] + [_CASTS[op] for ops in op_lists for op in case[ops] if op in _CASTS]


def _fill_in(case, dtype) -> float:
    return torch.tensor(_fill(case, dtype), dtype=torch.float64).to(dtype).item()


def _repeat(x, n_rep, how):
    if n_rep == 1:
        return x
    if how == "repeat_interleave":
        return x.repeat_interleave(n_rep, dim=1)
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _mask_shape(case, heads):
    b, sq, sk = case["batch"], case["seq_q"], case["seq_k"]
    return {"b1qk": (b, 1, sq, sk), "11qk": (1, 1, sq, sk), "qk": (sq, sk), "111k": (1, 1, 1, sk),
            "bhqk": (b, heads, sq, sk)}[case["mask_shape"]]


def _visible(case, shape, gen):
    """A random 'may attend' mask; every query row sees key 0 unless the case asks for an empty row."""
    visible = torch.rand(shape, generator=gen) > 0.4
    visible[..., 0] = True
    if case["empty_row"] and shape[-2] > 1:
        visible[..., -1, :] = False
    return visible


def _mask_input(case, heads, gen):
    kind = case["mask"]
    shape = _mask_shape(case, heads)
    if kind in ("additive", "additive_alpha", "alpha_on_scores", "sub", "inplace_add"):
        dtype = torch.float32 if case["mask_float32"] else case["dtype"]
        mask = (torch.randn(shape, generator=gen) * 2).to(dtype)
        return mask.requires_grad_(case["train"] and case["mask_grad"] and kind != "inplace_add")
    if kind in ("masked_fill", "where", "where_swapped", "blocked_fill", "hf_min", "finite_fill", "bool_added"):
        return _visible(case, shape, gen)
    if kind == "int_added":
        return torch.randint(0, 3, shape, generator=gen)
    return None


def _fill(case, dtype):
    fill = case["fill"]
    if fill == "dtype_min":
        return torch.finfo(dtype).min
    if fill == "float32_min":
        return torch.finfo(torch.float32).min
    return fill


def _causal(sq, sk, how):
    if how == "causal_tril":
        return torch.ones(sq, sk, dtype=torch.bool).tril()
    return torch.arange(sk)[None, :] <= torch.arange(sq)[:, None]


def make_attention(case):
    d = case["dim"]

    def scale_q_k(q, k):
        root = d**-0.25
        if case["scale"] in ("q", "split"):
            q = q * (root * root if case["scale"] == "q" else root)
        if case["scale"] in ("k", "split"):
            k = k * (root * root if case["scale"] == "k" else root)
        return q, k

    def scale_scores(s):
        kind = case["scale"]
        if kind == "div":
            return s / math.sqrt(d)
        if kind == "mul":
            return s * (1.0 / math.sqrt(d))
        if kind == "tensor0d":
            return s / torch.full((), math.sqrt(d), dtype=s.dtype)
        if kind == "per_head":
            return s * torch.linspace(0.1, 0.5, s.shape[-3], dtype=s.dtype).view(-1, 1, 1)
        if kind == "per_row":
            return s * torch.linspace(0.1, 0.5, s.shape[-2], dtype=s.dtype).view(-1, 1)
        if kind in ("div_floor", "div_trunc"):
            return s.div(2.0, rounding_mode=kind[4:])
        if kind == "inplace_div":
            return s.div_(math.sqrt(d))
        return s

    def apply_mask(s, mask):
        kind = case["mask"]
        if kind == "additive":
            return s + mask
        if kind == "additive_alpha":
            return torch.add(s, mask, alpha=0.5)
        if kind == "alpha_on_scores":
            return torch.add(mask, s, alpha=0.25)
        if kind == "sub":
            return torch.sub(s, mask, alpha=2)
        if kind == "inplace_add":
            return s.add_(mask)
        if kind == "masked_fill":
            return s.masked_fill(~mask, float("-inf"))
        if kind == "where":
            return torch.where(mask, s, float("-inf"))
        if kind == "where_swapped":
            return torch.where(~mask, float("-inf"), s)
        if kind == "blocked_fill":
            return s.masked_fill_(~mask, float("-inf"))
        if kind == "hf_min":
            return s + torch.where(mask, 0.0, torch.finfo(s.dtype).min).to(s.dtype)
        if kind == "finite_fill":
            return torch.where(mask, s, torch.full((), _fill(case, s.dtype), dtype=s.dtype))
        if kind.startswith("causal"):
            return s.masked_fill(~_causal(s.shape[-2], s.shape[-1], kind), float("-inf"))
        if kind in ("bool_added", "int_added"):
            return s + mask
        return s

    def masked(s, mask):
        """The mask (and a scale placed after it) on [.., Sq, Sk] scores, through a 4-D view for 3-D ones."""
        if s.dim() == 3 and mask is not None and (case["view_4d"] or mask.dim() == 4):
            b = case["batch"]
            s4 = s.view(b, -1, *s.shape[1:])
            return masked(s4, mask).view(s.shape)
        if case["scale_after_mask"]:
            return scale_scores(apply_mask(s, mask))
        return apply_mask(scale_scores(s), mask)

    def score_ops(s):
        for op in case["score_ops"]:
            if op == "float":
                s = s.float()
            elif op == "to_dtype":
                s = s.to(case["dtype"])
            elif op == "half":
                s = s.half()
            elif op == "bfloat16":
                s = s.bfloat16()
            elif op == "double_float":
                s = s.double().float()
            elif op == "int":
                s = s.to(torch.int32).to(s.dtype)
            elif op == "clamp":
                s = s.clamp(min=-3.0, max=3.0)
            elif op == "softcap":
                s = torch.tanh(s / 5.0) * 5.0
            elif op == "neg":
                s = -s
            elif op == "transpose" and s.shape[-1] == s.shape[-2]:
                s = s.transpose(-2, -1)
        return s

    def softmax(s):
        kind = case["softmax"]
        if kind == "float32":
            return F.softmax(s, dim=-1, dtype=torch.float32)
        if kind == "safe":
            return torch.ops.aten._safe_softmax(s, -1)
        if kind == "manual":
            e = torch.exp(s - s.amax(-1, keepdim=True))
            return e / e.sum(-1, keepdim=True)
        if kind == "manual_no_keepdim" and s.shape[-1] == s.shape[-2]:
            e = torch.exp(s - s.amax(-1))
            return e / e.sum(-1)
        if kind == "dim_-2":
            return s.softmax(-2)
        return s.softmax(-1)

    def prob_ops(p):
        for op in case["prob_ops"]:
            if op == "to_dtype":
                p = p.to(case["dtype"])
            elif op == "float":
                p = p.float()
            elif op == "half":
                p = p.half()
            elif op == "clone":
                p = p.clone()
            elif op == "dropout0":
                p = F.dropout(p, p=0.0, training=True)
            elif op == "mul1":
                p = p * 1.0
            elif op == "mul2":
                p = p * 2.0
            elif op == "clamp":
                p = p.clamp(min=0.01)
            elif op == "transpose" and p.shape[-1] == p.shape[-2]:
                p = p.transpose(-2, -1)
        return p

    def scores_of(q, k, mask):
        q, k = scale_q_k(q, k)
        if case["matmul"] == "einsum":
            s = torch.einsum("bhqd,bhkd->bhqk", q, k)
        elif case["matmul"] in ("bmm3", "baddbmm"):
            b, h = q.shape[:2]
            q3, k3t = q.reshape(b * h, -1, d), k.reshape(b * h, -1, d).transpose(1, 2)
            if case["matmul"] == "baddbmm":
                bias = torch.zeros(b * h, q.shape[2], k.shape[2], dtype=q.dtype)
                return masked(torch.baddbmm(bias, q3, k3t, beta=0.5, alpha=1.0), mask)
            s = torch.bmm(q3, k3t)
            return masked(s, mask)
        else:
            kt = {"transpose": lambda t: t.transpose(-2, -1), "mT": lambda t: t.mT,
                  "permute": lambda t: t.permute(0, 1, 3, 2)}[case["k_transpose"]](k)
            s = q @ kt
        return masked(s, mask)

    def attention(q, k, v, mask):
        out = attention_only(q, k, v, mask)
        if case["k_elsewhere"] is None:
            return out
        k_seen = k.transpose(1, 2) if case["bshd"] else k
        first, *rest = out if isinstance(out, tuple) else (out,)
        if case["k_elsewhere"] == "returned":
            return (first, *rest, k_seen)
        return (first + k_seen.sum(-2, keepdim=True).mean(1, keepdim=True).to(first.dtype) * 0.5, *rest)

    def attention_only(q, k, v, mask):
        if case["bshd"]:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = _repeat(k, case["n_rep"], case["gqa"]), _repeat(v, case["n_rep"], case["gqa"])
        if case["matmul"] == "sdpa":
            return _sdpa(q, k, v, mask)
        if case["matmul"] == "sdpa_math":
            return torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[0]
        low = q.dtype
        if case["matmul"] == "upcast_math":
            q, k, v = q.float(), k.float(), v.float()
        s = scores_of(q, k, mask)
        if s.dim() == 3:
            v = v.reshape(-1, *v.shape[2:])
        p = prob_ops(softmax(score_ops(s)))
        out = p @ v.to(p.dtype)
        if case["use_probs_twice"] == "second_matmul":
            out = out + p @ (v.to(p.dtype) * 2)
        if case["matmul"] == "upcast_math":
            out = out.to(low)
        if s.dim() == 3:
            out = out.view(q.shape[0], q.shape[1], *out.shape[1:])
        return (out, p) if case["use_probs_twice"] == "return" else out

    def _sdpa(q, k, v, mask):
        sdpa_mask = None
        if case["mask"].startswith("causal"):
            sdpa_mask = _causal(q.shape[-2], k.shape[-2], case["mask"])
        elif mask is not None and mask.dtype.is_floating_point:
            sdpa_mask = mask.to(q.dtype)
        elif mask is not None and mask.dtype == torch.bool and case["mask"] != "bool_added":
            sdpa_mask = mask
        scale = {"none": 1.0, "mul": 0.3}.get(case["scale"])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=scale)

    return attention


def make_inputs(case):
    gen = torch.Generator().manual_seed(case["seed"])
    heads = case["kv_heads"] * case["n_rep"]

    def make(h, s):
        shape = (case["batch"], s, h, case["dim"]) if case["bshd"] else (case["batch"], h, s, case["dim"])
        return torch.randn(shape, generator=gen).to(case["dtype"]).requires_grad_(case["train"])

    q, k, v = make(heads, case["seq_q"]), make(case["kv_heads"], case["seq_k"]), make(case["kv_heads"], case["seq_k"])
    return q, k, v, _mask_input(case, heads, gen)


def _tolerance(case) -> float:
    """The lowest precision in the program's dtype's tolerance; ten times that where rounding the scores
    (floor, trunc, int casts) turns a last-bit difference into a step."""
    tol = max(TOLERANCE[d] for d in _cast_dtypes(case, "score_ops", "prob_ops"))
    steps = case["scale"] in ("div_floor", "div_trunc") or "int" in case["score_ops"]
    return tol * 10 if steps else tol


def _nearer_to_float64(case, inputs, got, expected) -> bool:
    """FlashAttention's rule for a 16-bit program whose compiled output is off eager's by more than the
    tolerance: right if its error against the same program in float64 is at most twice eager's own (eager
    rounds in float16/bfloat16 where the op computes in float32)."""
    if not any(d in _LOW for d in _cast_dtypes(case, "score_ops", "prob_ops")):
        return False
    inputs64 = [t.detach().double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    with torch.no_grad():
        reference = _eager(make_attention(dict(case, dtype=torch.float64)), inputs64)
    if reference is None:
        return False
    got, expected, reference = (list(x) if isinstance(x, (tuple, list)) else [x] for x in (got, expected, reference))
    if any(t.isnan().any() for t in got + expected + reference):
        return False

    def error(answer) -> float:
        return max((a.double() - r).abs().max().item() for a, r in zip(answer, reference))

    return error(got) <= 2 * error(expected)


def _inductor_alone_fails(attention, inputs, case) -> bool:
    """Inductor's own graph passes (without this pass) fail to compile the program too."""
    from torch._functorch._aot_autograd.utils import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    def without_pass(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=lambda g, *a, **k: make_boxed_func(g.forward))

    torch._dynamo.reset()
    try:
        torch.compile(attention, backend=without_pass, dynamic=case["dynamic"] or None)(*inputs)
    except Exception:
        return True
    return False


def _eager(attention, inputs):
    """Eager's answer, or None when eager itself rejects the program (the case is then skipped)."""
    try:
        return attention(*inputs)
    except RuntimeError:
        return None


def check_case(case, backend) -> Counter:
    """Compiles the case with ``backend``; asserts compiled == eager (outputs and gradients); returns the decisions."""
    attention = make_attention(case)
    inputs = make_inputs(case)
    expected = _eager(attention, inputs)
    if expected is None:
        return Counter({"eager_rejects": 1})
    torch._dynamo.reset()
    counters.clear()
    try:
        got = torch.compile(attention, backend=backend, dynamic=case["dynamic"] or None)(*inputs)
    except Exception:
        if _inductor_alone_fails(attention, inputs, case):  # e.g. its fusion passing a tensor as SDPA's scale
            return Counter({"inductor_alone_fails": 1})
        raise
    decisions = Counter({k: n for k, n in counters["fa2_inductor"].items() if k == "rewrites" or k.startswith("refused:")})
    tol = _tolerance(case)
    message = lambda m: f"{case}\n{dict(decisions)}\n{m}"  # noqa: E731
    try:
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol, equal_nan=True, msg=message)
    except AssertionError:
        if not _nearer_to_float64(case, inputs, got, expected):
            raise
    out, ref = (got[0], expected[0]) if isinstance(got, tuple) else (got, expected)
    if case["train"] and ref.requires_grad:
        grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(case["seed"])).to(ref.dtype)
        leaves = [t for t in inputs if t is not None and t.requires_grad]
        got_grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
        expected_grads = torch.autograd.grad(ref, leaves, grad, allow_unused=True)
        for g, e in zip(got_grads, expected_grads):
            torch.testing.assert_close(g, e, atol=tol * 4, rtol=tol * 4, equal_nan=True, msg=message)
    return decisions


@contextlib.contextmanager
def fuzz_config():
    """The pass on for CPU graphs; Inductor rounding where eager rounds (its codegen otherwise keeps float32
    across a cast to bf16/fp16, which eager's -inf from an overflowing cast would not match)."""
    previous = fa2_inductor.config.rewrite_on_cpu
    fa2_inductor.config.rewrite_on_cpu = True
    try:
        with torch._inductor.config.patch(force_disable_caches=True, emulate_precision_casts=True):
            yield
    finally:
        fa2_inductor.config.rewrite_on_cpu = previous


@pytest.fixture(scope="module")
def fuzz_pass():
    with fuzz_config():
        yield
    torch._dynamo.reset()
    counters.clear()


# Seeds a long run once failed on, kept in every run (208 ... 1226: the output viewed with another rank
# than P @ V's crashed the rewrite's layout map; 10532, 13127, 15200: training under a finite fill, whose rows
# with no visible key got no gradient from the op).
FOUND = (208, 553, 622, 637, 868, 1226, 10532, 13127, 15200)


@pytest.mark.parametrize("seed", sorted(set(range(CASES)) | set(FOUND)))
def test_graph_passes_equal_eager(fuzz_pass, seed):
    check_case(draw_case(seed), graph_passes_backend)


@pytest.mark.parametrize("seed", range(100_000, 100_000 + BACKEND_CASES))
def test_backend_equals_eager(fuzz_pass, seed):
    check_case(draw_case(seed), "fa2_inductor")
