"""Fixtures shared by the graph-pass tests."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import fa2_inductor


@pytest.fixture
def cpu_pass(monkeypatch):
    """Fresh Dynamo state and counters, the pass enabled on CPU, Inductor's caches off (so it really runs)."""
    monkeypatch.setattr(fa2_inductor.config, "rewrite_on_cpu", True)
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()
