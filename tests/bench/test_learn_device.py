"""benchmarks/learn_device.sh's runs that outlive a call (`start`, `watch`, `stop`), with a stand-in for
benchmarks/learn_run.py (the GPU run itself cannot run here): the arms keep going after `start` returns, `watch`
reports their new lines and results, `stop` ends them between units with the run's own status, and a second
`start` is refused while an arm still runs."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_RUN = '''
import argparse, json, sys, time, types
from pathlib import Path
def config_with(cfg, sets):
    out = "runs/" + Path(cfg).stem  # the config's own out_dir unless a setting names one
    for s in sets:
        if s.startswith("run.out_dir="):
            out = s.split("=", 1)[1].strip('"')
    return types.SimpleNamespace(run=types.SimpleNamespace(out_dir=out))
if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    for opt in ("--config", "--humaneval-data"):
        ap.add_argument(opt)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--deadline-s", type=float)
    ap.add_argument("--stop-file", type=Path)
    a = ap.parse_args()
    out = Path(config_with(a.config, a.set).run.out_dir)
    (out / "rl_run").mkdir(parents=True, exist_ok=True)
    (out / "rl" / "heldout_libraries" / "chunks").mkdir(parents=True, exist_ok=True)  # a split evaluated in part
    (out / "rl" / "heldout_libraries" / "chunks" / "0000.json").write_text("{}")
    for step in range(1, 1000):
        if a.stop_file.exists():
            print(json.dumps({"out": str(out), "stopped_before": f"rl step {step}"}))
            sys.exit(3)
        time.sleep(0.3)
        print(f"  RL step {step}: pass@1 0.00", flush=True)
        with open(out / "rl_run" / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "pass@1": 0.0}) + "\\n")
'''


def part(tmp: Path) -> Path:
    """The script's arm functions and its start/watch/stop modes, after its set-up (which needs the GPU machine)."""
    s = (ROOT / "benchmarks" / "learn_device.sh").read_text()
    a = s.index("out_dir_of() {")
    b = s.index("esac", s.index('case "${1:-}" in')) + len("esac")
    p = tmp / "part.sh"
    p.write_text(f"set -euo pipefail\nL={tmp}/L; START=$(date +%s); CFG_GIVEN=${{CFG:-}}; CFG=${{CFG:-default.toml}}\n"
                 f"mkdir -p $L\n" + s[a:b] + "\n")
    return p


def call(tmp: Path, mode: str, out: str, budget: int, **env: str) -> subprocess.CompletedProcess:
    (tmp / out).mkdir(exist_ok=True)
    e = {**os.environ, "OUT": str(tmp / out), "BUDGET_S": str(budget), "ARM1_DELAY_S": "1", "WATCH_POLL_S": "1", **env}
    return subprocess.run(["bash", str(tmp / "part.sh"), mode], cwd=tmp, env=e, capture_output=True, text=True,
                          timeout=120)


