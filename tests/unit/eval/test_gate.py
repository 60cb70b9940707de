"""The gate's rule on results built episode by episode (the real-run test is
tests/integration/test_eval_gate.py)."""

from __future__ import annotations

import json

import pytest

from opencomposer.eval.gate import compare
from opencomposer.eval.results import SCHEMA, ResultsError


def results(rewards: dict[str, list[int]], label: str = "x", suite: str = "s", tokens: int = 10) -> dict:
    eps = [{"task_id": t, "difficulty": "easy", "sample": i, "reward": r, "completion_tokens": tokens,
            "prompt_tokens": 100, "tool_calls": 2, "invalid_calls": 0, "seconds": 1.0, "stop_reason": "submit"}
           for t, rs in rewards.items() for i, r in enumerate(rs)]
    return {"schema": SCHEMA, "suite": suite, "label": label, "k": len(next(iter(rewards.values()))),
            "episodes": eps}


GOOD = {f"t{i}": [1, 1, 0, 1] for i in range(10)}


def test_identical_passes_with_zero_interval():
    r = compare(results(GOOD), results(GOOD))
    assert r.passed and r.delta == 0 and r.ci_low == 0 and r.ci_high == 0 and r.n_tasks == 10
    assert compare(results(GOOD), results(GOOD), strict=True).passed


def test_damaged_is_blocked_and_reason_says_why():
    bad = {t: [0, 0, 0, 0] for t in GOOD}
    r = compare(results(GOOD, "base"), results(bad, "damaged"))
    assert not r.passed
    assert r.delta == pytest.approx(-0.75) and r.ci_high < 0
    assert "worse" in r.reason and r.label_b == "damaged"
    # the improvement direction passes
    assert compare(results(bad), results(GOOD)).passed


def test_tolerance_and_noise():
    # one task of ten lost: the interval reaches 0, so the default rule lets it pass ...
    slightly = dict(GOOD, t0=[0, 0, 0, 0])
    r = compare(results(GOOD), results(slightly))
    assert r.passed and r.ci_low < 0 <= r.ci_high + 1e-12 and r.worse_tasks == ["t0"]
    # ... and strict non-inferiority at zero tolerance does not
    assert not compare(results(GOOD), results(slightly), strict=True).passed
    # a large tolerance forgives even a complete loss
    bad = {t: [0, 0, 0, 0] for t in GOOD}
    assert compare(results(GOOD), results(bad), tolerance=0.8).passed


def test_lower_is_better_metric():
    r = compare(results(GOOD, tokens=10), results(GOOD, tokens=50), metric="mean_completion_tokens")
    assert not r.passed and r.delta == 40 and not r.higher_is_better
    assert compare(results(GOOD, tokens=50), results(GOOD, tokens=10), metric="mean_completion_tokens").passed


def test_pass_at_k_uses_common_k_and_only_common_tasks():
    a = results(GOOD)
    b = results({**{t: [0, 0, 0, 1] for t in GOOD}, "extra": [1, 1, 1, 1]})
    r = compare(a, b, metric="pass@k")
    assert r.passed and r.a == 1.0 and r.b == 1.0 and r.only_in_b == ["extra"]
    assert not compare(a, b, metric="pass@1").passed


def test_bad_inputs(tmp_path):
    with pytest.raises(ResultsError, match="no common tasks"):
        compare(results(GOOD, suite="s1"), results({"other": [1]}, suite="s2"))
    with pytest.raises(ResultsError, match="unknown metric 'accuracy'"):
        compare(results(GOOD), results(GOOD), metric="accuracy")
    p = tmp_path / "r.json"
    p.write_text(json.dumps({**results(GOOD), "schema": "v0"}))
    with pytest.raises(ResultsError, match=r"r.json: field 'schema' is 'v0'"):
        compare(p, results(GOOD))
    broken = results(GOOD)
    broken["episodes"][3]["reward"] = "yes"
    with pytest.raises(ResultsError, match=r"episodes\[3\].reward is 'yes'"):
        compare(results(GOOD), broken)
    with pytest.raises(ResultsError, match="no results file"):
        compare(tmp_path / "missing", results(GOOD))
    with pytest.raises(ValueError, match="tolerance"):
        compare(results(GOOD), results(GOOD), tolerance=-1)


def test_seeds_pooled_count_every_episode_of_a_task_together(tmp_path):
    """Two seeds of one stage: a task's 4 + 4 episodes as 8 samples (pass@1 their mean, pass@8 from all 8);
    the CLI pools with --also-a / --also-b; files of another suite or k are refused naming the file."""
    from typer.testing import CliRunner

    from opencomposer.cli import app
    from opencomposer.eval.results import per_task, pool_results

    sft0 = results({f"t{i}": [0, 0, 0, 0] for i in range(10)}, label="sft")
    sft1 = results({f"t{i}": [0, 0, 0, 1] if i < 2 else [0, 0, 0, 0] for i in range(10)}, label="sft")
    rl0 = results({f"t{i}": [1, 0, 0, 0] if i < 6 else [0, 0, 0, 0] for i in range(10)}, label="rl")
    rl1 = results({f"t{i}": [1, 1, 0, 0] if i < 6 else [0, 0, 0, 0] for i in range(10)}, label="rl")
    pooled = pool_results([rl0, rl1])
    assert pooled["k"] == 8 and pooled["label"] == "rl+rl" and len(pooled["episodes"]) == 80
    assert sorted(e["sample"] for e in pooled["episodes"] if e["task_id"] == "t0") == list(range(8))
    assert per_task(pooled, "pass@1")["t0"] == pytest.approx(3 / 8) and per_task(pooled, "pass@1")["t9"] == 0
    r = compare(pool_results([sft0, sft1]), pooled)
    assert r.delta == pytest.approx(6 * 3 / 8 / 10 - 2 * 1 / 8 / 10)
    paths = []
    for name, res in (("sft0", sft0), ("sft1", sft1), ("rl0", rl0), ("rl1", rl1)):
        (tmp_path / f"{name}.json").write_text(json.dumps(res))
        paths.append(str(tmp_path / f"{name}.json"))
    out = CliRunner().invoke(app, ["eval", "compare", paths[0], paths[2], "--also-a", paths[1], "--also-b", paths[3]])
    assert out.exit_code == 0, out.output
    got = json.loads(out.output.strip().splitlines()[-1])
    assert got["delta"] == pytest.approx(r.delta) and got["n_tasks"] == 10 and got["label_b"] == "rl+rl"
    (tmp_path / "other.json").write_text(json.dumps(results(GOOD, suite="other")))
    with pytest.raises(ResultsError, match=r"other.json: field 'suite' is 'other', expected 's'"):
        pool_results([paths[0], str(tmp_path / "other.json")])
    with pytest.raises(ResultsError, match="no results files"):
        pool_results([])
