"""The lint tool (``harness/lint.py``): ruff's findings in a workspace file, with rows the model can go
to; offered only where ``AgentConfig.lint_tool``; the file's text is only parsed on the host, never run;
bad paths get errors the model can act on. Real sandboxes (local and namespace), real ruff."""

from __future__ import annotations

import pytest

from opencomposer.harness.lint import ruff_binary
from opencomposer.harness.prompt import system_prompt
from opencomposer.harness.tools import execute, offered, tool_schemas
from opencomposer.protocols import ToolCall

from testkit.agent_repo import open_sandbox

pytestmark = pytest.mark.skipif(ruff_binary() is None, reason="ruff is not installed")

BROKEN = '''\
def total(xs):
    result = 0
    for x in xs:
        result = result + x
    return resul


def scale(xs, k):
    out = [x * k for x in xs]
    return xs
'''


@pytest.fixture(params=["local", pytest.param("namespace", marks=pytest.mark.namespace)])
def sandbox(request, repo):
    with open_sandbox(repo, request.param) as sb:
        yield sb


@pytest.fixture
def lint_cfg(cfg):
    return cfg.model_copy(update={"lint_tool": True})


def lint(sandbox, cfg, path):
    return execute(sandbox, ToolCall("lint", {"path": path}), cfg)


def test_findings_come_with_the_rows_and_codes_to_go_to(sandbox, lint_cfg):
    sandbox.write_file("calc/broken.py", BROKEN.encode())
    out = lint(sandbox, lint_cfg, "calc/broken.py")
    assert out.ok and not out.invalid
    assert out.observation.splitlines() == [
        "calc/broken.py:5:12: F821 Undefined name `resul`",
        "calc/broken.py:9:5: F841 Local variable `out` is assigned to but never used",
    ]


def test_a_clean_file_says_so(sandbox, lint_cfg):
    out = lint(sandbox, lint_cfg, "calc/core.py")
    assert out.ok and out.observation == "calc/core.py: no problems found."


def test_bad_paths_get_errors_the_model_can_act_on(sandbox, lint_cfg):
    missing = lint(sandbox, lint_cfg, "calc/nope.py")
    assert not missing.ok and missing.observation == "Error: no such file: calc/nope.py"
    not_py = lint(sandbox, lint_cfg, "README.md")
    assert not not_py.ok and "lint checks one Python file (a path ending in .py), got 'README.md'" in not_py.observation
    escape = lint(sandbox, lint_cfg, "../outside.py")
    assert not escape.ok and "outside the workspace" in escape.observation


def test_the_text_is_parsed_never_run(sandbox, lint_cfg, tmp_path):
    marker = tmp_path / "ran"
    sandbox.write_file("calc/evil.py", f"import os\nos.system('touch {marker}')\nopen('{marker}', 'w')\n".encode())
    out = lint(sandbox, lint_cfg, "calc/evil.py")
    assert out.ok and out.observation == "calc/evil.py: no problems found." and not marker.exists()


def test_offered_only_where_the_config_asks(sandbox, cfg, lint_cfg):
    assert "lint" not in offered(cfg) and "lint" not in [s["function"]["name"] for s in tool_schemas(cfg)]
    names = offered(lint_cfg)
    assert names.index("lint") == names.index("search") + 1  # fixed order: prefix caches depend on it
    refused = lint(sandbox, cfg, "calc/core.py")
    assert refused.invalid and "unknown tool 'lint'" in refused.observation
    assert "lint lists a Python file's errors" in system_prompt(lint_cfg)
    assert "lint" not in system_prompt(cfg)
