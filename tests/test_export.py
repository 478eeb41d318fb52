"""Deploying models that hold the op: torch.export round trips and AOTInductor packages, on CPU.

Every program is saved here and loaded in a fresh Python process that imports torch and fa2_inductor
only: nothing process-local (the traced module, the graph pass, this test's imports) is needed to run it.
Other fresh processes show that loading fails without ``import fa2_inductor``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import fa2_inductor
from fa2_inductor import EmptyRows

ROOT = Path(__file__).resolve().parents[1]
FLASH_FWD = torch.ops.fa2_inductor.flash_attention_fwd.default

# Example shapes for export, and the other shapes the loaded programs run with (their dims are dynamic).
BATCH, SEQ, SEQ_K = 2, 10, 13
RUN_BATCH, RUN_SEQ, RUN_SEQ_K = 3, 7, 9
HEADS_Q, HEADS_KV, HEAD_DIM = 4, 2, 16
batch, seq, seq_k = Dim("batch"), Dim("seq"), Dim("seq_k")


class CausalGqa(torch.nn.Module):
    """The public function: default scale, GQA, causal."""

    def forward(self, q, k, v):
        return fa2_inductor.flash_attention(q, k, v, is_causal=True)


class SoftcapSinks(torch.nn.Module):
    """The public function with logit soft-capping and attention sinks (a buffer, one per query head)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("sinks", torch.linspace(-1.0, 2.0, HEADS_Q))

    def forward(self, q, k, v):
        return fa2_inductor.flash_attention(q, k, v, is_causal=True, softcap=4.0, sinks=self.sinks)


class BoolMaskWindow(torch.nn.Module):
    """The op itself with every argument: a key mask together with a causal window, empty rows = mean of V."""

    def forward(self, q, k, v, mask):
        return torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, mask, 0.3, True, 3, int(EmptyRows.MEAN_V))


class AdditiveMaskCross(torch.nn.Module):
    """Sq != Sk, an additive mask with rows that hide every key, empty rows = all keys."""

    def forward(self, q, k, v, mask):
        return torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, mask, 0.25, False, -1, int(EmptyRows.ALL_KEYS))


