"""Hand-made feature-deletion tasks for the oracle, summarisation and pooled-episode tests.

    task = make_task(tmp_path, {"stats.py": STATS}, {"stats.py": STATS_DELETED}, patch, "mean")
    traj = solve(task, cfg)       # the oracle through the ordinary tools, in a local sandbox
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

from opencomposer.harness.loop import run_episode
from opencomposer.harness.patch import split_lines
from opencomposer.policies.oracle import OraclePolicy
from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks.format import Task, TaskMeta, write_task_toml

STATS = '''\
"""Small statistics helpers."""


def mean(xs):
    if not xs:
        raise ValueError("mean of an empty sequence")
    return sum(xs) / len(xs)


def span(xs):
    return max(xs) - min(xs)
'''
STATS_DELETED = STATS.replace(
    '    if not xs:\n        raise ValueError("mean of an empty sequence")\n    return sum(xs) / len(xs)\n',
    "    raise NotImplementedError\n",
)

SHAPES = "".join(f"# filler line {i}\n" for i in range(60)) + '''\
class Square:
    def area(self):
        return self.side ** 2

    def name(self):
        raise NotImplementedError


class Circle:
    def area(self):
        return 3.14159 * self.r ** 2

    def name(self):
        return "circle"
'''
SHAPES_DELETED = SHAPES.replace('        return "circle"\n', "        raise NotImplementedError\n")


def diff(path: str, old: str | None, new: str, context: int = 3) -> str:
    a = f"a/{path}" if old is not None else "/dev/null"
    return "".join(difflib.unified_diff(split_lines(old or ""), split_lines(new), a, f"b/{path}", n=context))


def make_task(root: Path, original: dict[str, str], deleted: dict[str, str], patch: str, symbol: str,
              file: str | None = None) -> Task:
    """A task dir: workspace holds ``deleted`` files, gold.patch turns them back into ``original``
    (``file``: the feature's file, where the symbol's dotted path does not name it, as for a method)."""
    for path, text in {**original, **deleted}.items():
        target = root / "workspace" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if path in deleted:
            target.write_text(deleted[path])
        elif path.endswith("__init__.py"):
            target.write_text(text)
    (root / "solution").mkdir()
    (root / "solution" / "gold.patch").write_text(patch)
    (root / "instruction.md").write_text(f"Implement `{symbol}`.\n")
    feature_file = file or symbol.rsplit(".", 1)[0].replace(".", "/") + ".py"
    meta = TaskMeta(
        id="hand-made-1",
        source={"kind": "local", "spec": "mathy", "package": "mathy"},
        feature={"level": "body", "file": feature_file, "symbol": symbol},
        tests={"command": "python -m pytest -q", "files": ["tests/test_stats.py"],
               "targets": ["tests/test_stats.py::test_mean"], "fail_to_pass": ["tests/test_stats.py::test_mean"]},
    )
    write_task_toml(root / "task.toml", meta)
    return Task.load(root)


def solve(task: Task, cfg):
    spec = SandboxSpec(base_dir=task.workspace, env_dir=Path(sys.prefix))
    sb = make_sandbox(spec, "local")
    policy = OraclePolicy(task)
    traj = run_episode(task.instruction, sb, policy, cfg, task_id=task.id)
    return sb, traj
