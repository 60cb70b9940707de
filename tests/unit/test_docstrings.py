"""Every module says what it is for, and the tests its docstring names exist (issue 29).

Each module under src/opencomposer opens with a docstring; its ``Test:`` paragraph (the line
``Test: ...`` and the lines that continue it, up to a blank line) names the tests that cover it,
as ``tests/...`` files (``.py``, optionally with ``::node``) or folders. A test file that moved
or was never written fails here, naming the module and the missing path.

Run: ``pytest -q tests/unit/test_docstrings.py``; ``python tests/unit/test_docstrings.py`` prints
every problem, then one JSON line with the counts.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "opencomposer"
MODULES = sorted(PKG.rglob("*.py"))
_TEST_LINE = re.compile(r"^\s*Tests?:")
_PATH = re.compile(r"(?<![\w/.-])tests/[\w/.-]*[\w/]")  # "tests/unit/x.py::test_y" -> "tests/unit/x.py"


def rel(module: Path) -> str:
    return module.relative_to(ROOT).as_posix()


def paragraphs(doc: str) -> list[str]:
    """The ``Test:`` paragraphs of a docstring, each joined into one line."""
    out: list[str] = []
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if _TEST_LINE.match(line):
            para = [line]
            for more in lines[i + 1:]:
                if not more.strip() or _TEST_LINE.match(more):
                    break
                para.append(more)
            out.append(" ".join(p.strip() for p in para))
    return out


def named_paths(doc: str) -> list[str]:
    """The ``tests/...`` paths the ``Test:`` paragraphs of ``doc`` name."""
    return [m.group(0) for para in paragraphs(doc) for m in _PATH.finditer(para)]


def problems(module: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse(module.read_text(), str(module)))
    if not doc or not doc.strip():
        return [f"{rel(module)}: no module docstring (say what it is for and how to run or test it)"]
    return [f"{rel(module)}: its Test: line names {p}, which does not exist"
            for p in named_paths(doc) if not (ROOT / p).exists()]


def test_the_parser_reads_files_nodes_folders_and_continued_lines() -> None:
    doc = ("Purpose.\n\nTest: ``pytest tests/unit/a.py::test_x tests/unit/b``; the suite:\n"
           "``pytest tests/adversarial -q``.\n\nSee tests/elsewhere.py (not a Test: paragraph).\n")
    assert named_paths(doc) == ["tests/unit/a.py", "tests/unit/b", "tests/adversarial"]


@pytest.mark.parametrize("module", MODULES, ids=rel)
def test_module_has_a_docstring_and_its_tests_exist(module: Path) -> None:
    found = problems(module)
    assert not found, "\n".join(found)


if __name__ == "__main__":
    bad = [p for m in MODULES for p in problems(m)]
    for b in bad:
        print(b)
    print(json.dumps({"modules": len(MODULES), "problems": len(bad),
                      "modules_with_problems": len({b.split(":")[0] for b in bad})}))
