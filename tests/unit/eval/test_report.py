"""The HTML/PNG report, built from results dicts alone (the real-run report is checked in
tests/integration/test_eval_gate.py)."""

from __future__ import annotations

import json

import pytest

from opencomposer.eval.report import build_report
from opencomposer.eval.results import SCHEMA, ResultsError, summarize


def results(label: str, suite: str, rewards: dict[str, list[int]], tokens: int, level: str = "body") -> dict:
    eps = [{"task_id": t, "difficulty": level if i % 2 else "function", "sample": j, "reward": r,
            "completion_tokens": tokens, "prompt_tokens": 900, "tool_calls": 4, "invalid_calls": 0,
            "seconds": 3.0, "stop_reason": "submitted"}
           for i, (t, rs) in enumerate(rewards.items()) for j, r in enumerate(rs)]
    k = len(next(iter(rewards.values())))
    return {"schema": SCHEMA, "suite": suite, "label": label, "k": k, "created": "2026-11-26T07:00:00+00:00",
            "summary": summarize(eps, k, wall_s=30.0), "episodes": eps}


def test_report_from_results_files(tmp_path):
    base = results("base", "smoke", {f"t{i}": [0, 0, 1, 0] for i in range(6)}, tokens=400)
    rl = results("rl-step-40", "smoke", {f"t{i}": [1, 0, 1, 1] for i in range(6)}, tokens=250)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "results.json").write_text(json.dumps(base))
    page = build_report([tmp_path / "base", rl], tmp_path / "rep", title="base vs RL")
    text = page.read_text()
    assert "base vs RL" in text and text.count("data:image/png;base64,") == 3
    assert "rl-step-40" in text and "<code>t5</code>" in text
    for png in ("score_vs_tokens.png", "pass_at_k.png", "per_difficulty.png"):
        assert (tmp_path / "rep" / png).stat().st_size > 10_000


def test_same_label_two_suites_and_bad_input(tmp_path):
    a = results("m", "smoke", {"t0": [1], "t1": [0]}, tokens=10)
    b = results("m", "humaneval-20", {"h0": [1], "h1": [1]}, tokens=20, level="humaneval")
    text = build_report([a, b], tmp_path / "rep").read_text()
    assert "m (smoke)" in text and "m (humaneval-20)" in text
    with pytest.raises(ResultsError, match="field 'schema'"):
        build_report([{**a, "schema": "other"}], tmp_path / "rep2")
    with pytest.raises(ValueError, match="at least one"):
        build_report([], tmp_path / "rep3")
