"""Auto-install: find how a repository installs and runs its tests, build its environment,
and keep it only if the suite then runs.

    res = install_repo(layout, "toolz", out / "_envs" / "toolz-1.2.0", backend="local")
    res.env, res.method, res.report.passed()

Three rungs, each verified by running the test suite (at least one test must pass):

1. ``recipe``: requirements read from every place projects keep them (``discover``):
   PKG-INFO/pyproject (runtime deps, test extras, dependency groups), setup.cfg
   (``install_requires``, test extras), setup.py (the same keywords, read with ``ast``, never
   executed), ``requirements*.txt`` and ``requirements/*.txt`` for tests/dev, tox.ini
   ``[testenv] deps``, noxfile ``session.install(...)`` and ``.github/workflows/*.yml``
   ``pip install`` lines.
2. ``repair``: test files that fail to import are left out when others run; when none runs,
   modules the run (or a ``--collect-only`` of the failing files) reports missing (``No module
   named 'yaml'``) are mapped to distributions and added, up to ``repair_rounds`` times.
3. ``agent``: if a ``Policy`` is given, an agent in the ordinary harness (``harness.loop.Agent``)
   explores the repository in a ``local`` sandbox with network, runs install commands into a
   working environment that keeps pip, and writes the command that runs the suite to
   ``.opencomposer/verify.sh``. Its environment (pip stripped) is kept only if that command,
   rerun by us in a fresh sandbox, exits 0 and our own pytest run of the suite passes tests.

The environment is one per repository release (``envs.build_env``), shared read-only by all
its tasks; ``env.json`` records the method, what was discovered and the verification result.
Failure raises ``InstallError`` with the reason; the factory records it and goes on.

Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_install.py``.
"""

from __future__ import annotations

import ast
import configparser
import json
import re
import shlex
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from opencomposer import pyparse
from opencomposer.protocols import Policy, SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks.envs import TOOLS, EnvError, build_env, strip_tools
from opencomposer.tasks.layout import TEST_EXTRAS, ProjectLayout
from opencomposer.tasks.pypi import SourceError
from opencomposer.tasks.testrun import TestReport, run_tests

# import name -> distribution name, where they differ (the rest install under their own name)
MODULE_TO_DIST = {
    "yaml": "PyYAML", "dateutil": "python-dateutil", "PIL": "Pillow", "bs4": "beautifulsoup4",
    "attr": "attrs", "sklearn": "scikit-learn", "cv2": "opencv-python", "Crypto": "pycryptodome",
    "jwt": "PyJWT", "magic": "python-magic", "serial": "pyserial", "OpenSSL": "pyOpenSSL",
    "google.protobuf": "protobuf", "pkg_resources": "setuptools", "_pytest": "pytest",
    "typing_extensions": "typing-extensions", "freezegun": "freezegun", "toml": "toml",
}
DEV_FILES = ("requirements-dev.txt", "requirements_dev.txt", "dev-requirements.txt",
             "test-requirements.txt", "requirements-test.txt", "requirements_test.txt",
             "requirements-tests.txt", "requirements-testing.txt", "tests/requirements.txt")
_MISSING = re.compile(r"No module named '([A-Za-z0-9_.]+)'")
_PIP_LINE = re.compile(r"pip3?\s+install\s+(.+)")
VERIFY_FILE = ".opencomposer/verify.sh"


class InstallError(EnvError, SourceError):
    """A repository that could not be installed so that its tests run; says why. Both an
    EnvError and a SourceError: callers that refuse unusable sources catch either."""


@dataclass
class InstallPlan:
    requirements: list[str]
    found_in: dict[str, int] = field(default_factory=dict)  # file -> requirements read from it


@dataclass
class InstallResult:
    env: Path
    method: str  # recipe | repair | agent | cached
    report: TestReport
    plan: InstallPlan
    attempts: list[str] = field(default_factory=list)  # one line per rung tried
    test_files: list[str] = field(default_factory=list)  # the suite that runs (some may be left out)


