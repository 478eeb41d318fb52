"""AOTInductor with the attention pass: the end-to-end benchmark's Llama exported, AOT-compiled, packaged,
then loaded and run in a fresh process.

    python scripts/aoti_check.py                       # CUDA: the benchmark Llama, bf16, 2048 and 1531 tokens
    python scripts/aoti_check.py --seqlens 2048        # one length: exported with a static sequence length
    python scripts/aoti_check.py --device cpu          # anywhere: its tiny Llama, float32; GPU checks skipped

With several ``--seqlens`` the program is exported with a dynamic sequence length (the first is the
example) and the package runs every length. One line per check ("ok", "FAILED" or "skipped"), then a
summary line; the exit status is 1 if a check failed.

  export     torch.export.export of the model (logits only, no KV cache)
  compile    torch._inductor.aoti_compile_and_package inside fa2_inductor.enabled(): every attention site
             rewritten into the op (the counters name the forms)
  package    op calls in the package's generated code
  load       a fresh Python process that imports torch and fa2_inductor, nothing else: aoti_load_package
  logits@S   the package's logits against the uncompiled model's (the demo's tolerance)
  op@S       op calls while the package runs (a dispatch counter): as many as the package holds
  kernel@S   on CUDA: launches of the Hopper kernel (fwd_kernel_sm90) seen by torch.profiler, at least one
             per op call, and no call that fell back to the reference
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

import torch

OP = "fa2_inductor::flash_attention_fwd"
KERNEL = "fwd_kernel_sm90"
PACKAGE, EXPECTED = "llama.pt2", "expected.pt"
STATUSES = ("ok", "FAILED", "skipped")
statuses: list[str] = []  # of the checks this process reported


def report(check: str, passed, detail: str) -> bool:
    """Prints one check's line; ``passed`` None means skipped. Returns False only for a failure."""
    status = STATUSES[2] if passed is None else STATUSES[0 if passed else 1]
    statuses.append(status)
    print(f"{check:<12}{status:<9}{detail}", flush=True)
    return passed is not False


def op_calls_in_package(path: Path) -> int:
    """Calls of the op a package makes per run: AOTInductor lists every call it leaves to the dispatcher
    (custom ops among them) as a node of its wrapper's JSON file."""
    calls = 0
    with zipfile.ZipFile(path) as package:
        for name in package.namelist():
            if name.endswith(".json"):
                nodes = json.loads(package.read(name)).get("nodes", [])
                calls += sum(node.get("node", {}).get("target") == OP for node in nodes)
    return calls


class LogitsOnly(torch.nn.Module):
    """The causal LM as an exportable function of its token ids: logits, no KV cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def build_and_compile(args: argparse.Namespace, folder: Path) -> bool:
    """Export and AOT-compile with the pass; writes the package and what the fresh process checks against."""
    import fa2_inductor
    from torch._dynamo.utils import counters
    from torch.export import Dim

    from fa2_inductor.bench_e2e import LLAMA_SHAPE, TINY_SHAPE, build_model
    from fa2_inductor.demo import _TOLERANCE as LOGITS_TOLERANCE

    device = torch.device(args.device)
    shape, dtype = (LLAMA_SHAPE, torch.bfloat16) if device.type == "cuda" else (TINY_SHAPE, torch.float32)
    fa2_inductor.config.rewrite_on_cpu = device.type == "cpu"
    model = LogitsOnly(build_model(shape, "sdpa", dtype, device, max(args.seqlens)))
    gen = torch.Generator().manual_seed(1)
    inputs = {s: torch.randint(0, shape["vocab_size"], (1, s), generator=gen) for s in args.seqlens}
    with torch.no_grad():
        expected = {s: model(ids.to(device)).cpu() for s, ids in inputs.items()}

    start = time.perf_counter()
    dynamic = len(args.seqlens) > 1
    # Dim.DYNAMIC, not a named Dim with a range: torch 2.11 cannot prove a guard that transformers' repeat_kv
    # adds (Min(16*s, 32*s) == 16*s) over an explicit range and refuses the export.
    dims = {"input_ids": {1: Dim.DYNAMIC}} if dynamic else None
    example = {"input_ids": inputs[args.seqlens[0]].to(device)}
    with torch.no_grad():
        program = torch.export.export(model, (), example, dynamic_shapes=dims)
    report("export", True, f"{'dynamic' if dynamic else 'static'} sequence length, "
                           f"{len(program.graph.nodes)} nodes, {time.perf_counter() - start:.0f} s")

    start = time.perf_counter()
    counters.clear()
    with fa2_inductor.enabled():
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(folder / PACKAGE))
    layers = shape["num_hidden_layers"]
    rewrites = counters["fa2_inductor"]["rewrites"]
    forms = {k: v for k, v in counters["fa2_inductor"].items() if k.startswith(("rewrites:", "refused:"))}
    ok = report("compile", rewrites == layers, f"{rewrites} of {layers} attention sites rewritten {forms}, "
                                                f"{time.perf_counter() - start:.0f} s")
    package_calls = op_calls_in_package(Path(path))
    ok &= report("package", package_calls == rewrites, f"{package_calls} calls of {OP} in {path}")
    torch.save({"device": str(device), "inputs": inputs, "expected": expected, "package_calls": package_calls,
                "tolerance": LOGITS_TOLERANCE[dtype]}, folder / EXPECTED)
    return ok


def load_and_run(folder: Path) -> bool:
    """The fresh process: the package, loaded with nothing but torch and fa2_inductor, against eager's logits."""
    import fa2_inductor  # noqa: F401  (registers the op: the one import a deployment needs)
    from torch._dynamo.utils import counters
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOpCalls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += func.name() == OP
            return func(*args, **(kwargs or {}))

    saved = torch.load(folder / EXPECTED)
    device = torch.device(saved["device"])
    start = time.perf_counter()
    runner = torch._inductor.aoti_load_package(str(folder / PACKAGE))
    ok = report("load", True, f"fresh process, import fa2_inductor only, {time.perf_counter() - start:.1f} s")
    for seqlen, ids in saved["inputs"].items():
        ids = ids.to(device)
        with torch.no_grad():
            runner(input_ids=ids)  # first call: lazy initialisation outside the profile
            counters.clear()
            with CountOpCalls() as counter, kernel_profile(device) as profile:
                logits = runner(input_ids=ids)
        expected = saved["expected"][seqlen].float()
        error = ((logits.float().cpu() - expected).abs().max() / expected.abs().max()).item()
        ok &= report(f"logits@{seqlen}", error <= saved["tolerance"],
                     f"max difference {error:.2e} of the largest logit (tolerance {saved['tolerance']:g})")
        ok &= report(f"op@{seqlen}", counter.calls == saved["package_calls"] > 0,
                     f"{counter.calls} op calls while running (the package holds {saved['package_calls']})")
        if profile is None:
            ok &= report(f"kernel@{seqlen}", None, "needs a CUDA GPU")
            continue
        launches = sum(event.count for event in profile.key_averages() if KERNEL in event.key)
        fallbacks = {k: v for k, v in counters["fa2_inductor"].items() if k.startswith("reference_fallback:")}
        ok &= report(f"kernel@{seqlen}", launches >= counter.calls > 0 and not fallbacks,
                     f"{launches} {KERNEL} launches for {counter.calls} op calls, reference fallbacks {fallbacks}")
    return ok


