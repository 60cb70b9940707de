"""Map tests to the library code they execute, by tracing while the suite runs in a sandbox.

A small pytest plugin (``PLUGIN``, written into the sandbox's workspace as ``_oc_trace.py``
and loaded with ``-p _oc_trace``) installs a ``sys.settrace`` hook that looks only at frames
whose code lives in the library's package dirs. For each test it records which library
functions ran (file and ``co_firstlineno``, the first decorator line of a decorated def), and
over the whole run which library lines ran (line events only for each function's first 20
calls, so a suite that hammers a hot loop is not slowed tenfold). ``trace_tests`` returns a ``TestMap``::

    tm = trace_tests(sandbox, ["tests/test_core.py"], ["toolz"])
    tm.by_function()[("toolz/itertoolz.py", 10)]   # top-level test items that ran the def at line 10
    tm.lines["toolz/itertoolz.py"]                  # lines executed by any test

Coverage.py would give the same answer but must then be installed into every library's
environment; tracing needs nothing but the interpreter. The trace run is also one of the
three repeated baseline runs that expose flaky tests (``prepare.prepare_source``).

Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_coverage.py``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

from opencomposer.protocols import Sandbox
from opencomposer.tasks.testrun import DEFAULT_COMMAND, TestReport, run_tests

PLUGIN_MODULE = "_oc_trace"
CONFIG_FILE = "_oc_trace.json"
OUTPUT_FILE = "_oc_trace_out.json"

PLUGIN = r'''
"""Records which library functions each test runs (opencomposer.tasks.coverage)."""
import json, os, sys, threading
import pytest

_cfg = json.load(open(os.path.join(os.getcwd(), "_oc_trace.json")))
_ROOT = os.path.realpath(os.getcwd())
_PKGS = tuple(_cfg["package_dirs"])
_seen = {}
_funcs = {}
_lines = {}
_cur = [None]


def _rel(filename):
    r = _seen.get(filename)
    if r is None:
        p = os.path.realpath(filename)
        r = p[len(_ROOT) + 1:] if p.startswith(_ROOT + os.sep) else ""
        if r and not any(r == d or r.startswith(d + "/") for d in _PKGS):
            r = ""
        _seen[filename] = r
    return r


_calls = {}
LINE_CALLS = 20  # lines are traced for a code object's first calls only: hot loops stay cheap


def _trace(frame, event, arg):
    code = frame.f_code
    rel = _rel(code.co_filename)
    if not rel:
        return None
    if _cur[0] is not None:
        _cur[0].add("%s:%d" % (rel, code.co_firstlineno))
    n = _calls[code] = _calls.get(code, 0) + 1
    if n > LINE_CALLS:
        return None
    lines = _lines.setdefault(rel, set())

    def local(frame, event, arg):
        if event == "line":
            lines.add(frame.f_lineno)
        return local
    return local


sys.settrace(_trace)
threading.settrace(_trace)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _cur[0] = _funcs.setdefault(item.nodeid, set())
    yield
    _cur[0] = None


def pytest_sessionfinish(session):
    sys.settrace(None)
    with open(os.path.join(_ROOT, "_oc_trace_out.json"), "w") as f:
        json.dump({"funcs": {k: sorted(v) for k, v in _funcs.items()},
                   "lines": {k: sorted(v) for k, v in _lines.items()}}, f)
'''


def item_of(node_id: str) -> str:
    """The top-level test item of a node id: ``f.py::TestX::test_y[1]`` -> ``f.py::TestX``."""
    parts = node_id.split("::")
    return "::".join(parts[:2]).split("[", 1)[0] if len(parts) > 1 else node_id


@dataclass
class TestMap:
    __test__ = False
    funcs: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # node id -> functions run
    lines: dict[str, set[int]] = field(default_factory=dict)  # library file -> lines run
    report: TestReport | None = None  # the outcomes of the traced run

    def by_function(self) -> dict[tuple[str, int], set[str]]:
        """(file, co_firstlineno) -> top-level test items that ran it."""
        out: dict[tuple[str, int], set[str]] = defaultdict(set)
        for t, fs in self.funcs.items():
            for key in fs:
                out[key].add(item_of(t))
        return out


def trace_tests(sandbox: Sandbox, targets: list[str], package_dirs: list[str],
                timeout: float = 600.0) -> TestMap:
    """Run ``targets`` under the tracing plugin; the sandbox's workspace gets three extra files."""
    sandbox.write_file(f"{PLUGIN_MODULE}.py", PLUGIN.encode())
    sandbox.write_file(CONFIG_FILE, json.dumps({"package_dirs": [d.rstrip("/") for d in package_dirs]}).encode())
    # the launcher (`python -c`) puts the workspace root on sys.path, so `-p _oc_trace` finds the plugin
    report = run_tests(sandbox, targets, DEFAULT_COMMAND + f" -p {PLUGIN_MODULE}", timeout=timeout)
    try:
        data = json.loads(sandbox.read_file(OUTPUT_FILE))
    except (OSError, ValueError):
        return TestMap(report=report)  # the run died before the session finished: no map
    funcs = {t: [_split_key(k) for k in ks] for t, ks in data["funcs"].items()}
    return TestMap(funcs, {f: set(ls) for f, ls in data["lines"].items()}, report)


def flaky_tests(reports: list[TestReport]) -> set[str]:
    """Node ids that passed in some runs and not in others (missing counts as not passing)."""
    ids = set().union(*(r.outcomes for r in reports))
    return {t for t in ids if len({t in r.passed() for r in reports}) > 1}


def _split_key(key: str) -> tuple[str, int]:
    f, _, ln = key.rpartition(":")
    return f, int(ln)

