"""ruff on Python text: the agent's ``lint`` tool, and what the lint reward counts.

    findings = ruff_findings(text, "pkg/mod.py")   # [Finding(row=506, col=15, code="F821", message=...)]
    lint(sandbox, {"path": "pkg/mod.py"}, cfg)      # the tool's observation, a finding a line
    shown_findings(observation, "pkg/mod.py")      # the findings an observation shows, read back

ruff runs on the host, never in the sandbox: the file's text is read through the sandbox's file
API and passed on stdin, and ruff only parses it (it runs none of it), so nothing the agent wrote
executes outside its sandbox. The rules are ``RULES`` (pyflakes, pycodestyle errors, syntax), not
the repository's own config, so every task is judged alike. Like an editor's diagnostics (Cursor's
agent reads them too), the tool shows where a file is broken: a line deleted from a function often
leaves a name undefined below it (F821) or a variable assigned and never used above it (F841).

Test: ``pytest tests/unit/harness/test_lint_tool.py``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opencomposer.config import AgentConfig
from opencomposer.harness.fs_tools import ToolError, read_text
from opencomposer.protocols import Sandbox

RULES = "E9,F,E7,E1"
MAX_SHOWN = 40  # findings a tool call shows (the rest counted)


@dataclass(frozen=True)
class Finding:
    row: int
    col: int
    code: str
    message: str


def ruff_binary() -> str | None:
    """ruff beside this interpreter (a venv's), else on PATH; None when neither."""
    here = Path(sys.executable).parent / "ruff"
    return str(here) if here.exists() else shutil.which("ruff")


def ruff_findings(text: str, filename: str, ruff: str) -> list[Finding]:
    """ruff's findings in ``text`` (named ``filename``) under ``RULES``, in file order."""
    out = subprocess.run([ruff, "check", "--isolated", "--select", RULES, "--output-format", "json",
                          "--stdin-filename", filename, "-"], input=text, capture_output=True, text=True,
                         timeout=60)
    if out.returncode not in (0, 1):
        raise RuntimeError(f"ruff failed on {filename}: {out.stderr.strip()[:300]}")
    found = [Finding(f["location"]["row"], f["location"]["column"], f["code"] or "E999", f["message"])
             for f in json.loads(out.stdout or "[]")]
    return sorted(found, key=lambda f: (f.row, f.col, f.code))


def _row(path: str, f: Finding) -> str:
    return f"{path}:{f.row}:{f.col}: {f.code} {f.message}"


def shown_findings(observation: str, path: str) -> list[Finding]:
    """The findings in ``path`` that an observation of the ``lint`` tool shows, in file order."""
    row = re.compile(rf"{re.escape(path)}:(\d+):(\d+): ([A-Z]+\d+) (.*)$")
    found = [Finding(int(m.group(1)), int(m.group(2)), m.group(3), m.group(4))
             for m in map(row.match, observation.splitlines()) if m]
    return sorted(found, key=lambda f: (f.row, f.col, f.code))


def lint(sandbox: Sandbox, args: dict[str, Any], cfg: AgentConfig) -> str:
    """The ``lint`` tool: ``path:row:col: CODE message`` a finding, or that there are none."""
    path = args["path"]
    if not path.endswith(".py"):
        raise ToolError(f"lint checks one Python file (a path ending in .py), got '{path}'")
    ruff = ruff_binary()
    if ruff is None:
        raise ToolError("lint is not available here (ruff is not installed)")
    found = ruff_findings(read_text(sandbox, path), path, ruff)
    if not found:
        return f"{path}: no problems found."
    rows = [_row(path, f) for f in found[:MAX_SHOWN]]
    if len(found) > MAX_SHOWN:
        rows.append(f"[{len(found) - MAX_SHOWN} more not shown]")
    return "\n".join(rows)
