"""State every test starts from, the long-test switch, the hang guard, and the graph-pass fixtures."""

from __future__ import annotations

import contextlib
import faulthandler
import os
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch._dynamo.utils import counters

import fa2_inductor

# torch's compile-time configuration: a test that changes one of these and fails before restoring it
# must not change what a later test compiles.
_TORCH_CONFIGS = ("torch._inductor.config", "torch._functorch.config", "torch._dynamo.config", "torch.compiler.config")
LONG_TESTS_VARIABLE = "FA2_INDUCTOR_LONG_TESTS"
# The hang guard (scripts/hopper_check.sh sets both): a test running longer than FA2_INDUCTOR_TEST_TIMEOUT_S
# seconds ends the process with every thread's stack in PROGRESS/hang_stacks.txt, even from inside a CUDA
# call that never returns. PROGRESS/finished lists each finished test with its outcome, PROGRESS/running
# the one under way; a rerun with the same folder leaves out what finished and the tests listed in
# PROGRESS/hung (where the script moves a hung test).
_TIMEOUT_S = float(os.environ.get("FA2_INDUCTOR_TEST_TIMEOUT_S") or 0)
_PROGRESS = Path(os.environ["FA2_INDUCTOR_TEST_PROGRESS"]) if os.environ.get("FA2_INDUCTOR_TEST_PROGRESS") else None


def _torch_configs() -> list:
    import importlib

    return [importlib.import_module(name) for name in _TORCH_CONFIGS]


def _our_config() -> dict:
    return {name: value for name, value in vars(fa2_inductor.config).items() if not name.startswith("_")
            and isinstance(value, (bool, int, float, str))}


def _restore(config_module, saved: dict) -> None:
    now = config_module.get_config_copy()  # not getattr: deprecated entries warn when read
    for name, value in saved.items():
        if now.get(name) != value:
            setattr(config_module, name, value)


@pytest.fixture(autouse=True)
def isolated_compile_state() -> Iterator[None]:
    """Fresh Dynamo caches and empty counters before each test; torch's compile configs and
    ``fa2_inductor.config`` as the test found them afterwards (so neither an earlier test's compiled
    graphs nor its settings reach the next one)."""
    saved = [(module, module.get_config_copy()) for module in _torch_configs()]
    ours = _our_config()
    torch._dynamo.reset()
    counters.clear()
    # Every test compiles CPU graphs to scalar C++ (it compiles faster; the pass sees the same graph). One
    # setting for all: Inductor caches its vector-ISA choice per process, so a test compiling vectorised code
    # after one that compiled scalar code got a C++ compile error.
    torch._inductor.config.cpp.vec_isa_ok = False
    yield
    torch._dynamo.reset()
    for module, values in saved:
        _restore(module, values)
    for name, value in ours.items():
        setattr(fa2_inductor.config, name, value)


@contextlib.contextmanager
def compile_caches_off() -> Iterator[None]:
    """Inductor's FX-graph cache and AOTAutograd's cache off, so every compile runs every pass (without
    ``force_disable_caches``, which also turns off Dynamo's profile-guided settings with a warning)."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture
def cpu_pass(monkeypatch):
    """The pass enabled on CPU, with Inductor's caches off (the whole compile really runs)."""
    monkeypatch.setattr(fa2_inductor.config, "rewrite_on_cpu", True)
    with compile_caches_off():
        yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run only with FA2_INDUCTOR_LONG_TESTS=1 or when ``-m`` names them; with a
    progress folder, tests that already finished or hung there are left out."""
    if not (os.environ.get(LONG_TESTS_VARIABLE) == "1" or "slow" in (config.getoption("markexpr") or "")):
        skip = pytest.mark.skip(reason=f"long test: run with {LONG_TESTS_VARIABLE}=1 or -m slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    if _PROGRESS is not None:
        done = {line.split("\t", 1)[1] for line in _progress_lines("finished")} | set(_progress_lines("hung"))
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = [item for item in items if item.nodeid not in done]


def _progress_lines(name: str) -> list[str]:
    path = _PROGRESS / name
    return path.read_text().splitlines() if path.exists() else []


_outcomes: dict[str, str] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _TIMEOUT_S <= 0:
        yield
        return
    dump = None  # without a progress folder the stacks go to stderr
    if _PROGRESS is not None:
        _PROGRESS.mkdir(parents=True, exist_ok=True)
        (_PROGRESS / "running").write_text(item.nodeid)
        dump = open(_PROGRESS / "hang_stacks.txt", "w")  # only the test under way: a hang leaves its stacks
    faulthandler.dump_traceback_later(_TIMEOUT_S, exit=True, **({"file": dump} if dump else {}))
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        if dump is not None:
            dump.close()
    if _PROGRESS is not None:
        with open(_PROGRESS / "finished", "a") as finished:
            finished.write(f"{_outcomes.pop(item.nodeid, 'passed')}\t{item.nodeid}\n")
        (_PROGRESS / "running").unlink()


def pytest_runtest_logreport(report):
    """The test's outcome for the progress folder: failed if any phase failed, else skipped or passed."""
    if _PROGRESS is None:
        return
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and _outcomes.get(report.nodeid) != "failed":
        _outcomes[report.nodeid] = "skipped"