def _tensors(batch_size: int, seq_q: int, seq_kv: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    key_mask = torch.rand(batch_size, 1, 1, seq_kv, generator=gen) > 0.3
    additive = torch.randn(1, 1, seq_q, seq_kv, generator=gen)
    additive[..., 1, :] = float("-inf")  # a row with no visible key
    return {
        "q": torch.randn(batch_size, HEADS_Q, seq_q, HEAD_DIM, generator=gen),
        "k": torch.randn(batch_size, HEADS_KV, seq_kv, HEAD_DIM, generator=gen),
        "v": torch.randn(batch_size, HEADS_KV, seq_kv, HEAD_DIM, generator=gen),
        "key_mask": key_mask,
        "additive": additive,
    }


def _op_module_cases() -> dict:
    """name -> (module, example args, dynamic shapes, run args, the op's non-tensor arguments)."""
    ex, run = _tensors(BATCH, SEQ, SEQ, 0), _tensors(RUN_BATCH, RUN_SEQ, RUN_SEQ, 1)
    ex_cross, run_cross = _tensors(BATCH, SEQ, SEQ_K, 2), _tensors(RUN_BATCH, RUN_SEQ, RUN_SEQ_K, 3)
    qkv_dims = ({0: batch, 2: seq},) * 3
    cross_dims = ({0: batch, 2: seq}, {0: batch, 2: seq_k}, {0: batch, 2: seq_k}, {2: seq, 3: seq_k})
    qkv = lambda t: (t["q"], t["k"], t["v"])  # noqa: E731
    return {
        "causal_gqa": (CausalGqa(), qkv(ex), qkv_dims, qkv(run), (HEAD_DIM ** -0.5, True, -1, 0, 0.0, None)),
        "softcap_sinks": (SoftcapSinks(), qkv(ex), qkv_dims, qkv(run), (HEAD_DIM ** -0.5, True, -1, 0, 4.0, "tensor")),
        "bool_mask_window": (BoolMaskWindow(), (*qkv(ex), ex["key_mask"]), (*qkv_dims, {0: batch, 3: seq}),
                             (*qkv(run), run["key_mask"]), (0.3, True, 3, int(EmptyRows.MEAN_V), 0.0, None)),
        "additive_mask_cross": (AdditiveMaskCross(), (*qkv(ex_cross), ex_cross["additive"]), cross_dims,
                                (*qkv(run_cross), run_cross["additive"]), (0.25, False, -1, int(EmptyRows.ALL_KEYS), 0.0, None)),
    }


class LogitsOnly(torch.nn.Module):
    """A Hugging Face causal LM as an exportable function of its inputs: logits, no cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def _llama_inputs(seq_len: int) -> dict:
    """The Llama family's inputs (row 1 right-padded) at any length."""
    from tests.hf_families import BATCH as HF_BATCH, _padding_mask, _token_ids

    return {"input_ids": _token_ids(HF_BATCH, seq_len, "cpu"), "attention_mask": _padding_mask(HF_BATCH, seq_len, "cpu")}


# A fresh process that only tries to load one program without fa2_inductor (it must fail).
_LOAD_WITHOUT_THE_OP = textwrap.dedent(
    """
    import sys, torch
    kind, path = sys.argv[1:]
    try:
        torch.export.load(path) if kind == "export" else torch._inductor.aoti_load_package(path)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
    else:
        print("loaded")
    """
)

# The fresh process: torch and fa2_inductor, then load, run, count op calls.
_LOAD_AND_RUN = textwrap.dedent(
    """
    import sys, torch
    import fa2_inductor  # what a deployment imports; it registers the op
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOpCalls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += func.namespace == "fa2_inductor"
            return func(*args, **(kwargs or {}))

    def _as_compared(argument):  # a tensor argument (a graph node) as the word the test expects there
        return "tensor" if isinstance(argument, torch.fx.Node) else argument

    def load(entry):
        if entry["kind"] == "export":
            return torch.export.load(entry["path"])
        return torch._inductor.aoti_load_package(entry["path"])

    manifest = torch.load(sys.argv[1])
    results = {}
    for name, entry in manifest.items():
        loaded = load(entry)
        run = loaded.module() if entry["kind"] == "export" else loaded
        with torch.no_grad(), CountOpCalls() as counter:
            outputs = run(*entry["args"], **entry["kwargs"])
        op_arguments = []
        if entry["kind"] == "export":
            op = torch.ops.fa2_inductor.flash_attention_fwd.default
            schema = op._schema.arguments  # export leaves out arguments equal to their defaults
            op_arguments = [
                tuple(_as_compared(n.args[i] if i < len(n.args) else n.kwargs.get(a.name, a.default_value))
                      for i, a in enumerate(schema))[4:]
                for n in loaded.graph.nodes if n.target is op
            ]
        results[name] = {"outputs": outputs, "op_calls": counter.calls, "op_arguments": op_arguments}
    torch.save(results, sys.argv[2])
    """
)


def _fresh_python(folder: Path, *argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """A new Python process (a crash prints its Python stack) that finds this checkout's packages."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-X", "faulthandler", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=folder)


# torch 2.11's AOTInductor loader segfaults loading a CPU package in a process that sees a CUDA device
# (H200: inside torch's _load_aoti, whether fa2_inductor is imported or not; one such process was still
# running after four minutes), so there those loads are expected failures, not run; elsewhere they load.
AOTI_CPU_PACKAGES_CRASH = torch.__version__.startswith("2.11") and torch.cuda.is_available()
aoti_cpu_packages_load = pytest.mark.xfail(
    AOTI_CPU_PACKAGES_CRASH, run=False,
    reason="torch 2.11's AOTInductor loader crashes on CPU packages when a CUDA device is present")


def run_in_fresh_process(manifest: dict, folder: Path) -> dict:
    """Loads and runs each saved program (``manifest``: name -> kind, path, args, kwargs) in a new
    Python process; returns its results."""
    torch.save(manifest, folder / "manifest.pt")
    result = _fresh_python(folder, "-c", _LOAD_AND_RUN, str(folder / "manifest.pt"), str(folder / "results.pt"))
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(folder / "results.pt")


def load_without_the_op(kind: str, path: str, folder: Path) -> tuple[str, str]:
    """What loading one program in a fresh process without fa2_inductor gives: (outcome, stderr). The
    outcome is the exception raised, or "crashed (signal N)"."""
    result = _fresh_python(folder, "-c", _LOAD_WITHOUT_THE_OP, kind, path)
    outcome = result.stdout.strip() if result.returncode >= 0 else f"crashed (signal {-result.returncode})"
    return outcome, result.stderr


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    """Every case exported with dynamic batch and sequence dims, saved (one also AOT-compiled where such
    packages load), loaded and run at other shapes in one fresh process. Returns ({name: (eager outputs,
    the fresh process's results)}, {kind: what loading without ``import fa2_inductor`` gave, as
    load_without_the_op says})."""
    folder = tmp_path_factory.mktemp("export")
    manifest, expected = {}, {}
    for name, (module, example, dims, run_args, _) in _op_module_cases().items():
        program = torch.export.export(module, example, dynamic_shapes=dims)
        torch.export.save(program, folder / f"{name}.pt2")
        manifest[name] = {"kind": "export", "path": str(folder / f"{name}.pt2"), "args": run_args, "kwargs": {}}
        with torch.no_grad():
            expected[name] = module(*run_args)
        if name == "bool_mask_window" and not AOTI_CPU_PACKAGES_CRASH:
            path = torch._inductor.aoti_compile_and_package(program, package_path=str(folder / f"{name}_aoti.pt2"))
            manifest[f"{name}_aoti"] = {**manifest[name], "kind": "aoti", "path": path}
            expected[f"{name}_aoti"] = expected[name]
    if _has_transformers():
        manifest["hf_llama"], expected["hf_llama"] = _export_hf_llama(folder)
    results = run_in_fresh_process(manifest, folder)
    without_the_op = {kind: load_without_the_op(kind, manifest[name]["path"], folder)
                      for kind, name in (("export", "causal_gqa"), ("aoti", "bool_mask_window_aoti")) if name in manifest}
    return {name: (expected[name], results[name]) for name in manifest}, without_the_op


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _export_hf_llama(folder: Path) -> tuple[dict, torch.Tensor]:
    """A Hugging Face Llama with attn_implementation="fa2_inductor": the op is in its exported program
    without any pass. Exported with a dynamic sequence length, run at another one."""
    import fa2_inductor.hf
    from tests.hf_families import FAMILIES, SEQ as HF_SEQ

    fa2_inductor.hf.register()
    family = FAMILIES["llama"]
    model = LogitsOnly(family.build(fa2_inductor.hf.NAME))
    example = _llama_inputs(HF_SEQ)
    length = Dim("length", min=2, max=model.model.config.max_position_embeddings)
    with torch.no_grad():
        program = torch.export.export(model, (), example, dynamic_shapes={name: {1: length} for name in example})
        run_inputs = _llama_inputs(HF_SEQ - 3)
        expected = model(**run_inputs)
    torch.export.save(program, folder / "hf_llama.pt2")
    return {"kind": "export", "path": str(folder / "hf_llama.pt2"), "args": (), "kwargs": run_inputs}, expected


def _op_arguments(name: str) -> tuple:
    return _op_module_cases()[name.removesuffix("_aoti")][4]


@pytest.mark.parametrize("name", ["causal_gqa", "softcap_sinks", "bool_mask_window", "additive_mask_cross",
                                  pytest.param("bool_mask_window_aoti", marks=aoti_cpu_packages_load)])
def test_loaded_program_runs_the_op_at_new_shapes_like_eager(round_trips, name):
    cases, _ = round_trips
    expected, got = cases[name]
    assert got["op_calls"] == 1
    torch.testing.assert_close(got["outputs"], expected, atol=1e-6, rtol=1e-6)
    if not name.endswith("_aoti"):  # the op's trailing arguments survive serialisation
        assert got["op_arguments"] == [pytest.approx(_op_arguments(name))]


def test_hf_attention_interface_model_exports_with_the_op(round_trips):
    pytest.importorskip("transformers")
    from tests.hf_families import FAMILIES, HIDDEN

    cases, _ = round_trips
    expected, got = cases["hf_llama"]
    family = FAMILIES["llama"]
    sites = family.count_attention_sites(family.make_config(HIDDEN))
    assert got["op_calls"] == sites and len(got["op_arguments"]) == sites
    torch.testing.assert_close(got["outputs"], expected, atol=1e-5, rtol=1e-5)


def test_loading_an_exported_program_needs_fa2_inductor_imported(round_trips):
    # torch.export.load logs the unresolved op and raises a generic error.
    outcome, stderr = round_trips[1]["export"]
    assert outcome.startswith("RuntimeError") and "fa2_inductor.flash_attention_fwd" in stderr


@aoti_cpu_packages_load
def test_loading_an_aoti_package_needs_fa2_inductor_imported(round_trips):
    outcome, _ = round_trips[1]["aoti"]
    assert outcome.startswith("RuntimeError") and "fa2_inductor::flash_attention_fwd" in outcome, outcome


def test_dynamic_head_counts_are_checked_when_run():
    """Hq % Hkv == 0 becomes a run-time check of the program, not a specialisation."""
    t = _tensors(BATCH, SEQ, SEQ, 0)
    heads_q, heads_kv = Dim("heads_q"), Dim("heads_kv")
    dims = ({1: heads_q}, {1: heads_kv}, {1: heads_kv})
    program = torch.export.export(CausalGqa(), (t["q"], t["k"], t["v"]), dynamic_shapes=dims).module()
    q, kv = torch.randn(BATCH, 6, SEQ, HEAD_DIM), torch.randn(BATCH, 3, SEQ, HEAD_DIM)
    torch.testing.assert_close(program(q, kv, kv), CausalGqa()(q, kv, kv))
    kv = torch.randn(BATCH, 4, SEQ, HEAD_DIM)
    with pytest.raises(Exception, match=r"%|Mod"):
        program(q, kv, kv)


class ExplicitScale(torch.nn.Module):
    def forward(self, q, k, v):
        return fa2_inductor.flash_attention(q, k, v, scale=0.25)


def test_dynamic_head_dim_needs_the_op_limit_and_an_explicit_scale():
    """A dynamic head dim exports with an explicit scale and the op's limit (<= 256) in its range; without
    the limit torch names the fix, and flash_attention's default scale (1/sqrt(D)) fixes the head dim."""
    t = _tensors(BATCH, SEQ, SEQ, 0)
    qkv = (t["q"], t["k"], t["v"])
    program = torch.export.export(ExplicitScale(), qkv, dynamic_shapes=({3: Dim("d", max=256)},) * 3).module()
    q, kv = torch.randn(BATCH, HEADS_Q, SEQ, 24), torch.randn(BATCH, HEADS_KV, SEQ, 24)
    torch.testing.assert_close(program(q, kv, kv), ExplicitScale()(q, kv, kv))
    with pytest.raises(torch._dynamo.exc.UserError, match=r"max=256"):
        torch.export.export(ExplicitScale(), qkv, dynamic_shapes=({3: Dim("d")},) * 3)
    with pytest.raises(torch._dynamo.exc.UserError, match=r"Constraints violated \(d\)"):
        torch.export.export(CausalGqa(), qkv, dynamic_shapes=({3: Dim("d")},) * 3)


@pytest.mark.slow
@aoti_cpu_packages_load
def test_aoti_package_of_a_hf_llama_holds_the_pass_rewrite(cpu_pass, tmp_path):
    """The route for AOTInductor: aoti_compile_and_package inside fa2_inductor.enabled() runs the pass, so
    the package calls the op (causal + key padding from HF's mask), and a fresh process runs it."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from tests.hf_families import FAMILIES

    family = FAMILIES["llama"]
    model = LogitsOnly(family.build("sdpa"))
    inputs = family.make_inputs(model.model.config, torch.device("cpu"))
    with torch.no_grad():
        program = torch.export.export(model, (), inputs)
        expected = model(**inputs)
    with fa2_inductor.enabled():
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "llama.pt2"))
    sites = family.count_attention_sites(model.model.config)
    assert counters["fa2_inductor"]["rewrites"] == counters["fa2_inductor"]["rewrites:is_causal+key_mask"] == sites

    manifest = {"llama": {"kind": "aoti", "path": path, "args": (), "kwargs": inputs}}
    results = run_in_fresh_process(manifest, tmp_path)
    assert results["llama"]["op_calls"] == sites
    torch.testing.assert_close(results["llama"]["outputs"], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@aoti_cpu_packages_load
def test_aoti_check_script_runs_on_cpu(tmp_path):
    """scripts/aoti_check.py, the GPU machine's check, on CPU: every check but the kernel's passes."""
    result = _fresh_python(tmp_path, str(ROOT / "scripts" / "aoti_check.py"), "--device", "cpu", "--out",
                           str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    status = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()[1:-1]}
    assert status == {"export": "ok", "compile": "ok", "package": "ok", "load": "ok",
                      **{f"{check}@{s}": "ok" for check in ("logits", "op") for s in (32, 19)},
                      "kernel@32": "skipped", "kernel@19": "skipped"}
    assert result.stdout.splitlines()[-1] == "aoti_check: all passed: 8 ok, 0 failed, 2 skipped"
