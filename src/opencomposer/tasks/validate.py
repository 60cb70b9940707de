"""What judges one deletion: the tests selected for it, and the sandbox that applies it and runs them.

    items = {f: test_items(prep.root, f) for f in prep.layout.test_files}
    targets = tuple(select_targets(items, ["chunked"], random.Random(0)))  # tests that mention it
    w = Worker(prep, backend="namespace", timeout=300)
    w.apply(d.files); w.imports(["more_itertools.more"]); after = w.run(targets)

The tests of a deletion are the test items (top-level test functions and classes,
``test_items``) that mention a deleted name or, per the coverage map, execute the deleted
code, plus a few neighbours from the same files as a regression guard (PASS_TO_PASS). A
``function`` or ``class`` deletion is first probed by importing its modules (``module_of``):
one that breaks the import fails every test, so it is rejected without a test run.

Test: ``pytest tests/unit/tasks/test_factory.py``.
"""

from __future__ import annotations

import ast
import random
import re
from pathlib import Path

from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer import pyparse
from opencomposer.tasks.prepare import Prepared
from opencomposer.tasks.testrun import TestReport, run_tests

MAX_COVERING = 30  # test items kept per deletion among those that execute it
IMPORT_PROBE = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)"


def test_items(root: Path, rel: str) -> list[tuple[str, str]]:
    """(node id, source) of the top-level test functions and test classes of one file."""
    text = (root / rel).read_text(errors="replace")
    try:
        tree = pyparse.parse(text)
    except SyntaxError:
        return []
    items = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test") or isinstance(node, ast.ClassDef) and any(
            isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) and b.name.startswith("test") for b in node.body
        ):
            items.append((f"{rel}::{node.name}", ast.get_source_segment(text, node) or ""))
    return items


def select_targets(items: dict[str, list[tuple[str, str]]], names: list[str], rng: random.Random,
                   covering: set[str] | None = None, neighbours: int = 3,
                   max_covering: int = MAX_COVERING) -> list[str]:
    """Test items that mention one of ``names`` or (per the coverage map) execute the deleted
    code, plus a few others from the same files as a regression guard (PASS_TO_PASS)."""
    pat = re.compile(r"\b(?:" + "|".join(re.escape(n) for n in names) + r")\b")
    known = {i for its in items.values() for i, _ in its}
    mention = {i for its in items.values() for i, src in its if pat.search(src)}
    extra = sorted((covering or set()) & known - mention)
    rng.shuffle(extra)
    hit = mention | set(extra[: max(0, max_covering - len(mention))])
    targets: list[str] = []
    for its in items.values():
        mine = [i for i, _ in its if i in hit]
        if not mine:
            continue
        others = [i for i, _ in its if i not in hit]
        targets += mine + rng.sample(others, min(neighbours, len(others)))
    return targets


def module_of(rel: str, pythonpath: list[str]) -> str | None:
    """``src/pkg/mod.py`` with pythonpath ``["src"]`` -> ``pkg.mod`` (None if outside it)."""
    for base in sorted(pythonpath, key=len, reverse=True):
        base = base.strip("/")
        if base in ("", "."):
            sub = rel
        elif rel.startswith(base + "/"):
            sub = rel[len(base) + 1:]
        else:
            continue
        parts = sub.removesuffix(".py").split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and all(x.isidentifier() for x in parts):
            return ".".join(parts)
    return None


class Worker:
    """One sandbox per thread, reset between candidates."""

    def __init__(self, prep: Prepared, backend: str, timeout: float):
        self.prep, self.timeout = prep, timeout
        self.sb = make_sandbox(SandboxSpec(prep.root, prep.env, prep.layout.pythonpath), backend)

    def original(self, targets: tuple[str, ...]) -> TestReport:
        """The selected tests, run alone on the original tree."""
        self.sb.reset()
        return run_tests(self.sb, list(targets), timeout=self.timeout)

    def apply(self, files: dict[str, tuple[str, str]]) -> None:
        self.sb.reset()
        for rel, (_, after) in files.items():
            self.sb.write_file(rel, after.encode())

    def imports(self, modules: list[str]) -> str:
        """'' if ``modules`` import in the (deleted) tree, else the error's last line."""
        r = self.sb.exec(["python", "-c", IMPORT_PROBE, *modules], timeout=min(self.timeout, 120))
        return "" if r.exit_code == 0 else (r.output.strip().splitlines() or ["?"])[-1][:200]

    def run(self, targets: tuple[str, ...]) -> TestReport:
        return run_tests(self.sb, list(targets), timeout=self.timeout)

