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
read-only by all tasks of a source; it lives in the *environments root* ``_envs/`` beside
the task dirs (``envs_root``), where an operator may also link an env made elsewhere
(``tasks/envs.py: adopt_env``).

Load with ``Task.load(path)``: a missing or garbled task.toml raises ``TaskFormatError``
naming the file, the key and what was expected. Every path the task names stays inside
the task (``check_paths``): ``workspace/``, ``tests/``, ``solution/`` and ``instruction.md``
resolve inside the task dir, symlinks followed; workspace-relative keys (``feature.file``,
``tests.files``, the targets, ``environment.pythonpath``) inside ``workspace/`` and
``tests/files/``; ``environment.env`` inside the task dir or the environments root. Anything
else is refused with the key, the path and what was expected.

A directory of tasks is listed by ``task_dirs`` alone: names starting with ``.`` (the
staging dirs tasks are built in, ``paths.staged_dir``) or ``_`` (``_envs``, ``_journal``)
are never tasks.

Test: ``pytest tests/unit/tasks/test_task_format.py tests/unit/tasks/sources/test_confine.py``.
"""

from __future__ import annotations

import os
import re
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
ENVS = "_envs"  # the environments root, beside the task dirs
NOT_TASKS = (".", "_")  # name prefixes of entries that are never task dirs (staging, _envs, _journal)


class TaskFormatError(ValueError):
    """A task directory that cannot be used; the message names the file and the problem."""


class SourceInfo(Strict):
    kind: Literal["pypi", "local", "git", "swebench", "harbor", "humaneval"] = "pypi"
    spec: str = Field(..., description="e.g. 'more-itertools==10.5.0'")
    package: str = ""  # top-level import name of the library, if known

    @property
    def name(self) -> str:
        """The library the spec names, without version or path: 'more-itertools==10.5.0' ->
        'more-itertools', 'owner/repo@sha' -> 'repo'."""
        return re.split(r"[=<>!~@\s\[;]", self.spec.strip(), maxsplit=1)[0].rstrip("/").rsplit("/", 1)[-1]


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
        check_task_id(meta.id, str(toml_path))
        check_paths(root, meta, toml_path)
        env = meta.environment.env
        if env and not (root / env).is_dir():
            raise TaskFormatError(
                f"{toml_path}: key 'environment.env': directory {(root / env)} does not exist"
            )
        return cls(root=root, meta=meta, instruction=instruction)


def write_task_toml(path: Path, meta: TaskMeta) -> None:
    """Write task.toml atomically (temp file + rename)."""
    atomic_write_text(path, tomli_w.dumps(meta.model_dump(mode="json")))


def task_dirs(root: Path) -> list[Path]:
    """The task dirs directly under ``root``, sorted: children with a task.toml, never a
    staging dir (``.*``) or ``_envs``/``_journal`` (``_*``). Every lister of tasks uses this."""
    if not Path(root).is_dir():
        return []
    return sorted(c for c in Path(root).iterdir()
                  if not c.name.startswith(NOT_TASKS) and (c / "task.toml").is_file())


def find_tasks(paths: list[Path]) -> list[Path]:
    """Expand each path: a task dir stays; a dir of task dirs gives its children with task.toml."""
    out: list[Path] = []
    for p in paths:
        if (p / "task.toml").exists() or not p.is_dir():
            out.append(p)
        else:
            kids = task_dirs(p)
            out.extend(kids if kids else [p])
    return out


# --------------------------------------------------------------------------- path confinement


def envs_root(task_root: Path) -> Path:
    """The environments root of the task at ``task_root``: ``_envs/`` beside it."""
    return Path(os.path.abspath(task_root)).parent / ENVS


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_task_id(tid: str, where: str) -> None:
    """A task id is also its directory's name: one path part that no lister skips."""
    if not tid or tid in (".", "..") or "/" in tid or "\\" in tid or "\0" in tid or tid.startswith(NOT_TASKS):
        raise TaskFormatError(f"{where}: key 'id': {tid!r} cannot name a task directory; expected one "
                              "path part not starting with '.' or '_' (those are staging dirs and _envs)")


