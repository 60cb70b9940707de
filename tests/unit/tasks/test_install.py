"""Auto-install: requirements discovered from every place projects keep them; a repository
whose tests need a module no recipe names is installed by an agent in the ordinary harness
(a scripted policy at the policy boundary), and kept only if its suite then runs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from opencomposer.policies.scripted import ScriptedPolicy, tool_call
from opencomposer.tasks.install import (
    VERIFY_FILE,
    InstallError,
    collection_errors,
    discover,
    install_repo,
    missing_modules,
    uncollectable,
    verify,
)
from opencomposer.tasks.layout import inspect_project
from opencomposer.tasks.testrun import TestReport


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


def test_discover_reads_every_recipe(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "tests/test_a.py": "def test_a():\n    pass\n",
        "setup.cfg": """
            [options]
            install_requires =
                attrs>=20
            [options.extras_require]
            test =
                hypothesis
            docs =
                sphinx
            """,
        "setup.py": "from setuptools import setup\nsetup(name='pkg', tests_require=['mock'], "
                    "extras_require={'testing': ['freezegun'], 'speed': ['ujson']})\n",
        "requirements-dev.txt": "# tools\npytest-timeout==2.1  # pinned\n-r other.txt\n",
        "tox.ini": "[testenv]\ndeps =\n    pyyaml\n    py38: oldthing\n    -rrequirements.txt\ncommands = pytest\n",
        "noxfile.py": "import nox\n@nox.session\ndef tests(session):\n    session.install('-e', '.')\n"
                      "    session.install('toml', 'six')\n",
        ".github/workflows/ci.yml": "steps:\n  - run: python -m pip install --upgrade pip wheel\n"
                                    "  - run: pip install -e . responses==0.23\n",
    })
    plan = discover(root, inspect_project(root))
    names = [r.split("=")[0].split(">")[0] for r in plan.requirements]
    for want in ("attrs", "hypothesis", "mock", "freezegun", "pytest-timeout", "pyyaml", "toml",
                 "six", "responses", "pytest"):
        assert want in names, (want, plan.requirements)
    for never in ("sphinx", "ujson", "oldthing", "pip", "wheel"):
        assert never not in names
    assert plan.found_in["setup.cfg"] == 2 and plan.found_in["tox.ini"] == 1
    assert plan.found_in[".github/workflows/ci.yml"] == 3


def test_missing_modules_and_uncollectable(tmp_path: Path) -> None:
    root = _write(tmp_path, {"mylib/__init__.py": "", "tests/test_x.py": "", "tests/helpers.py": ""})
    layout = inspect_project(root)
    out = ("E   ModuleNotFoundError: No module named 'yaml'\n"
           "E   ModuleNotFoundError: No module named 'mylib'\n"
           "E   ModuleNotFoundError: No module named 'helpers'\n"
           "E   ModuleNotFoundError: No module named 'dateutil.parser'\n"
           "E   ModuleNotFoundError: No module named 'some_pkg'\n")
    assert missing_modules(out, layout) == ["PyYAML", "python-dateutil", "some-pkg"]
    rep = TestReport({"tests/test_x.py": "ERROR", "tests/test_y.py::test_a": "ERROR"})
    assert uncollectable(rep) == ["tests/test_x.py"]


def test_collection_errors_name_the_missing_module(tmp_path: Path) -> None:
    import sys
    root = _write(tmp_path, {"lib7/__init__.py": "", "tests/test_ok.py": "def test_ok():\n    pass\n",
                             "tests/test_needs.py": "import not_installed_mod_q\n"})
    layout = inspect_project(root)
    env = Path(sys.prefix)  # this venv has pytest
    rep = verify(layout, env, "local", 120)
    assert uncollectable(rep) == ["tests/test_needs.py"] and not rep.passed()  # one bad file stops the run
    why = collection_errors(layout, env, "local", uncollectable(rep))
    assert missing_modules(rep.output_tail + why, layout) == ["not-installed-mod-q"]


AGENT_REPO = {
    "oddlib/__init__.py": "from oddlib_helper_xyz import VALUE\n\ndef answer():\n    return VALUE * 2\n",
    "tests/test_odd.py": "from oddlib import answer\n\ndef test_answer():\n    assert answer() == 6\n",
}
WRITE_HELPER = ("python -c \"import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()['purelib'], "
                "'oddlib_helper_xyz.py').write_text('VALUE = 3\\n')\"")


@pytest.mark.slow  # builds three small venvs (pip install pytest): ~1 minute
def test_agent_installs_what_no_recipe_names(tmp_path: Path) -> None:
    root = _write(tmp_path / "repo", AGENT_REPO)
    layout = inspect_project(root)
    # an agent that gives up: the repository is reported with the reason
    quitter = ScriptedPolicy([[tool_call("submit", message="cannot")]])
    with pytest.raises(InstallError) as e:
        install_repo(layout, "oddlib", tmp_path / "envs" / "oddlib-0.1", policy=quitter, repair_rounds=0)
    assert "its tests cannot run here" in str(e.value) and f"wrote no {VERIFY_FILE}" in str(e.value)
    assert not (tmp_path / "envs" / "oddlib-0.1").exists()
    # an agent that installs the missing module and writes the verification command
    policy = ScriptedPolicy([
        [tool_call("run", command="ls tests && python -m pytest -q tests 2>&1 | tail -3")],
        [tool_call("run", command=WRITE_HELPER)],
        [tool_call("write_file", path=VERIFY_FILE, content="python -m pytest -q tests\n")],
        [tool_call("run", command="sh " + VERIFY_FILE)],
        [tool_call("submit", message="tests pass")],
    ])
    dest = tmp_path / "envs" / "oddlib-0.1"
    res = install_repo(layout, "oddlib", dest, policy=policy, repair_rounds=0)
    assert res.method == "agent" and res.report.passed() == {"tests/test_odd.py::test_answer"}
    manifest = json.loads((dest / "env.json").read_text())
    assert manifest["method"] == "agent" and manifest["verify_command"] == "python -m pytest -q tests"
    assert any("oddlib_helper_xyz" in c for c in manifest["agent_commands"])
    site = next(dest.glob("lib/python3*/site-packages"))
    assert (site / "oddlib_helper_xyz.py").exists() and not (site / "pip").exists()
    assert not (site / "oddlib").exists()
    # one cached environment per repository: the next call reuses it
    again = install_repo(layout, "oddlib", dest, policy=None)
    assert again.method == "cached" and again.report.passed()