def test_arms_outlive_the_call_and_stop_between_units(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "learn_run.py").write_text(FAKE_RUN)
    part(tmp_path)
    # arm 0 writes where x.toml says (runs/x); `watch` and `stop` are called without CFG, as in session 41
    arms = {"CFG": "x.toml", "SET": "", "SET1": 'run.seed=1;run.out_dir="runs/a1"'}
    try:
        r = call(tmp_path, "start", "o1", 46, **arms)  # follows them, a look a second, until 40 s of its budget are left
        assert r.returncode == 3, r.stderr
        assert "[arm0] started in a session of its own" in r.stdout and "arm0 still running" in r.stdout
        assert "[arm1]   RL step 1: pass@1 0.00" in r.stdout
        steps = len((tmp_path / "runs/x/rl_run/metrics.jsonl").read_text().splitlines())
        time.sleep(1.5)  # the call has returned; the arms go on
        assert len((tmp_path / "runs/x/rl_run/metrics.jsonl").read_text().splitlines()) > steps
        again = call(tmp_path, "start", "o2", 42, **arms)
        assert again.returncode == 2 and "arm0 is still running" in again.stdout
        printed = [line for line in r.stdout.splitlines() if line.startswith("[arm0]   RL step")]
        w = call(tmp_path, "watch", "o3", 41)
        seen = [line for line in w.stdout.splitlines() if line.startswith("[arm0]   RL step")]
        last = int(printed[-1].split("step ")[1].split(":")[0])
        assert w.returncode == 3 and seen[0].startswith(f"[arm0]   RL step {last + 1}:")  # the lines after start's
        bad = call(tmp_path, "watch", "o5", 41, CFG="other.toml")
        assert bad.returncode == 2 and "started with CFG=x.toml" in bad.stdout
        s = call(tmp_path, "stop", "o4", 60)
        assert s.returncode == 3 and "arm0 exit 3" in s.stdout and "arm1 exit 3" in s.stdout, s.stdout
        assert '"stopped_before"' in s.stdout
        with tarfile.open(tmp_path / "o4" / "arm1" / "results.tgz") as t:
            assert {"./rl_run/metrics.jsonl", "./rl/heldout_libraries/chunks/0000.json"} <= set(t.getnames())
        assert (tmp_path / "o4" / "arm0" / "device.log").is_file()
        with tarfile.open(tmp_path / "o4" / "arm0" / "results.tgz") as t:  # found under the config start was given
            assert "./rl_run/metrics.jsonl" in t.getnames()
    finally:
        (tmp_path / "L" / "stop").touch()


def _tgz(path: Path, files: dict[str, str]) -> None:
    src = path.parent / (path.name + ".src")
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    with tarfile.open(path, "w:gz") as t:
        t.add(src, arcname=".")


