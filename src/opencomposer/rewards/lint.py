"""Lint of the final diff: ruff findings the episode added to the files it changed.

    lint = lint_delta(task.workspace, sandbox, changes)
    lint.new_findings, lint.codes     # 2, {"F401": 1, "E711": 1}

Each changed ``.py`` file is checked by ruff on the host (``harness/lint.py``; its text read from the
sandbox, passed on stdin), before and after; only findings the episode *added* count,
per rule code, so a repository's existing style debt costs the agent nothing. Rules:
``RULES`` (pyflakes, pycodestyle errors, syntax), not the repository's own config, so
every task is judged alike. Without ruff installed the result says so and counts 0.

Test: ``pytest tests/unit/rewards/test_shaping.py -k lint``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.harness.lint import RULES, ruff_binary, ruff_findings
from opencomposer.protocols import Sandbox
from opencomposer.rewards.changes import Changes

__all__ = ["RULES", "LintResult", "lint_delta", "ruff_binary", "ruff_codes"]
MAX_FILES = 20


@dataclass
class LintResult:
    new_findings: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    files: int = 0
    error: str = ""

    def to_dict(self) -> dict:
        return {"new_findings": self.new_findings, "codes": self.codes, "files": self.files, "error": self.error}


def ruff_codes(text: str, filename: str, ruff: str) -> Counter:
    """How many findings of each rule code ``text`` has (``harness/lint.ruff_findings``)."""
    return Counter(f.code for f in ruff_findings(text, filename, ruff))


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
