"""csrc/kernel_table.py: the build's compile units, one per (head dim, dtype, variant), heaviest first."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("kernel_table", ROOT / "csrc" / "kernel_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _header_of(source: str) -> str:
    return next(line for line in source.splitlines() if line.startswith("#include")).split('"')[1]


def test_every_selected_kernel_has_one_unit(table):
    units = table.compile_units([64, 128], ["bf16"])
    variants = {path.rsplit("/", 1)[1].split("_", 1)[1] for path in units}  # less the rank prefix
    expected = {f"hdim{d}_bf16_{variant}.cu" for d in (64, 128) for variant in table.VARIANTS}
    assert variants == expected | {f"{unit}.cu" for unit in table.SHARED_UNITS}


def test_units_come_heaviest_first_in_the_order_the_build_starts_them(table):
    units = table.compile_units(table.HEAD_DIMS, table.DTYPES)
    started = sorted(units)  # setuptools sorts an extension's sources by name
    kernel_headers = [_header_of(units[path]) for path in started if "_hdim" in path]
    ranks = [table.BUILD_ORDER.index(header) for header in kernel_headers]
    assert ranks == sorted(ranks) and set(ranks) == set(range(len(table.BUILD_ORDER)))
    shared = [path for path in units if "_hdim" not in path]
    assert started[-len(shared):] == shared  # the shared units are short: they go last


def test_the_default_build_and_the_backward_take_head_dims_the_table_knows(table):
    assert set(table.DEFAULT_HEAD_DIMS) <= set(table.HEAD_DIMS)
    assert set(table.BACKWARD_HEAD_DIMS) <= set(table.HEAD_DIMS)
    assert max(table.DEFAULT_HEAD_DIMS) == max(table.HEAD_DIMS)  # every head dim has a kernel to run on
    units = table.compile_units([96], ["bf16"])  # a forward-only head dim: no backward units
    assert not any("_bwd_" in path for path in units) and any("hdim96_bf16_fwd_unmasked" in path for path in units)


@pytest.mark.parametrize("version, standard", [("2.11.0+cu130", "-std=c++17"), ("2.13.0", "-std=c++17"),
                                               ("2.14.1", "-std=c++20"), ("3.0.0", "-std=c++20")])
def test_host_code_takes_the_standard_its_torch_headers_need(table, version, standard):
    assert table.host_cxx_standard(version) == standard