def check_paths(root: Path, meta: TaskMeta, toml_path: Path | str) -> None:
    """Refuse a task whose parts or path keys lead outside it (module docstring), naming
    ``toml_path``, the key, the path and what was expected."""
    root_abs = os.path.abspath(root)
    real_root = os.path.realpath(root)
    ws, hidden = os.path.join(real_root, "workspace"), os.path.join(real_root, "tests", "files")

    def refuse(key: str, value: str, why: str) -> TaskFormatError:
        return TaskFormatError(f"{toml_path}: key {key!r}: path {value!r} {why}")

    for part in ("task.toml", "instruction.md", "workspace", "tests", "tests/files", "solution",
                 "solution/gold.patch"):
        real = os.path.realpath(os.path.join(root_abs, part))
        if os.path.lexists(os.path.join(root_abs, part)) and not _inside(real, real_root):
            raise TaskFormatError(f"{toml_path}: {part} follows a symlink to {real}, outside the task "
                                  f"directory {real_root}; expected the task's own {part}")
    for part in ("tests", "solution"):  # small trees, all hidden material: no link out of them either
        for dirpath, dirnames, filenames in os.walk(os.path.join(root_abs, part)):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                if os.path.islink(p) and not _inside(os.path.realpath(p), real_root):
                    rel = os.path.relpath(p, root_abs)
                    raise TaskFormatError(f"{toml_path}: {rel} follows a symlink to {os.path.realpath(p)}, "
                                          f"outside the task directory {real_root}; expected the task's own file")

    seen: set[str] = set()  # node ids share a few files: each path is resolved once (a task lists up to thousands)

    def in_workspace(key: str, value: str, node_id: bool = False) -> None:
        rel = value.split("::", 1)[0] if node_id else value
        if not rel or rel in seen:
            return
        if "\0" in rel:
            raise refuse(key, value, "contains a NUL byte; expected a path relative to the workspace")
        if os.path.isabs(rel):
            raise refuse(key, value, "is absolute; expected a path relative to the workspace")
        for base in (ws, hidden):  # a test file lives in the workspace or among the hidden tests
            real = os.path.realpath(os.path.join(base, rel))
            if not _inside(real, base):
                raise refuse(key, value, f"resolves to {real}, outside {base}; expected a path inside "
                             "the task's workspace/ (or tests/files/ for test files)")
        seen.add(rel)

    in_workspace("feature.file", meta.feature.file)
    for i, v in enumerate(meta.environment.pythonpath):
        in_workspace(f"environment.pythonpath[{i}]", v)
    for key in ("files", "targets", "fail_to_pass", "pass_to_pass"):
        for i, v in enumerate(getattr(meta.tests, key)):
            in_workspace(f"tests.{key}[{i}]", v, node_id=key != "files")
    env = meta.environment.env
    if env:
        where = env_outside(root_abs, env)
        if where:
            raise refuse("environment.env", env, where)


def env_outside(task_root: str | Path, env: str) -> str:
    """Why ``env`` (as named by the task at ``task_root``) is not an allowed environment, or ''.

    Allowed: a relative path that resolves (symlinks followed) inside the task dir (but
    neither holding nor inside its hidden ``tests/`` and ``solution/``: the env is readable
    from the sandbox) or the environments root, or inside the target of an entry of the
    environments root that is a link: the operator's way to share an env made elsewhere
    (``envs.adopt_env``)."""
    task_root = os.path.abspath(task_root)
    envs = str(envs_root(Path(task_root)))
    expected = (f"expected a path relative to the task dir that stays inside it ({task_root}) away from "
                f"tests/ and solution/, or inside the environments root {envs} (link an env made "
                "elsewhere there: tasks.envs.adopt_env)")
    if "\0" in env:
        return f"contains a NUL byte; {expected}"
    if os.path.isabs(env):
        return f"is absolute; {expected}"
    real, real_task = os.path.realpath(os.path.join(task_root, env)), os.path.realpath(task_root)
    if _inside(real, real_task):
        hidden = [os.path.join(real_task, h) for h in ("tests", "solution")]
        if any(_inside(real, h) or _inside(h, real) for h in hidden):
            return f"resolves to {real}, which shows the task's hidden tests/ or solution/ to the sandbox; {expected}"
        return ""
    if _inside(real, os.path.realpath(envs)):
        return ""
    lexical = os.path.normpath(os.path.join(task_root, env))
    if lexical != envs and _inside(lexical, envs):
        entry = os.path.join(envs, os.path.relpath(lexical, envs).split(os.sep, 1)[0])
        if os.path.islink(entry) and _inside(real, os.path.realpath(entry)):
            return ""
    return f"resolves to {real}; {expected}"