def discover(root: Path, layout: ProjectLayout) -> InstallPlan:
    """Every requirement the repository declares for running its tests, deduplicated by name."""
    root = Path(root)
    # pip/setuptools/wheel named by CI scripts are installer upgrades, not test needs (and
    # they vendor libraries that could leak a deleted feature): only the layout may ask
    found: dict[str, list[str]] = {"layout": list(layout.requirements)}
    found["setup.cfg"] = _from_setup_cfg(root / "setup.cfg")
    found["setup.py"] = _from_setup_py(root / "setup.py")
    for name in DEV_FILES:
        found[name] = _from_requirements_file(root / name)
    for f in sorted((root / "requirements").glob("*.txt")) if (root / "requirements").is_dir() else []:
        if any(k in f.name for k in ("test", "dev")):
            found[f"requirements/{f.name}"] = _from_requirements_file(f)
    found["tox.ini"] = _from_tox(root / "tox.ini")
    found["noxfile.py"] = _from_noxfile(root / "noxfile.py")
    for wf in sorted((root / ".github" / "workflows").glob("*.y*ml")) if (root / ".github").is_dir() else []:
        found[wf.relative_to(root).as_posix()] = _from_workflow(wf)
    reqs, names = [], set()
    for reqlist in found.values():
        for raw in reqlist:
            r = _requirement(raw)
            if r is not None and canonicalize_name(r.name) not in names and (
                    reqlist is found["layout"] or canonicalize_name(r.name) not in TOOLS):
                names.add(canonicalize_name(r.name))
                reqs.append(str(r))
    return InstallPlan(reqs, {k: len(v) for k, v in found.items() if v})


def install_repo(layout: ProjectLayout, dist_name: str, dest: Path, backend: str = "local",
                 timeout: float = 300.0, policy: Policy | None = None, repair_rounds: int = 2,
                 agent_turns: int = 30) -> InstallResult:
    """Build (or reuse) the verified environment at ``dest``; InstallError if none passes."""
    plan = discover(layout.root, layout)
    if (dest / "env.json").exists():
        kept = json.loads((dest / "env.json").read_text()).get("test_files") or layout.test_files
        layout = replace(layout, test_files=[f for f in layout.test_files if f in kept])
        report = verify(layout, dest, backend, timeout)
        if report.passed():
            return InstallResult(dest, "cached", report, plan, [], layout.test_files)
        shutil.rmtree(dest)  # a stale env that no longer runs the suite: rebuild
    attempts: list[str] = []
    reqs = list(plan.requirements)
    own = canonicalize_name(dist_name)
    for rung in range(repair_rounds + 1):
        method = "recipe" if rung == 0 else "repair"
        try:
            build_env(replace(layout, requirements=reqs), dist_name, dest)
        except EnvError as e:
            attempts.append(f"{method}: {str(e).splitlines()[0][:300]}")
            if rung == 0 and reqs != layout.requirements:
                # something only tox/CI/dev files named would not install: packaging metadata only
                reqs = list(layout.requirements)
                try:
                    build_env(replace(layout, requirements=reqs), dist_name, dest)
                except EnvError as e2:
                    attempts.append(f"{method} (metadata only): {str(e2).splitlines()[0][:300]}")
                    break
            else:
                break
        report = verify(layout, dest, backend, timeout)
        broken = uncollectable(report)
        missing: list[str] = []
        if not report.passed():
            known = {canonicalize_name(r.name) for r in map(_requirement, reqs) if r is not None}
            why = report.output_tail + collection_errors(layout, dest, backend, broken)
            missing = [m for m in missing_modules(why, layout)
                       if canonicalize_name(m) != own and canonicalize_name(m) not in known]
        last = rung == repair_rounds or not missing
        if not report.passed() and broken and len(broken) < len(layout.test_files) and (
                last or 2 * len(broken) <= len(layout.test_files)):
            # a few test modules whose optional dependency is missing interrupt the whole run:
            # leave them out and keep the rest (most modules failing: repair first)
            attempts.append(f"{method}: left out test files that fail to import: {broken}")
            layout = replace(layout, test_files=[f for f in layout.test_files if f not in broken])
            report = verify(layout, dest, backend, timeout)
        if report.passed():
            _record(dest, method, plan, report, attempts, layout.test_files)
            return InstallResult(dest, method, report, plan, attempts, layout.test_files)
        attempts.append(f"{method}: 0 of {len(report.outcomes)} tests passed; missing modules: {missing}")
        shutil.rmtree(dest, ignore_errors=True)
        if not missing:
            break
        reqs += missing
    if policy is not None:
        res = install_with_agent(layout, dist_name, dest, policy, plan, timeout, agent_turns)
        res.attempts = attempts + res.attempts
        if res.report.passed():
            res.test_files = layout.test_files
            _record(dest, "agent", plan, res.report, res.attempts, layout.test_files)
            return res
        attempts = res.attempts
    shutil.rmtree(dest, ignore_errors=True)
    raise InstallError(f"{layout.root.name}: its tests cannot run here: no environment runs them: "
                       + " | ".join(attempts))


