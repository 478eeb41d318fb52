"""The "fa2_inductor" backend: entry point, Inductor's mode/options, enable(), caching, explain, import cost."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import fa2_inductor
from fa2_inductor.passes import ATTENTION_PASS, ComposedPass, with_attention_pass, without_attention_pass
from tests.pass_checks import OP_IN_CODE, qkv


def attention(q, k, v):
    return (q @ k.transpose(-2, -1) * 0.25).softmax(-1) @ v


class UserPass(CustomGraphPass):
    """A pass a user already configured: it must keep running next to ours."""

    def __init__(self, uuid="user-pass"):
        self.calls = 0
        self._uuid = uuid

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return self._uuid


def test_entry_point_is_registered():
    names = [ep.name for ep in entry_points(group="torch_dynamo_backends")]
    assert "fa2_inductor" in names
    assert "fa2_inductor" in torch._dynamo.list_backends()


def test_backend_name_works_without_importing_the_package():
    script = textwrap.dedent(
        """
        import sys, torch
        def attention(q, k, v):
            return (q @ k.transpose(-2, -1) * 0.25).softmax(-1) @ v
        q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
        assert "fa2_inductor" not in sys.modules
        out = torch.compile(attention, backend="fa2_inductor")(q, k, v)
        torch.testing.assert_close(out, attention(q, k, v))
        from torch._dynamo.utils import counters
        print(dict(counters["fa2_inductor"]))
        """
    )
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}  # so the pass really runs
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "refused:cpu_device" in result.stdout  # the pass ran; CPU graphs stay Inductor's by default


@pytest.mark.parametrize("settings", [{"mode": "reduce-overhead"}, {"options": {"cpp.vec_isa_ok": False}}],
                         ids=["mode", "options"])
def test_mode_and_options_are_inductors(cpu_pass, settings):
    q, k, v = qkv()
    _, code = run_and_get_code(torch.compile(attention, backend="fa2_inductor", **settings), q, k, v)
    assert OP_IN_CODE in "\n".join(code)


def test_unknown_option_is_rejected_as_by_inductor(cpu_pass):
    with pytest.raises(Exception, match="Unexpected optimization option"):
        torch.compile(attention, backend="fa2_inductor", options={"no_such_option": 1})(*qkv())


def test_user_joint_pass_in_options_still_runs(cpu_pass):
    user = UserPass()
    torch.compile(attention, backend="fa2_inductor", options={"joint_custom_pre_pass": user})(*qkv())
    assert user.calls == 1 and counters["fa2_inductor"]["rewrites"] == 1


def test_user_joint_pass_in_config_still_runs(cpu_pass):
    user = UserPass()
    with torch._inductor.config.patch(joint_custom_pre_pass=user):
        torch.compile(attention, backend="fa2_inductor")(*qkv())
        assert torch._inductor.config.joint_custom_pre_pass is user  # the backend does not touch global config
    assert user.calls == 1 and counters["fa2_inductor"]["rewrites"] == 1


def test_enable_and_disable_for_the_default_backend(cpu_pass):
    user = UserPass()
    aot_cache = torch._functorch.config.enable_autograd_cache
    with torch._inductor.config.patch(joint_custom_pre_pass=user):
        fa2_inductor.enable()
        fa2_inductor.enable()  # idempotent
        try:
            assert torch._functorch.config.enable_autograd_cache is False  # a hit there would skip the pass
            torch.compile(attention)(*qkv())
        finally:
            fa2_inductor.disable()
        assert torch._inductor.config.joint_custom_pre_pass is user
        assert torch._functorch.config.enable_autograd_cache == aot_cache
    assert counters["fa2_inductor"]["rewrites"] == 1 and user.calls == 1
    torch._dynamo.reset()
    counters.clear()
    torch.compile(attention)(*qkv())
    assert counters["fa2_inductor"]["rewrites"] == 0


def test_enabled_context_manager(cpu_pass):
    with fa2_inductor.enabled():
        _, code = run_and_get_code(torch.compile(attention), *qkv())
    assert OP_IN_CODE in "\n".join(code)
    assert torch._inductor.config.joint_custom_pre_pass is None


def test_pass_objects_have_real_uuids(monkeypatch):
    first = ATTENTION_PASS.uuid()
    assert isinstance(first, bytes) and first == ATTENTION_PASS.uuid()
    monkeypatch.setattr(fa2_inductor.config, "rewrite_on_cpu", not fa2_inductor.config.rewrite_on_cpu)
    assert ATTENTION_PASS.uuid() != first  # a knob the pass reads is part of its identity
    composed = with_attention_pass(UserPass())
    assert isinstance(composed, ComposedPass) and composed.uuid() == (ATTENTION_PASS.uuid(), "user-pass")
    assert with_attention_pass(lambda graph: None).uuid() is None  # an opaque user pass: no caching
    assert without_attention_pass(with_attention_pass(None)) is None


def test_second_compile_hits_the_cache_and_runs_the_op(monkeypatch, tmp_path):
    monkeypatch.setattr(fa2_inductor.config, "rewrite_on_cpu", True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    q, k, v = qkv()
    codes = []
    with torch._inductor.config.patch(fx_graph_cache=True, force_disable_caches=False):
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            out, code = run_and_get_code(torch.compile(attention, backend="fa2_inductor"), q, k, v)
            torch.testing.assert_close(out, attention(q, k, v), atol=2e-5, rtol=2e-5)
            codes.append("\n".join(code))
    assert counters["inductor"]["fxgraph_cache_hit"] == 1  # the code came from the cache...
    assert counters["fa2_inductor"]["rewrites"] == 1  # ...the pass still saw the graph and counted it...
    assert OP_IN_CODE in codes[1]  # ...and the cached code calls the op
    torch._dynamo.reset()


def test_explain_lists_every_site(cpu_pass):
    def model(q, k, v):
        first = attention(q, k, v)
        second = (q @ k.transpose(-2, -1)).softmax(dim=-2) @ v  # refused: softmax over queries
        return first + second

    report = fa2_inductor.explain(model, *qkv())
    assert len(report.sites) == 2
    assert [s.rewritten for s in report.sites] == [True, False]
    assert report.sites[1].reason == "softmax_not_last_dim"
    text = str(report)
    assert "1 of 2 attention sites rewritten" in text and "softmax_not_last_dim" in text


def test_explain_lists_softmax_calls_that_are_no_attention(cpu_pass):
    """A router's softmax (over a linear layer's output) is no site, counted nowhere, but explain says why."""
    def router(x, w):
        return (x @ w).softmax(dim=-1).topk(2).values

    x, w = torch.randn(3, 10, 16), torch.randn(16, 4)
    report = fa2_inductor.explain(router, x, w)
    assert report.sites == [] and len(report.other_softmaxes) == 1
    assert str(report).splitlines() == [
        "fa2_inductor: no attention found",
        "softmax calls over no q·kᵀ scores (1):",
        "  - [inference] softmax over dim 2 of [3, 10, 4]: its input is computed by no product of two tensors "
        "(it comes from aten.mm.default)"]


def test_import_is_light():
    script = "import sys, fa2_inductor; print(sorted(m for m in sys.modules if m.startswith(('torch._inductor', 'fa2_inductor.passes'))))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "fa2_inductor.passes" not in result.stdout and "torch._inductor.pattern_matcher" not in result.stdout
