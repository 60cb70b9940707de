"""Tracing a real pytest run in a real sandbox: which tests ran which library functions and
lines; and flaky tests found by comparing repeated runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer.sandbox.namespace import unavailable_reason
from opencomposer.tasks.coverage import flaky_tests, item_of, trace_tests
from opencomposer.tasks.testrun import TestReport

MOD = '''\
import functools


def double(x):
    return x * 2


@functools.lru_cache(maxsize=None)
def triple(x):
    if x < 0:
        raise ValueError(x)
    return x * 3


class Acc:
    def add(self, x):
        return double(x) + 1
'''

TESTS = '''\
import pytest
from pkg.mod import Acc, double, triple


def test_double():
    assert double(2) == 4


@pytest.mark.parametrize("x", [1, 2])
def test_triple(x):
    assert triple(x) == 3 * x


class TestAcc:
    def test_add(self):
        assert Acc().add(1) == 3
'''


NS = unavailable_reason()


@pytest.mark.parametrize("backend", ["local", pytest.param(
    "namespace", marks=[pytest.mark.namespace, pytest.mark.skipif(bool(NS), reason=str(NS))])])
def test_trace_maps_tests_to_functions_and_lines(tmp_path: Path, backend: str) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(MOD)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text(TESTS)
    with make_sandbox(SandboxSpec(tmp_path, Path(sys.prefix), ["."]), backend) as sb:
        tm = trace_tests(sb, ["tests/test_mod.py"], ["pkg"], timeout=120)
    assert tm.report is not None and len(tm.report.passed()) == 4
    f = "pkg/mod.py"
    # a decorated function is keyed by its first decorator line (co_firstlineno)
    assert tm.funcs["tests/test_mod.py::test_triple[1]"] == [(f, 8)]
    assert sorted(tm.funcs["tests/test_mod.py::TestAcc::test_add"]) == [(f, 4), (f, 16)]
    assert tm.by_function()[(f, 4)] == {"tests/test_mod.py::test_double", "tests/test_mod.py::TestAcc"}
    assert tm.by_function()[(f, 16)] == {"tests/test_mod.py::TestAcc"}
    assert tm.by_function()[(f, 8)] == {"tests/test_mod.py::test_triple"}
    assert 5 in tm.lines[f] and 12 in tm.lines[f] and 11 not in tm.lines[f]  # raise never ran
    assert not any(k.startswith("tests/") for k in tm.lines)  # only library files traced


def test_item_of_and_flaky() -> None:
    assert item_of("t.py::TestK::test_a[1-2]") == "t.py::TestK"
    assert item_of("t.py::test_b[x::y]") == "t.py::test_b"
    runs = [TestReport({"a": "PASSED", "b": "PASSED", "c": "FAILED"}),
            TestReport({"a": "PASSED", "b": "FAILED", "c": "FAILED"}),
            TestReport({"a": "PASSED", "c": "FAILED", "b": "PASSED"})]
    assert flaky_tests(runs) == {"b"}
    assert flaky_tests(runs[:1]) == set()
