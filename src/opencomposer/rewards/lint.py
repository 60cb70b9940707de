"""Lint of the final diff: ruff findings the episode added to the files it changed.

    lint = lint_delta(task.workspace, sandbox, changes)
    lint.new_findings, lint.codes     # 2, {"F401": 1, "E711": 1}

Each changed ``.py`` file is checked by ruff on the host (its text read from the
sandbox, passed on stdin), before and after; only findings the episode *added* count,
per rule code, so a repository's existing style debt costs the agent nothing. Rules:
``RULES`` (pyflakes, pycodestyle errors, syntax), not the repository's own config, so
every task is judged alike. Without ruff installed the result says so and counts 0.

Test: ``pytest tests/unit/rewards/test_shaping.py -k lint``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.protocols import Sandbox
from opencomposer.rewards.changes import Changes

RULES = "E9,F,E7,E1"
MAX_FILES = 20


@dataclass
class LintResult:
    new_findings: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    files: int = 0
    error: str = ""

    def to_dict(self) -> dict:
        return {"new_findings": self.new_findings, "codes": self.codes, "files": self.files, "error": self.error}


def ruff_binary() -> str | None:
    here = Path(sys.executable).parent / "ruff"
    return str(here) if here.exists() else shutil.which("ruff")


def ruff_codes(text: str, filename: str, ruff: str) -> Counter:
    out = subprocess.run([ruff, "check", "--isolated", "--select", RULES, "--output-format", "json",
                          "--stdin-filename", filename, "-"], input=text, capture_output=True, text=True,
                         timeout=60)
    if out.returncode not in (0, 1):
        raise RuntimeError(f"ruff failed on {filename}: {out.stderr.strip()[:300]}")
    return Counter(f["code"] or "E999" for f in json.loads(out.stdout or "[]"))


def lint_delta(workspace: Path, sandbox: Sandbox, changes: Changes) -> LintResult:
    ruff = ruff_binary()
    if ruff is None:
        return LintResult(error="ruff is not installed; lint not measured")
    added: Counter = Counter()
    py = [p for s, p in changes.files if s != "D" and p.endswith(".py")][:MAX_FILES]
    for path in py:
        try:
            after = sandbox.read_file(path).decode("utf-8", "replace")
        except (OSError, ValueError):
            continue
        base = workspace / path
        before = base.read_text("utf-8", "replace") if base.is_file() else ""
        delta = ruff_codes(after, path, ruff) - ruff_codes(before, path, ruff)
        added.update(delta)
    return LintResult(new_findings=sum(added.values()), codes=dict(added), files=len(py))
