"""Tasks -> Harbor task directories: the export half of the Harbor format.

    opencomposer tasks export harbor tasks/ --out harbor-tasks/

Writes a real Harbor task (``python:3.11-slim`` + the pinned test requirements, the
workspace under ``/app``, a verifier that grades FAIL_TO_PASS + PASS_TO_PASS) and keeps
our metadata in ``[metadata.opencomposer]``, so export -> import (``harbor.py``) is lossless.

Test: ``pytest tests/integration/test_task_formats.py tests/unit/eval/test_suite.py``.
"""

from __future__ import annotations

import base64
import json
import shlex
import shutil
from pathlib import Path

import tomli_w

from opencomposer.harness.patch import apply_patch, parse_patch
from opencomposer.paths import remove_stale_temps, replace_dir, temp_dir
from opencomposer.tasks.format import Task
from opencomposer.tasks.sources.harbor import EXTRA

APP = "/app"


GRADE_PY = '''"""Harbor verifier: 1 when every FAIL_TO_PASS and PASS_TO_PASS test passed in pytest -rA output."""
import json, re, sys
want = json.load(open(sys.argv[1]))
got = {}
for line in open(sys.argv[2], errors="replace"):
    m = re.match(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (\\S.*)$", line.rstrip())
    if m:
        node = m.group(2) if m.group(1) in ("PASSED", "XPASS") else m.group(2).split(" - ", 1)[0]
        got.setdefault(node.strip(), m.group(1))
ok = all(got.get(t) in ("PASSED", "XFAIL") for t in want["fail_to_pass"] + want["pass_to_pass"])
print(1 if ok else 0)
'''


def _requirements(task: Task) -> list[str]:
    """The env's pinned packages (env.json), less the installer tools; else just pytest."""
    manifest = task.env_dir / "env.json" if task.env_dir else None
    if manifest and manifest.is_file():
        data = json.loads(manifest.read_text())
        stripped = set(data.get("stripped", []))
        return [r for r in data.get("installed", []) if r.split("==")[0].lower() not in stripped | {"pip"}] or ["pytest"]
    return ["pytest"]


def solve_sh(task: Task) -> str:
    """A solve.sh that needs only python (slim images have neither git nor patch): it
    writes the files as the gold patch leaves them (base64), or removes deleted ones."""
    patches = parse_patch(task.gold_patch)
    current = {fp.path: (task.workspace / fp.path).read_text() for fp in patches if not fp.is_new}
    files = {path: None if text is None else base64.b64encode(text.encode()).decode()
             for path, text in apply_patch(current, patches).items()}
    return ("#!/bin/bash\n# the reference solution: the files as the gold patch (solution/gold.patch) leaves them\n"
            f"cd {APP}\npython3 - <<'EOF'\nimport base64, json, pathlib\n"
            f"files = json.loads({json.dumps(json.dumps(files))})\n"
            "for path, data in files.items():\n"
            "    p = pathlib.Path(path)\n"
            "    if data is None:\n        p.unlink()\n        continue\n"
            "    p.parent.mkdir(parents=True, exist_ok=True)\n"
            "    p.write_bytes(base64.b64decode(data))\nEOF\n")


def export_task(task: Task, out: Path) -> Path:
    m = task.meta
    dest = Path(out) / task.id
    remove_stale_temps(Path(out))
    tmp = temp_dir(dest)
    try:
        (tmp / "instruction.md").write_text(task.instruction + "\n")
        conf = {
            "version": "1.0",
            "metadata": {"category": "programming", "tags": [m.source.kind, m.feature.level],
                         EXTRA: {"id": task.id, "targets": m.tests.targets, "files": m.tests.files, "fail_to_pass": m.tests.fail_to_pass,
                                 "pass_to_pass": m.tests.pass_to_pass, "command": m.tests.command,
                                 "pythonpath": m.environment.pythonpath, "package": m.source.package,
                                 "feature": m.feature.model_dump(), "source": m.source.model_dump(),
                                 "env": str(task.env_dir) if task.env_dir else ""}},
            "verifier": {"timeout_sec": m.tests.timeout},
            "agent": {"timeout_sec": 1800.0},
            "environment": {"build_timeout_sec": 600.0, "cpus": 1, "memory_mb": 2048, "allow_internet": False},
        }
        (tmp / "task.toml").write_text(tomli_w.dumps(conf))
        env = tmp / "environment"
        shutil.copytree(task.workspace, env / "workspace", symlinks=True, ignore=shutil.ignore_patterns(".git"))
        (env / "requirements.txt").write_text("\n".join(_requirements(task)) + "\n")
        pp = ":".join(f"{APP}/{p}".rstrip("/.") if p != "." else APP for p in m.environment.pythonpath)
        (env / "Dockerfile").write_text(
            "FROM python:3.11-slim\n"
            "COPY requirements.txt /tmp/requirements.txt\n"
            "RUN pip install --no-cache-dir -r /tmp/requirements.txt\n"
            f"WORKDIR {APP}\n"
            f"COPY workspace/ {APP}/\n" + (f"ENV PYTHONPATH={pp}\n" if pp else ""))
        tests = tmp / "tests"
        shutil.copytree(task.hidden_tests, tests / "files")
        (tests / "grade.json").write_text(json.dumps({"fail_to_pass": m.tests.fail_to_pass,
                                                       "pass_to_pass": m.tests.pass_to_pass}))
        (tests / "grade.py").write_text(GRADE_PY)
        (tests / "test.sh").write_text(
            "#!/bin/bash\n# hidden tests over the workspace, run the targets, reward 1 only if all\n"
            "# FAIL_TO_PASS and PASS_TO_PASS tests pass\n"
            f"mkdir -p /logs/verifier\ncp -r /tests/files/. {APP}/\ncd {APP}\n"
            f"{m.tests.command} {' '.join(shlex.quote(t) for t in m.tests.targets)} > /logs/verifier/pytest.log 2>&1\n"
            "python /tests/grade.py /tests/grade.json /logs/verifier/pytest.log > /logs/verifier/reward.txt\n")
        sol = tmp / "solution"
        sol.mkdir()
        (sol / "gold.patch").write_text(task.gold_patch)
        (sol / "solve.sh").write_text(solve_sh(task))
        replace_dir(tmp, dest)
        return dest
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
