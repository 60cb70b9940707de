"""run_suite with a real model: tiny-random behind BatchedPolicy, real local sandboxes.

tiny-random solves nothing; what this checks is the model path: episodes batched through
``collect_rollouts``, token and tool-call counts from the trajectories, the results file,
and that two runs of the same greedy checkpoint pass the gate.

Run: ``pytest tests/unit/eval/test_run.py`` (about 30 s on 2 busy cores).
"""

from __future__ import annotations

import json

import pytest

from opencomposer.config import AgentConfig
from opencomposer.eval.gate import compare
from opencomposer.eval.results import load_results
from opencomposer.eval.run import run_suite
from opencomposer.eval.suite import SUITES_DIR, Suite, load_suite
from opencomposer.policies.model import ModelPolicy
from opencomposer.policies.batched import BatchedPolicy


@pytest.fixture(scope="module")
def suite() -> Suite:
    full = load_suite("smoke")
    keep = [t for t in full.tasks if t.id in ("textkit__mean__body", "textkit__slugify__block")]
    return Suite("smoke-2", keep, {t.id: full.difficulty[t.id] for t in keep}, origin=str(SUITES_DIR))


@pytest.mark.slow
def test_model_run_and_identical_rerun(suite, tmp_path):
    cfg = AgentConfig(max_turns=2, command_timeout=10)
    outs = []
    for name in ("a", "b"):
        with BatchedPolicy(ModelPolicy("tiny-random", temperature=0.0, max_new_tokens=24, seed=0), max_batch=4) as pol:
            outs.append(run_suite(suite, pol, k=2, backend="local", agent_cfg=cfg, label=f"tiny-{name}",
                                  out_dir=tmp_path / name, progress=False, price_per_mtok=1.0))
    res = load_results(tmp_path / "a")  # what was written validates
    assert res == json.loads(json.dumps(outs[0]))
    eps = res["episodes"]
    assert [(e["task_id"], e["sample"]) for e in eps] == [(t.id, i) for t in suite.tasks for i in range(2)]
    assert all(e["reward"] == 0 and 0 < e["completion_tokens"] <= 2 * 24 and e["prompt_tokens"] > 100
               for e in eps)
    assert {e["stop_reason"] for e in eps} <= {"max_turns", "max_tokens", "submitted", "policy_error"}
    s = res["summary"]
    assert s["pass@1"] == 0 and s["cost_usd"] > 0 and s["per_difficulty"]["block"]["n"] == 1
    assert len(list((tmp_path / "a" / "transcripts").glob("*.json"))) == 4
    g = compare(tmp_path / "a", tmp_path / "b")
    assert g.passed and g.n_tasks == 2
    # greedy decoding of the same weights: the same tokens, so even tokens gate at zero tolerance
    assert compare(tmp_path / "a", tmp_path / "b", metric="mean_completion_tokens").passed


def test_bad_policy_and_k(suite):
    with pytest.raises(TypeError, match="factory task -> Policy"):
        run_suite(suite, 42, label="x", backend="local")
    with pytest.raises(ValueError, match="k must be >= 1"):
        run_suite(suite, lambda t: None, k=0, label="x", backend="local")


def test_a_flagged_episode_is_voided_and_shown(suite, tmp_path):
    """The monitors run where the harness grades: an episode that solves its task but also signals
    the sandbox's PID 1 is graded 1, voided to 0, and its record and the summary say so."""
    from opencomposer.policies.scripted import ScriptedPolicy, tool_call

    def policy(task):
        fix = f"patch -p1 -s <<'EOF'\n{task.gold_patch}\nEOF"
        return ScriptedPolicy([[tool_call("run", command="kill -CONT 1; echo sent")], [tool_call("run", command=fix)],
                               [tool_call("submit", message="done")]])

    one = Suite("smoke-1", suite.tasks[:1], {suite.tasks[0].id: suite.difficulty[suite.tasks[0].id]}, origin=suite.origin)
    res = run_suite(one, policy, backend="namespace", label="flagged", out_dir=tmp_path / "r", progress=False)
    (ep,) = res["episodes"]
    assert ep["reward"] == 0 and ep["hacking_flagged"] == ["grader_tampering"]
    assert res["summary"]["hacking_flagged"] == 1.0
    (path,) = (tmp_path / "r" / "transcripts").glob("*.json")
    meta = json.loads(path.read_text())["meta"]
    assert meta["monitor"]["flags"]["grader_tampering"] == ["run: kill -CONT 1; echo sent"]
    assert meta["reward"]["graded_reward"] == 1.0 and meta["reward"]["voided"] == ["grader_tampering"]
