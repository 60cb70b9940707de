"""Task formats end to end: HumanEval through the harness, SWE-bench and Harbor round
trips (export -> import gives the same task, which passes ``tasks check``), and bad
input reported per item while the run goes on.

Run: ``pytest tests/integration/test_task_formats.py`` (builds one real env with pytest
from PyPI; all 164 HumanEval problems: ``-m slow``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w
from conftest import NS_REASON, run_cli

from opencomposer.episode.oracle import run_oracle
from opencomposer.grading.check import check_task
from opencomposer.tasks.format import Task, find_tasks
from opencomposer.tasks.make import make_tasks
from opencomposer.tasks.sources.assemble import tree_files
from opencomposer.tasks.sources.humaneval import import_humaneval
from opencomposer.tasks.sources.swebench import import_swebench
from opencomposer.tasks.stats import task_stats

sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "tasks" / "sources"))
from source_fixtures import TEXTKIT, git, minicalc_repo, write  # noqa: F401  (small real git repos)

SOME = [32, 53]  # 32 calls a helper defined in its prompt


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, minicalc_repo) -> Path:  # noqa: F811
    """HumanEval tasks (with their real env, built here) + a task imported from a SWE-bench row."""
    out = tmp_path_factory.mktemp("tasks")
    assert import_humaneval(out, SOME).summary()["ok"] == len(SOME)
    repo, row = minicalc_repo
    rows = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    rep = import_swebench(rows, repo.parent, out, env=out / "_envs" / "humaneval")  # needs only pytest
    assert rep.ok == ["acme__minicalc-1"], rep.summary()
    # feature deletion on a local git repository at a commit (tasks make --source git:PATH@COMMIT)
    textkit = tmp_path_factory.mktemp("clones") / "textkit"
    textkit.mkdir()
    git(textkit, "init", "-q", "-b", "main")
    write(textkit, TEXTKIT)
    git(textkit, "add", "-A")
    git(textkit, "commit", "-q", "-m", "textkit")
    commit = git(textkit, "rev-parse", "HEAD").strip()
    write(textkit, {"textkit/__init__.py": "raise ImportError('a later commit broke it')\n"})
    git(textkit, "commit", "-qam", "later")
    made = make_tasks(f"git:{textkit}@{commit[:8]}", out, max_tasks=1, seed=0, workers=1)
    assert len(made.made) == 1, made
    task = Task.load(out / made.made[0])
    assert task.meta.source.kind == "git" and task.meta.source.spec == f"{textkit}@{commit[:12]}"
    return out


def same_task(a: Path, b: Path) -> None:
    """Everything but where the env lives is identical, down to the workspace commit id."""
    ta, tb = Task.load(a), Task.load(b)
    ma, mb = ta.meta.model_dump(), tb.meta.model_dump()
    assert ta.env_dir == tb.env_dir
    ma["environment"].pop("env"), mb["environment"].pop("env")
    assert ma == mb
    for sub in ("workspace", "tests", "solution"):
        assert tree_files(a / sub) == tree_files(b / sub), sub
    assert ta.instruction == tb.instruction
    head = lambda t: subprocess.run(["git", "-C", str(t.workspace), "rev-parse", "HEAD"],
                                    capture_output=True, text=True, check=False).stdout
    assert head(ta) == head(tb)


def share_envs(tasks: Path, out: Path) -> None:
    """``out``'s environments root is ``tasks``'s: an env an imported task names is used only
    when it lies in OUT/_envs (tasks/format.py: check_paths)."""
    out.mkdir()
    (out / "_envs").symlink_to(tasks / "_envs")


def test_imported_tasks_check_and_solve(tasks):
    backend = "local" if NS_REASON else "namespace"  # the round trips below check on local
    for p in find_tasks([tasks]):
        res = check_task(p, backend)
        assert res.ok, (p.name, res.problems)
    s = task_stats([tasks], oracle=backend, run_oracle=run_oracle)
    assert s["by_source"] == {"git": 1, "humaneval": len(SOME), "swebench": 1}
    assert s["oracle"]["solved"] == len(SOME) + 2, s["oracle"]


def test_swebench_round_trip(tasks, tmp_path):
    r = run_cli("tasks", "export", "swebench", str(tasks), "--out", str(tmp_path / "rows.jsonl"),
                "--repos-out", str(tmp_path / "clones"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["ok"] == len(SOME) + 2
    rows = [json.loads(l) for l in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert all(json.loads(row["FAIL_TO_PASS"]) for row in rows)  # encoded as the published datasets are
    # no --env: each row names the env its task was made with, found on this machine
    share_envs(tasks, tmp_path / "back")
    r = run_cli("tasks", "import", "swebench", str(tmp_path / "rows.jsonl"), "--repos", str(tmp_path / "clones"),
                "--out", str(tmp_path / "back"), "--check", "local")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["ok"] == len(SOME) + 2
    for p in find_tasks([tasks]):
        same_task(p, tmp_path / "back" / p.name)


def test_harbor_round_trip_and_bad_items(tasks, tmp_path):
    harbor = tmp_path / "harbor"
    r = run_cli("tasks", "export", "harbor", str(tasks), "--out", str(harbor))
    assert r.returncode == 0, r.stderr
    t32 = harbor / "HumanEval_32"
    assert {"instruction.md", "task.toml", "environment", "tests", "solution"} <= {p.name for p in t32.iterdir()}
    assert (t32 / "tests/test.sh").read_text().count("/logs/verifier/reward.txt") == 1
    # a task as someone else would write it: no gold.patch, no opencomposer metadata;
    # the importer runs solve.sh and measures FAIL_TO_PASS / PASS_TO_PASS itself
    foreign = harbor / "minicalc-foreign"
    subprocess.run(["cp", "-r", str(harbor / "acme__minicalc-1"), str(foreign)], check=True)
    (foreign / "solution/gold.patch").unlink()
    conf = tomllib.loads((foreign / "task.toml").read_text())
    del conf["metadata"]["opencomposer"]
    (foreign / "task.toml").write_text(tomli_w.dumps(conf))
    # two bad items: one needs Docker, one has a garbled task.toml
    docker = harbor / "needs-docker"
    subprocess.run(["cp", "-r", str(t32), str(docker)], check=True)
    (docker / "environment/Dockerfile").write_text("FROM ubuntu:24.04\nRUN apt-get install -y jq\n")
    garbled = harbor / "garbled"
    subprocess.run(["cp", "-r", str(t32), str(garbled)], check=True)
    (garbled / "task.toml").write_text("version = \n")

    # no --env: our tasks name theirs; the foreign one gets a real env from its Dockerfile's pins
    share_envs(tasks, tmp_path / "back")
    r = run_cli("tasks", "import", "harbor", str(harbor), "--out", str(tmp_path / "back"), "--check", "local")
    assert r.returncode == 1  # a failed item is an error, but every other item was imported
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert (s["ok"], s["skipped"], s["failed"]) == (len(SOME) + 3, 1, 1), s
    assert "needs-docker/environment/Dockerfile:1: `FROM ubuntu:24.04` needs a Docker build" in s["skipped_reasons"]["needs-docker"]
    assert "garbled/task.toml: garbled, not valid TOML" in s["failed_reasons"]["garbled"]
    for p in find_tasks([tasks]):
        same_task(p, tmp_path / "back" / p.name)
    got = Task.load(tmp_path / "back" / "minicalc-foreign")
    orig = Task.load(tasks / "acme__minicalc-1")
    assert got.meta.source.kind == "harbor" and got.env_dir.name == "harbor-minicalc-foreign"
    assert "pytest" in (got.env_dir / "env.json").read_text()
    assert got.meta.tests.fail_to_pass == orig.meta.tests.fail_to_pass
    assert sorted(got.meta.tests.pass_to_pass) == sorted(orig.meta.tests.pass_to_pass)


@pytest.mark.slow
def test_all_humaneval_solved(tmp_path):
    """All 164 problems import, fail before and are solved by the oracle through the harness."""
    rep = import_humaneval(tmp_path)
    assert rep.summary()["ok"] == 164
    s = task_stats([tmp_path], oracle="local", run_oracle=run_oracle)
    assert s["oracle"]["solved"] == 164, s["oracle"]["unsolved"]


def test_cli_stats_and_usage_errors(tasks, tmp_path):
    r = run_cli("tasks", "stats", str(tasks))
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["tasks"] == len(SOME) + 2 and s["median_gold_files"] == 1 and s["median_instruction_chars"] > 0
    for args, msg in [(("import", "swebench", str(tmp_path / "x.jsonl"), "--out", str(tmp_path)), "--repos DIR is required"),
                      (("import", "nope", "--out", str(tmp_path)), "expected humaneval, swebench or harbor"),
                      (("import", "humaneval", "--ids", "1,x", "--out", str(tmp_path)), "--ids '1,x'"),
                      (("export", "jsonl", str(tasks), "--out", str(tmp_path / "o")), "expected one of swebench, harbor")]:
        r = run_cli("tasks", *args)
        assert r.returncode == 2 and msg in json.loads(r.stdout.strip().splitlines()[-1])["error"], (args, r.stdout)
