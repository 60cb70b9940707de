"""The task directory format: what the agent sees kept apart from what it must never see.

A task is a directory laid out after Harbor's task layout, with two additions
(``workspace/`` and ``tests/files/``)::

    TASK/
      task.toml          metadata (this module's ``TaskMeta``): ids, source, feature, env, tests
      instruction.md     the terse instruction: the only text the agent is given
      workspace/         the repository as the agent finds it: the base image of its sandbox
      tests/
        files/           hidden test files, copied over the workspace only after submit
        test.sh          runs the selected tests (Harbor convention; for humans and Harbor)
      solution/
        gold.patch       unified diff (paths relative to workspace/) that restores the feature
        solve.sh         applies gold.patch (Harbor convention)

Only ``workspace/`` and ``instruction.md`` ever reach the agent. ``environment.env``
points (relative to the task dir) at the per-source Python environment, shared
read-only by all tasks of a source.

Load with ``Task.load(path)``: a missing or garbled task.toml raises ``TaskFormatError``
naming the file, the key and what was expected.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tomli_w
from pydantic import Field

from opencomposer.config import ConfigError, Strict, validate
from opencomposer.paths import atomic_write_text
from opencomposer.protocols import SandboxSpec

TASK_FORMAT_VERSION = 1


class TaskFormatError(ValueError):
    """A task directory that cannot be used; the message names the file and the problem."""


class SourceInfo(Strict):
    kind: Literal["pypi", "local", "git", "swebench", "harbor", "humaneval"] = "pypi"
    spec: str = Field(..., description="e.g. 'more-itertools==10.5.0'")
    package: str = ""  # top-level import name of the library, if known


class FeatureInfo(Strict):
    level: str = Field(..., description="body | function | ...")
    file: str = Field(..., description="workspace-relative path of the edited file")
    symbol: str = Field(..., description="qualified name of the deleted feature")
    lines_removed: int = Field(0, ge=0)


class EnvironmentInfo(Strict):
    env: str = Field("", description="path of the Python environment, relative to the task dir")
    pythonpath: list[str] = Field(default_factory=list, description="workspace-relative entries")
    network: bool = False


class TestsInfo(Strict):
    __test__ = False  # not a pytest class
    command: str = Field(..., description="test runner command; the targets are appended")
    files: list[str] = Field(..., min_length=1, description="workspace-relative test files the targets live in")
    targets: list[str] = Field(..., min_length=1, description="runner arguments: test node ids or files")
    fail_to_pass: list[str] = Field(..., min_length=1)
    pass_to_pass: list[str] = Field(default_factory=list)
    timeout: float = Field(300.0, gt=0)


class TaskMeta(Strict):
    format_version: int = Field(TASK_FORMAT_VERSION, ge=1, le=TASK_FORMAT_VERSION)
    id: str = Field(..., min_length=1)
    source: SourceInfo
    feature: FeatureInfo
    environment: EnvironmentInfo = EnvironmentInfo()
    tests: TestsInfo


@dataclass
class Task:
    """A loaded task directory."""

    root: Path
    meta: TaskMeta
    instruction: str

    @property
    def id(self) -> str:
        return self.meta.id

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def hidden_tests(self) -> Path:
        return self.root / "tests" / "files"

    @property
    def gold_patch(self) -> str:
        # bytes, not read_text(): universal newlines would turn a CRLF file's lines into LF
        # ones, and the patch would no longer apply to it
        return (self.root / "solution" / "gold.patch").read_bytes().decode("utf-8")

    @property
    def env_dir(self) -> Path | None:
        e = self.meta.environment.env
        return (self.root / e).resolve() if e else None

    def sandbox_spec(self) -> SandboxSpec:
        return SandboxSpec(
            base_dir=self.workspace,
            env_dir=self.env_dir,
            pythonpath=list(self.meta.environment.pythonpath),
            network=self.meta.environment.network,
        )

    @classmethod
    def load(cls, root: str | Path) -> "Task":
        root = Path(root)
        toml_path = root / "task.toml"
        if not root.is_dir():
            raise TaskFormatError(f"{root}: not a task directory (it does not exist or is a file)")
        if not toml_path.is_file():
            raise TaskFormatError(f"{toml_path}: missing; every task directory needs a task.toml")
        try:
            data = tomllib.loads(toml_path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise TaskFormatError(f"{toml_path}: garbled, not valid TOML: {e}") from None
        try:
            meta = validate(data, TaskMeta, str(toml_path))
        except ConfigError as e:
            raise TaskFormatError(str(e)) from None
        for need in ("instruction.md", "workspace", "solution/gold.patch"):
            if not (root / need).exists():
                raise TaskFormatError(f"{root / need}: missing; a task needs {need}")
        instruction = (root / "instruction.md").read_text().strip()
        if not instruction:
            raise TaskFormatError(f"{root / 'instruction.md'}: empty; the agent needs an instruction")
        env = meta.environment.env
        if env and not (root / env).is_dir():
            raise TaskFormatError(
                f"{toml_path}: key 'environment.env': directory {(root / env)} does not exist"
            )
        return cls(root=root, meta=meta, instruction=instruction)


def write_task_toml(path: Path, meta: TaskMeta) -> None:
    """Write task.toml atomically (temp file + rename)."""
    atomic_write_text(path, tomli_w.dumps(meta.model_dump(mode="json")))


def find_tasks(paths: list[Path]) -> list[Path]:
    """Expand each path: a task dir stays; a dir of task dirs gives its children with task.toml."""
    out: list[Path] = []
    for p in paths:
        if (p / "task.toml").exists() or not p.is_dir():
            out.append(p)
        else:
            kids = sorted(c for c in p.iterdir() if (c / "task.toml").exists())
            out.extend(kids if kids else [p])
    return out