@contextlib.contextmanager
def kernel_profile(device: torch.device):
    """torch.profiler over the CUDA kernels launched inside (yields the profile); elsewhere yields None."""
    if device.type != "cuda":
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as kernels:
        yield kernels
        torch.cuda.synchronize()


def run_fresh_process(folder: Path) -> bool:
    """This script's --load in a new Python process that finds the same fa2_inductor; relays its lines."""
    import fa2_inductor

    package_root = str(Path(fa2_inductor.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, __file__, "--load", str(folder)], capture_output=True, text=True, env=env)
    for line in result.stdout.splitlines():
        print(line, flush=True)
        statuses.extend(word for word in line.split()[1:2] if word in STATUSES)
    if result.returncode == 1:  # a check failed and said so; its warnings may say why
        print(result.stderr.strip()[-3000:], file=sys.stderr)
    elif result.returncode != 0:  # it did not finish
        report("run", False, f"the fresh process exited with {result.returncode}: {result.stderr.strip()[-3000:]}")
    return result.returncode == 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seqlens", type=int, nargs="+", help="default: 2048 1531 on CUDA, 32 19 on CPU")
    parser.add_argument("--out", type=Path, help="folder for the package (default: a new temporary folder)")
    parser.add_argument("--load", type=Path, help=argparse.SUPPRESS)  # the fresh process's side
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible here; run with --device cpu")
    args.seqlens = args.seqlens or ([2048, 1531] if args.device == "cuda" else [32, 19])
    return args


def run_checked(step) -> bool:
    """A step's own verdict; a step that raises is one failed check, its traceback on stderr."""
    try:
        return step()
    except Exception as exc:
        traceback.print_exc()
        return report("error", False, f"{type(exc).__name__}: {str(exc).strip()[:500]}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.load is not None:
        return 0 if run_checked(lambda: load_and_run(args.load)) else 1
    folder = args.out or Path(tempfile.mkdtemp(prefix="aoti_check_"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EXPECTED).unlink(missing_ok=True)  # what an earlier run left must not be checked again
    print(f"torch {torch.__version__}, {args.device}, sequence lengths {args.seqlens}, files in {folder}", flush=True)
    compiled = run_checked(lambda: build_and_compile(args, folder))
    # A package whose compile check failed still runs: its logits and op calls say more.
    ran = (folder / EXPECTED).exists() and run_checked(lambda: run_fresh_process(folder))
    passed = compiled and ran
    print(f"aoti_check: {'all passed' if passed else 'FAILED'}: {statuses.count('ok')} ok, "
          f"{statuses.count('FAILED')} failed, {statuses.count('skipped')} skipped")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