def verify(layout: ProjectLayout, env: Path, backend: str, timeout: float,
           command: str | None = None) -> TestReport:
    """Run the suite in a fresh sandbox; the report's output keeps the errors. ``command`` (the
    installing agent's own, any shell command): only its exit status and output are read."""
    with make_sandbox(SandboxSpec(layout.root, env, layout.pythonpath), backend) as sb:
        if command is None:
            return run_tests(sb, layout.test_files, timeout=timeout)
        r = sb.exec(["sh", "-c", command], timeout=timeout, max_output=4_000_000)
        return TestReport(exit_code=r.exit_code, timed_out=r.timed_out, output_tail=r.output[-4000:], seconds=r.seconds)


def collection_errors(layout: ProjectLayout, env: Path, backend: str, files: list[str]) -> str:
    """Why ``files`` fail to import: pytest's collection traceback (our runs use --tb=no)."""
    if not files:
        return ""
    cmd = "python -m pytest --collect-only -q -p no:cacheprovider -o addopts= " + " ".join(
        shlex.quote(f) for f in files)
    with make_sandbox(SandboxSpec(layout.root, env, layout.pythonpath), backend) as sb:
        return sb.exec(["sh", "-c", cmd], timeout=120, max_output=200_000).output


def uncollectable(report: TestReport) -> list[str]:
    """Test files that errored as a whole (import failure at collection)."""
    return sorted(n for n, o in report.outcomes.items() if o == "ERROR" and "::" not in n)


def missing_modules(output: str, layout: ProjectLayout) -> list[str]:
    """Distributions to add for the modules a test run could not import (not the repo's own)."""
    local = set(layout.packages) | {Path(t).stem for t in layout.test_files}
    out = []
    for mod in _MISSING.findall(output):
        top = mod.split(".")[0]
        if top in local or (layout.root / top).exists() or (layout.root / "tests" / f"{top}.py").exists():
            continue
        dist = MODULE_TO_DIST.get(mod) or MODULE_TO_DIST.get(top) or top.replace("_", "-")
        if dist not in out:
            out.append(dist)
    return out


AGENT_INSTRUCTION = """Make this repository's test suite runnable. The Python environment on PATH \
(`python`) is empty apart from pip and pytest; install into it whatever the tests need with \
`python -m pip install ...` (never install this repository itself, not even with `-e .`). \
Then write the shell command that runs the tests (for example `python -m pytest tests`) to \
`{verify}` and run it to check that tests pass. Submit when done."""


def install_with_agent(layout: ProjectLayout, dist_name: str, dest: Path, policy: Policy,
                       plan: InstallPlan, timeout: float, max_turns: int) -> InstallResult:
    """The agent rung: a harness episode in a local sandbox with network, then our own check."""
    from opencomposer.config import AgentConfig
    from opencomposer.harness.loop import Agent

    work = dest.with_name(dest.name + ".agent")
    shutil.rmtree(work, ignore_errors=True)
    build_env(replace(layout, requirements=["pytest"]), dist_name, work, keep_tools=True)
    spec = SandboxSpec(layout.root, work, layout.pythonpath, network=True)
    attempts: list[str] = []
    with make_sandbox(spec, "local") as sb:  # pip needs the network and a writable env
        cfg = AgentConfig(max_turns=max_turns, max_seconds=max(timeout * 2, 600.0), command_timeout=timeout)
        traj = Agent(sb, policy, cfg).run(AGENT_INSTRUCTION.format(verify=VERIFY_FILE), f"install-{dist_name}")
        try:
            command = sb.read_file(VERIFY_FILE).decode().strip()
        except (OSError, ValueError):
            command = ""
    commands = [e.arguments.get("command", "") for s in traj.steps for e in s.tool_events if e.name == "run"]
    if not command:
        attempts.append(f"agent: {traj.exit_reason}; wrote no {VERIFY_FILE}")
        shutil.rmtree(work, ignore_errors=True)
        return InstallResult(dest, "agent", TestReport(), plan, attempts)
    stripped = strip_tools(work, [])
    for pkg in layout.packages:  # the agent must not have installed the library itself
        if (next(work.glob("lib/python3*/site-packages"), work) / pkg).exists():
            attempts.append(f"agent: the library's package {pkg!r} ended up in the environment")
            shutil.rmtree(work, ignore_errors=True)
            return InstallResult(dest, "agent", TestReport(), plan, attempts)
    shutil.rmtree(dest, ignore_errors=True)
    work.rename(dest)  # venv scripts point at `work`; we only ever run `python -m ...`
    theirs = verify(layout, dest, "local", timeout, command)
    # tasks are graded with our own pytest command, so that must pass too
    report = verify(layout, dest, "local", timeout) if theirs.exit_code == 0 else TestReport(exit_code=theirs.exit_code)
    attempts.append(f"agent: {traj.exit_reason} after {traj.turns} turns; `{command}` exit {theirs.exit_code}; "
                    f"suite: {len(report.passed())} of {len(report.outcomes)} passed")
    manifest = json.loads((dest / "env.json").read_text())
    manifest.update({"agent_commands": commands, "verify_command": command, "stripped": stripped})
    (dest / "env.json").write_text(json.dumps(manifest, indent=1))
    return InstallResult(dest, "agent", report, plan, attempts)


