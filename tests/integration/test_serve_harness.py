"""The whole harness against ``opencomposer serve``: two real processes talking HTTP.

``opencomposer serve --model tiny-random --port 0`` runs as a subprocess (its first stdout
line says where it listens); ``opencomposer agent --policy openai --base-url ...`` runs an
episode on a small real task (a package with a deleted function body and hidden pytest
tests) through the official ``openai`` client. tiny-random writes noise, so the reward
is 0; what is checked is that the episode ran turn by turn against the server, the
transcript was written, the reward was graded, and the server ends with no KV blocks held.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import run_cli

from opencomposer.inference.server.process import serve_process

STATS = 'def mean(xs):\n    """Arithmetic mean of a non-empty sequence."""\n    return sum(xs) / len(xs)\n'
DELETED = 'def mean(xs):\n    """Arithmetic mean of a non-empty sequence."""\n    raise NotImplementedError\n'
TESTS = "from mathy.stats import mean\n\n\ndef test_mean():\n    assert mean([1, 2, 3]) == 2\n"
PATCH = """--- a/mathy/stats.py
+++ b/mathy/stats.py
@@ -1,3 +1,3 @@
 def mean(xs):
     \"\"\"Arithmetic mean of a non-empty sequence.\"\"\"
-    raise NotImplementedError
+    return sum(xs) / len(xs)
"""


def make_task(root: Path) -> Path:
    """A task directory in the format of ``tasks/format.py``; its environment is this venv."""
    from opencomposer.tasks.envs import adopt_env
    from opencomposer.tasks.format import TaskMeta, write_task_toml

    files = {"workspace/mathy/__init__.py": "", "workspace/mathy/stats.py": DELETED,
             "tests/files/tests/test_stats.py": TESTS, "solution/gold.patch": PATCH,
             "instruction.md": "Implement `mathy.stats.mean`.\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    env = adopt_env(root.parent, Path(sys.prefix))  # pytest lives here; linked into the environments root
    meta = TaskMeta(
        id="serve-mean", source={"kind": "local", "spec": "mathy", "package": "mathy"},
        feature={"level": "body", "file": "mathy/stats.py", "symbol": "mathy.stats.mean"},
        environment={"env": os.path.relpath(env, root)},
        tests={"command": "python -m pytest -q", "files": ["tests/test_stats.py"],
               "targets": ["tests/test_stats.py::test_mean"], "fail_to_pass": ["tests/test_stats.py::test_mean"]},
    )
    write_task_toml(root / "task.toml", meta)
    return root


@pytest.fixture
def server():
    with serve_process("--model", "tiny-random", "--port", "0", "--default-max-tokens", "48",
                       "--max-num-seqs", "4", stop_timeout=20) as ready:
        yield ready["serving"]


def test_agent_runs_a_task_against_opencomposer_serve(server, tmp_path):
    task = make_task(tmp_path / "task")
    cfg = tmp_path / "agent.toml"
    cfg.write_text("[agent]\nmax_turns = 3\nmax_seconds = 300\ncommand_timeout = 20\n")
    transcript = tmp_path / "transcript.json"
    t0 = time.time()
    r = run_cli("agent", "--task", str(task), "--policy", "openai", "--base-url", server, "--model", "tiny-random",
                "--config", str(cfg), "--transcript", str(transcript), "--sandbox", "local", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["policy"] == "openai" and result["reward"] == 0.0
    assert result["turns"] >= 1 and result["exit_reason"] in ("max_turns", "max_tokens", "submitted")
    assert result["f2p_passed"] == 0  # graded: the hidden test ran and failed
    saved = json.loads(transcript.read_text())
    assert saved["task_id"] == "serve-mean" and saved["policy"] == "openai:tiny-random"
    assert saved["steps"] and saved["meta"]["reward"]["reward"] == 0.0

    base = server.removesuffix("/v1")
    m = httpx.get(base + "/metrics", timeout=30).json()
    assert m["server"]["finished"] >= result["turns"]  # every turn was a request served here
    assert m["engine"]["kv_blocks_used"] == 0 and m["server"]["pending"] == 0
    assert m["engine"]["prefix_cache_hit_tokens"] > 0 or result["turns"] == 1  # turns resend the history
    assert httpx.get(base + "/health").json()["status"] == "ok"
    print(f"episode: {result['turns']} turns in {time.time() - t0:.1f}s; served {m['server']['finished']} sequences")


def test_serve_with_a_context_beyond_the_model_exits_2_naming_it():
    r = run_cli("serve", "--model", "tiny-random", "--max-model-len", "99999", timeout=120)
    assert r.returncode == 2
    assert "max_model_len=99999" in json.loads(r.stdout.strip().splitlines()[-1])["error"]
