"""The RL run keeps the transcripts of the rollouts a person must audit: passed and flagged ones.

Real episodes of a shipped smoke task in local sandboxes, graded by the real grader: the
oracle (passes), an agent that rewrites a test file (flagged by the monitors, reward voided)
and one that gives up (neither). ``KeptTranscripts`` writes the first two under
``transcripts/step-NNNN/``, readable by ``Trajectory.load``, with what they were judged by and
without the per-token fields; a resumed run drops the steps it runs again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from opencomposer.episode.run import Rollout, run_task, shape_rollouts
from opencomposer.eval.suite import load_suite
from opencomposer.harness.trajectory import Trajectory
from opencomposer.policies.oracle import OraclePolicy
from opencomposer.policies.scripted import ScriptedPolicy, tool_call
from opencomposer.rewards.config import RewardConfig
from opencomposer.rl.transcripts import KeptTranscripts, audit

SMOKE = "textkit__clamp__function"


@pytest.fixture(scope="module")
def rollouts() -> list[Rollout]:
    task = load_suite("smoke").tasks[0]  # env "current": graded with this interpreter's pytest
    assert task.id == SMOKE
    tamper = ScriptedPolicy([[tool_call("write_file", path="tests/test_numbers.py",
                                        content="def test_nothing():\n    assert True\n")],
                             [tool_call("submit", message="Done.")]])
    give_up = ScriptedPolicy([[tool_call("submit", message="I could not do it.")]])
    ros = [Rollout(task.id, 0, i, run_task(task, policy, "local"))
           for i, policy in enumerate([OraclePolicy(task), tamper, give_up])]
    ros[0].result.trajectory.steps[0].token_ids = [1, 2, 3]  # as an engine's policy fills them
    ros[0].result.trajectory.steps[0].logprobs = [-0.1, -0.2, -0.3]
    return ros


def test_passed_and_flagged_rollouts_are_kept_with_what_judged_them(rollouts, tmp_path: Path):
    oracle, tamper, give_up = rollouts
    assert oracle.result.reward.passed and not oracle.result.flags
    assert tamper.result.flags and tamper.reward == 0.0  # voided
    assert not give_up.result.reward.passed and not give_up.result.flags
    shaping = shape_rollouts(rollouts, RewardConfig())
    assert shaping["hacking_flagged"] == pytest.approx(1 / 3)
    assert all(shaping[f"flag_{k}"] == pytest.approx(1 / 3) for k in tamper.result.flags)

    written = KeptTranscripts(tmp_path, "notable").keep(7, rollouts)
    assert sorted(p.name for p in written) == [f"{oracle.task_id}__g0r0.json", f"{oracle.task_id}__g0r1.json"]
    assert {p.parent for p in written} == {tmp_path / "transcripts" / "step-0007"}
    kept = {p.name: Trajectory.load(p) for p in written}
    ok, flagged = kept[f"{oracle.task_id}__g0r0.json"], kept[f"{oracle.task_id}__g0r1.json"]
    assert ok.meta["rl"] == {"step": 7, "group": 0, "index": 0, "passed": True, "reward": 1.0,
                             "train_reward": oracle.train_reward, "flagged": [], "kept_as": "passed",
                             "policy_versions": []}
    assert ok.meta["reward"]["passed"] and ok.steps[0].token_ids == [] and ok.steps[0].logprobs == []
    assert rollouts[0].result.trajectory.steps[0].token_ids == [1, 2, 3]  # the update's copy untouched
    assert flagged.meta["rl"]["flagged"] == sorted(tamper.result.flags) and flagged.meta["rl"]["kept_as"] == "flagged"
    assert flagged.meta["monitor"]["flags"] == tamper.result.flags  # with the evidence
    assert any("tests/test_numbers.py" in json.dumps(ev) for ev in tamper.result.flags.values())
    assert flagged.meta["shaped_reward"]["flags"] == tamper.result.flags


def test_all_none_and_a_resume_that_drops_the_steps_it_runs_again(rollouts, tmp_path: Path):
    assert len(KeptTranscripts(tmp_path / "a", "all").keep(1, rollouts)) == 3
    assert KeptTranscripts(tmp_path / "n", "none").keep(1, rollouts) == []
    assert not (tmp_path / "n" / "transcripts").exists()
    kept = KeptTranscripts(tmp_path, "notable")
    for step in (1, 2, 3):
        kept.keep(step, rollouts)
    (tmp_path / "transcripts" / "notes").mkdir()  # not a step's folder: left alone
    assert kept.truncate(1) == [2, 3]
    assert sorted(p.name for p in (tmp_path / "transcripts").iterdir()) == ["notes", "step-0001"]
    assert kept.truncate(1) == []


def test_a_seeded_sample_of_the_other_rollouts_is_kept_beside_the_notable_ones(rollouts, tmp_path: Path):
    give_up = rollouts[2]
    kept = KeptTranscripts(tmp_path, "notable", sample=1, seed=5)
    written = kept.keep(4, rollouts)
    assert len(written) == 3  # the pass, the flagged one, and the one other rollout
    sampled = Trajectory.load(tmp_path / "transcripts" / "step-0004" / f"{give_up.task_id}__g0r2.json")
    assert sampled.meta["rl"]["kept_as"] == "sample" and not sampled.meta["rl"]["passed"]
    assert audit(tmp_path)["sampled"] == 1
    # the draw is the run seed's and the step's: the same again, another step or seed may differ
    others = [(g, i) for g in range(3) for i in range(8)]  # 24 other rollouts, 2 kept
    many = [Rollout(f"t{g}", g, i, rollouts[2].result) for g, i in others]
    pick = [(ro.group, ro.index) for ro, _ in KeptTranscripts(tmp_path, "notable", sample=2, seed=5).chosen(4, many)]
    again = [(ro.group, ro.index) for ro, _ in KeptTranscripts(tmp_path, "notable", sample=2, seed=5).chosen(4, many)]
    assert pick == again and len(pick) == 2
    draws = {tuple((ro.group, ro.index) for ro, _ in KeptTranscripts(tmp_path, "notable", sample=2, seed=s).chosen(st, many))
             for s in range(3) for st in range(3)}
    assert len(draws) > 1
    assert KeptTranscripts(tmp_path, "none", sample=2).chosen(4, many) == []


def test_an_unknown_mode_or_a_negative_sample_names_the_setting():
    with pytest.raises(ValueError, match=r"\[rollout\] keep_transcripts = 'some'.*notable"):
        KeptTranscripts(Path("x"), "some")
    with pytest.raises(ValueError, match=r"keep_transcripts_sample = -1: expected 0 or more"):
        KeptTranscripts(Path("x"), "notable", sample=-1)


def test_the_audit_reads_back_what_was_kept_and_the_script_prints_the_edits(rollouts, tmp_path: Path):
    tamper = rollouts[1]
    KeptTranscripts(tmp_path, "notable").keep(3, rollouts)
    report = audit(tmp_path)
    assert (report["kept"], report["passed"], report["flagged"]) == (2, 1, 1)
    assert report["by_flag"] == {k: 1 for k in tamper.result.flags}
    assert report["passed_by_library"] == {"textkit": 1}
    flagged = next(e for e in report["entries"] if e["flags"])
    assert flagged["calls"][0]["name"] == "write_file" and flagged["calls"][0]["arguments"]["path"] == "tests/test_numbers.py"
    assert audit(tmp_path / "nothing-here")["kept"] == 0
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "rl_audit.py"
    r = subprocess.run([sys.executable, str(script), str(tmp_path), "--only", "flagged"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert "tamper_tests" in r.stdout and "tests/test_numbers.py" in r.stdout and "(reward voided)" in r.stdout
    assert "(passed)" not in r.stdout  # --only flagged
    assert json.loads(r.stdout.strip().splitlines()[-1])["flagged"] == 1
    bad = tmp_path / "transcripts" / "step-0003" / "torn.json"
    bad.write_text("{not json")
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 2 and "torn.json: not a readable trajectory" in r.stderr