# --- discovery helpers ---------------------------------------------------------------------


def _requirement(raw: str) -> Requirement | None:
    try:
        r = Requirement(raw.strip())
    except InvalidRequirement:
        return None
    if r.url or (r.marker is not None and not any(
            r.marker.evaluate({"extra": e}) for e in ("", *TEST_EXTRAS))):
        return None
    r.marker = None
    return r


def _record(dest: Path, method: str, plan: InstallPlan, report: TestReport, attempts: list[str],
            test_files: list[str]) -> None:
    manifest = json.loads((dest / "env.json").read_text())
    manifest.update({"method": method, "found_in": plan.found_in, "attempts": attempts,
                     "test_files": test_files,
                     "verified": {"passed": len(report.passed()), "collected": len(report.outcomes)}})
    (dest / "env.json").write_text(json.dumps(manifest, indent=1))


def _lines(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith(("-", "{", ".", "/")) and "://" not in line:
            out.append(line)
    return out


def _from_requirements_file(path: Path) -> list[str]:
    return _lines(path.read_text(errors="replace")) if path.is_file() else []


def _from_setup_cfg(path: Path) -> list[str]:
    if not path.is_file():
        return []
    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read_string(path.read_text(errors="replace"))
    except configparser.Error:
        return []
    out = _lines(cp.get("options", "install_requires", fallback=""))
    out += _lines(cp.get("options", "tests_require", fallback=""))
    for extra in TEST_EXTRAS:
        out += _lines(cp.get("options.extras_require", extra, fallback=""))
    return out


def _from_setup_py(path: Path) -> list[str]:
    """install_requires / tests_require / extras_require[test] given as literals to setup()."""
    if not path.is_file():
        return []
    try:
        tree = pyparse.parse(path.read_text(errors="replace"))
    except SyntaxError:
        return []
    out: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            try:
                value = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            if kw.arg in ("install_requires", "tests_require") and isinstance(value, (list, tuple)):
                out += [v for v in value if isinstance(v, str)]
            elif kw.arg == "extras_require" and isinstance(value, dict):
                for extra in TEST_EXTRAS:
                    out += [v for v in value.get(extra, []) if isinstance(v, str)]
    return out


def _from_tox(path: Path) -> list[str]:
    if not path.is_file():
        return []
    cp = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        cp.read_string(path.read_text(errors="replace"))
    except configparser.Error:
        return []
    deps = cp.get("testenv", "deps", fallback="")
    return [d for d in _lines(deps) if ":" not in d.split(" ")[0]]  # "py38: foo" factors skipped


def _from_noxfile(path: Path) -> list[str]:
    if not path.is_file():
        return []
    try:
        tree = pyparse.parse(path.read_text(errors="replace"))
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "install":
            out += [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                    and not a.value.startswith(("-", "."))]
    return out


def _from_workflow(path: Path) -> list[str]:
    out = []
    for m in _PIP_LINE.finditer(path.read_text(errors="replace")):
        for tok in m.group(1).split():
            tok = tok.strip("'\"")
            if tok.startswith(("-", ".", "/", "$", "{")) or "=" in tok and "==" not in tok or "[" in tok and tok.startswith("."):
                continue
            out.append(tok)
    return out