def test_results_and_traces_kept_in_git_reach_every_call(tmp_path):
    """What must outlive a fresh clone travels with the tree: `keep-results` keeps what came back without its
    transcripts (data/runs/OUT.tgz) and `prepare` the SFT traces (data/traces/OUT.tgz); a device call (here
    `stash`) puts both where the run reads them, leaving files already there alone."""
    script = ROOT / "benchmarks" / "learn_device.sh"
    back = tmp_path / "results.tgz"
    _tgz(back, {"sft/validation/results.json": '{"pass@1": 0.013}', "sft/validation/transcripts/t1.json": "{}",
                "rl_run/metrics.jsonl": '{"step": 1}\n', "summary.json": "{}"})
    kept = subprocess.run(["bash", str(script), "keep-results", str(back), "arm-a"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert kept.returncode == 0, kept.stderr
    assert '"kept": "data/runs/arm-a.tgz"' in kept.stdout.splitlines()[-1]
    with tarfile.open(tmp_path / "data/runs/arm-a.tgz") as t:
        names = set(t.getnames())
    assert "./sft/validation/results.json" in names and not any("transcripts" in n for n in names)
    bad = subprocess.run(["bash", str(script), "keep-results", str(tmp_path / "nothing.tgz"), "arm-a"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage:" in bad.stderr
    (tmp_path / "data/traces").mkdir(parents=True)
    _tgz(tmp_path / "data/traces/arm-a.tgz", {"arm-a/sft/traces/0001.json": '{"messages": []}'})
    L = tmp_path / "L"
    (L / "run/arm-a/sft").mkdir(parents=True)
    (L / "run/arm-a/summary.json").write_text('{"newer": true}')  # made by a call before: kept
    r = subprocess.run(["bash", str(script), "stash"], cwd=tmp_path, env={**os.environ, "LEARN_DIR": str(L)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (L / "run/arm-a/sft/traces/0001.json").read_text() == '{"messages": []}'
    assert (L / "run/arm-a/sft/validation/results.json").read_text() == '{"pass@1": 0.013}'
    assert (L / "run/arm-a/summary.json").read_text() == '{"newer": true}'
    assert not (L / "run/arm-a/rl_run").exists()  # an rl_run comes back whole, with its checkpoints, or not at all


def test_task_packs_carried_once_reach_every_later_call(tmp_path):
    """With the tree slimmed (benchmarks/tree_slim.sh on) data/tasks/ travels only in the call that carries it,
    and the device does not keep a carried folder for the next call: `stash` keeps its packs in the run's
    folder and puts them back into data/tasks/ on every later call, leaving a pack the tree brought alone."""
    script = ROOT / "benchmarks" / "learn_device.sh"
    env = {**os.environ, "LEARN_DIR": str(tmp_path / "L")}
    (tmp_path / "data/tasks").mkdir(parents=True)
    (tmp_path / "data/tasks/lines.ocpack").write_bytes(b"pack v1")
    first = subprocess.run(["bash", str(script), "stash"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60)
    assert first.returncode == 0, first.stderr
    (tmp_path / "data/tasks/lines.ocpack").unlink()  # the next call: the carried folder is gone
    (tmp_path / "data/tasks/other.ocpack").write_bytes(b"with the tree")
    second = subprocess.run(["bash", str(script), "stash"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert second.returncode == 0, second.stderr
    assert (tmp_path / "data/tasks/lines.ocpack").read_bytes() == b"pack v1"
    assert (tmp_path / "data/tasks/other.ocpack").read_bytes() == b"with the tree"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          capture_output=True, text=True, timeout=60)


def test_tree_slim_takes_the_packs_out_of_the_travelling_tree_and_back(tmp_path):
    """`tree_slim.sh on` leaves data/tasks/ in place but out of git's index and ignored, so the tree a device call
    carries shrinks by its size; a commit meanwhile is refused (the packs would be deleted from git); `off` gives
    back the committed index exactly; `on` with uncommitted pack changes is refused and changes nothing."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    for f in ("tree_slim.sh", "carry_room.sh"):
        (repo / "benchmarks" / f).write_text((ROOT / "benchmarks" / f).read_text())
        (repo / "benchmarks" / f).chmod(0o755)
    (repo / "data/tasks").mkdir(parents=True)
    (repo / "data/tasks/lines.ocpack").write_bytes(os.urandom(3 << 20))
    (repo / "README.md").write_text("front door\n")
    assert _git(repo, "init", "-q").returncode == 0
    _git(repo, "add", ".")
    assert _git(repo, "commit", "-qm", "packs").returncode == 0
    slim = repo / "benchmarks" / "tree_slim.sh"

    def run(arg: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(slim), arg], cwd=repo, capture_output=True, text=True, timeout=60)

    before = json.loads(run("status").stdout.splitlines()[-1])
    room = repo / "benchmarks" / "carry_room.sh"
    predicted = subprocess.run(["bash", str(room), "--slim", "--bytes"], cwd=repo, capture_output=True, text=True)
    on = run("on")
    assert on.returncode == 0, on.stderr
    after = json.loads(on.stdout.splitlines()[-1])
    assert after["slim"] == "on" and before["tree_bytes"] - after["tree_bytes"] == 3 << 20
    assert (repo / "data/tasks/lines.ocpack").stat().st_size == 3 << 20  # the files stay
    # what `prepare` cuts its parts to beforehand (carry_room.sh --slim) is the room a slimmed call has
    assert int(predicted.stdout) == (64 << 20) - after["tree_bytes"]
    (repo / "README.md").write_text("front DOOR\n")  # the same size: the tree compares
    _git(repo, "add", "README.md")
    refused = _git(repo, "commit", "-qm", "meanwhile")
    assert refused.returncode != 0 and "tree_slim.sh off" in refused.stderr
    off = run("off")
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout.splitlines()[-1]) == {**before, "slim": "off"}
    assert _git(repo, "diff", "--cached", "--quiet", "--", "data/tasks").returncode == 0
    assert _git(repo, "commit", "-qm", "after").returncode == 0
    assert "data/tasks/lines.ocpack" in _git(repo, "ls-files").stdout
    (repo / "data/tasks/lines.ocpack").write_bytes(b"changed, not committed")
    dirty = run("on")
    assert dirty.returncode == 2 and "not committed" in dirty.stderr
    assert "/data/tasks/" not in (repo / ".git/info/exclude").read_text()
