"""Read a Python project's layout: its packages, its tests and what its tests need.

``inspect_project(root)`` finds the import packages (flat or ``src/`` layout), the
test files, the ``PYTHONPATH`` entries that make the package importable from the
source tree, and the requirements to install for running the tests (runtime deps from
PKG-INFO/pyproject plus test extras and dependency groups, and pytest).

Test: ``pytest tests/unit/tasks/test_layout.py``.
"""

from __future__ import annotations

import email.parser
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

TEST_EXTRAS = ("test", "tests", "testing")
SKIP_DIRS = {".git", ".tox", ".nox", "build", "dist", "docs", "doc", "examples", "benchmarks", "node_modules"}


@dataclass
class ProjectLayout:
    root: Path
    packages: list[str]  # import names, e.g. ["more_itertools"]
    package_dirs: list[str]  # root-relative dirs of those packages or single modules
    pythonpath: list[str]  # root-relative entries, e.g. ["src"] or ["."]
    test_files: list[str]  # root-relative posix paths
    requirements: list[str] = field(default_factory=list)


def is_test_file(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    if not name.endswith(".py"):
        return False
    return name.startswith("test_") or name.endswith("_test.py")


def _walk_py(root: Path):
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        yield rel.as_posix()


def _find_packages(root: Path) -> tuple[list[str], list[str], list[str]]:
    base = root / "src" if (root / "src").is_dir() else root
    prefix = "src/" if base != root else ""
    pkgs, dirs = [], []
    for child in sorted(base.iterdir()):
        if child.name.startswith((".", "_")) or child.name in SKIP_DIRS | {"tests", "test", "testing"}:
            continue
        if child.is_dir() and (child / "__init__.py").exists():
            pkgs.append(child.name)
            dirs.append(prefix + child.name)
        elif child.suffix == ".py" and not is_test_file(child.name) and child.name not in (
            "setup.py", "conftest.py", "noxfile.py", "tasks.py", "fabfile.py"
        ):
            pkgs.append(child.stem)
            dirs.append(prefix + child.name)
    return pkgs, dirs, ["src"] if prefix else ["."]


def _runtime_and_extra_reqs(root: Path) -> list[str]:
    reqs: list[str] = []
    pkg_info = root / "PKG-INFO"
    if pkg_info.exists():
        msg = email.parser.Parser().parsestr(pkg_info.read_text(errors="replace"))
        reqs += msg.get_all("Requires-Dist") or []
    pyproject = root / "pyproject.toml"
    if pyproject.exists():
        try:
            data = tomllib.loads(pyproject.read_text())
        except tomllib.TOMLDecodeError:
            data = {}
        proj = data.get("project", {})
        if not reqs:
            reqs += proj.get("dependencies", [])
            for extra in TEST_EXTRAS:
                reqs += [f"{r}; extra == '{extra}'" if ";" not in r else r
                         for r in proj.get("optional-dependencies", {}).get(extra, [])]
        groups = data.get("dependency-groups", {})
        for g in (*TEST_EXTRAS, "dev"):
            reqs += [r for r in groups.get(g, []) if isinstance(r, str)]
    for f in sorted(root.glob("requirements*test*.txt")) + sorted((root / "requirements").glob("*test*.txt")):
        for line in f.read_text(errors="replace").splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                reqs.append(line)
    return reqs


def _select(reqs: list[str]) -> list[str]:
    """Keep requirements whose markers hold for this Python with a test extra enabled."""
    out: list[str] = []
    for raw in reqs:
        try:
            r = Requirement(raw)
        except InvalidRequirement:
            continue
        if r.marker is not None:
            envs = [{"extra": e} for e in ("", *TEST_EXTRAS)]
            if not any(r.marker.evaluate(env) for env in envs):
                continue
        r.marker = None
        s = str(r)
        if s not in out:
            out.append(s)
    return out


def inspect_project(root: Path) -> ProjectLayout:
    pkgs, dirs, pythonpath = _find_packages(root)
    tests = [p for p in _walk_py(root) if is_test_file(p)]
    reqs = _select(_runtime_and_extra_reqs(root))
    if not any(re.match(r"^pytest\b", r) for r in reqs):
        reqs.append("pytest")
    return ProjectLayout(root, pkgs, dirs, pythonpath, tests, reqs)
