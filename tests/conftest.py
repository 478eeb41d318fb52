"""State every test starts from, the long-test switch, and the fixtures shared by the graph-pass tests."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import pytest
import torch
from torch._dynamo.utils import counters

import fa2_inductor

# torch's compile-time configuration: a test that changes one of these and fails before restoring it
# must not change what a later test compiles.
_TORCH_CONFIGS = ("torch._inductor.config", "torch._functorch.config", "torch._dynamo.config", "torch.compiler.config")
LONG_TESTS_VARIABLE = "FA2_INDUCTOR_LONG_TESTS"


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
    """Tests marked ``slow`` run only with FA2_INDUCTOR_LONG_TESTS=1 or when ``-m`` names them."""
    if os.environ.get(LONG_TESTS_VARIABLE) == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason=f"long test: run with {LONG_TESTS_VARIABLE}=1 or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
