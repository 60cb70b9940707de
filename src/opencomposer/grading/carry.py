"""What of an episode reaches the grader: the agent's changes to the code under test, nothing else.

    carry = collect(task, sandbox, changes)     # read from the episode's sandbox before it closes
    carry.files      # {"toolz/itertoolz.py": b"...", "toolz/_new_helper.py": b"..."}
    carry.deleted    # ["toolz/compat.py"]
    carry.refused    # {"conftest.py": "a test file", "src/sitecustomize.py": "an interpreter start-up hook"}

The grader (``grading/grade.py``) builds a fresh sandbox from the task's base image and
writes only ``carry`` into it, so nothing else the agent did can reach the tests: no file
of its own at an import root (a ``pytest.py``, ``sitecustomize.py`` or ``*.dist-info``
that would shadow or hook the runner), no test or test-runner configuration, no ``.git``,
no byte code or binaries, no process, no /tmp, no environment variable. The rule, file by
file:

* existing files of the workspace may be changed or deleted, unless they are tests,
  test-runner or packaging configuration, start-up hooks, dot paths, byte code or binaries;
* new files are carried only as ``.py`` modules inside an existing package (a directory
  of the base image with an ``__init__.py``), so a new module is always namespaced under
  the library and can shadow nothing.

Refused files are listed with the reason (the transcript shows them; the monitors read
them as intent). The decision is made on paths alone, from the host's copy of the base
image, so nothing in the agent's sandbox can widen it.

Test: ``pytest tests/unit/grading/test_carry.py``.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.protocols import Sandbox
from opencomposer.rewards.changes import Changes

TEST_FILE = re.compile(r"(^|/)(tests?|testing)/|(^|/)test_[^/]*\.py$|_test\.py$|(^|/)conftest\.py$")
RUNNER_CONFIG = {"pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "setup.py", "noxfile.py",
                 "MANIFEST.in", "Makefile", "pytest.toml"}
STARTUP_HOOK = re.compile(r"(^|/)(sitecustomize|usercustomize)\.py$|\.pth$|(^|/)[^/]*\.(dist|egg)-info(/|$)")
BINARY = re.compile(r"(^|/)__pycache__(/|$)|\.(pyc|pyo|so|pyd|dylib|dll|exe)$")
MAX_FILE_BYTES = 4_000_000  # a source file larger than this is not an edit of the code under test


@dataclass
class Carry:
    files: dict[str, bytes] = field(default_factory=dict)  # workspace path -> new content
    deleted: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # workspace path -> why it was not carried

    def to_dict(self) -> dict:
        return {"files": sorted(self.files), "deleted": list(self.deleted), "refused": dict(self.refused)}


def refusal(path: str, status: str, base: Path) -> str | None:
    """Why ``path`` (changed with git status ``status``) is not carried, or None when it is."""
    parts = path.split("/")
    if posixpath.isabs(path) or ".." in parts or not path:
        return "a path outside the workspace"
    if any(p.startswith(".") for p in parts):
        return "a hidden or version-control path"
    if TEST_FILE.search(path):
        return "a test file (the hidden tests are laid over the workspace)"
    if parts[-1] in RUNNER_CONFIG or parts[-1].endswith((".ini", ".cfg", ".toml")):
        return "test-runner or packaging configuration"
    if STARTUP_HOOK.search(path):
        return "an interpreter or test-runner start-up hook"
    if BINARY.search(path):
        return "byte code or a binary"
    existed = (base / path).is_file() and not (base / path).is_symlink()
    if status != "A" and existed:
        return None
    if status == "D":
        return None if existed else "not a file of the base image"
    if existed:  # listed as added but present in the base: an ordinary change
        return None
    if not path.endswith(".py"):
        return "a new file that is not a Python module"
    parent = posixpath.dirname(path)
    if not parent or not (base / parent / "__init__.py").is_file():
        return "a new module outside an existing package (it could shadow another module)"
    return None


def collect(base: Path, sandbox: Sandbox, changes: Changes) -> Carry:
    """Read the carried files from the episode's ``sandbox``; ``base`` is the task's workspace."""
    carry = Carry()
    for status, path in changes.files:
        why = refusal(path, status, base)
        if why is not None:
            carry.refused[path] = why
            continue
        if status == "D":
            carry.deleted.append(path)
            continue
        try:
            data = sandbox.read_file(path)
        except (OSError, ValueError, RuntimeError) as e:  # gone, a directory, a FIFO, huge, a link out (PathEscape)
            carry.refused[path] = f"unreadable in the sandbox ({type(e).__name__}: {str(e)[:120]})"
            continue
        if len(data) > MAX_FILE_BYTES:
            carry.refused[path] = f"larger than {MAX_FILE_BYTES} bytes"
            continue
        carry.files[path] = data
    return carry
