"""The eval suite end to end on real runs, and the gate on real model checkpoints.

Checkpoints (issue 8: "the gate blocks a deliberately damaged checkpoint and passes an
identical one"): a tiny Llama is SFT'd by the repo's own ``run_sft`` on demonstrations of two
smoke tasks until it solves them greedily (``solver_model.py``), then evaluated through the
CLI exactly as a user runs it (``opencomposer eval --suite ... --model CKPT``: ModelPolicy,
the deployment harness, real sandboxes, hidden tests), in four copies:

* ``good``: the trainer checkpoint itself (the run dir whose ``latest`` names the step);
* ``copy``: a byte copy of its exported model directory; ``resaved``: that model loaded and
  written again by the checkpoint writer;
* ``damaged``: the same weights plus Gaussian noise (1 std) on every matrix, written the same way.

``opencomposer eval compare good damaged`` must exit 1 (blocked, JSON last line says why);
``compare good copy`` and ``compare good resaved`` exit 0.

Policies: the smoke suite with the oracle (solves every task from its gold patch, through the
tools) as the good run and a policy that submits without editing as the damaged one:

* the damaged run is blocked by `opencomposer eval compare` (exit 1, JSON last);
* a second, independent run of the good policy passes against the first (exit 0);
* the report is rebuilt from the results files alone;
* bad inputs exit 2 with a reason naming the file/field.

Run: ``pytest tests/integration/test_eval_gate.py -s`` (about 100 s on 2 busy cores: the
checkpoint fixture ~75 s, of which SFT ~35 s and the four CLI evals ~10 s each; ``-s`` prints
the timings).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import NS_REASON, run_cli
from solver_model import damage, record_demos, resave, tiny_base, train_solver

from opencomposer.config import AgentConfig
from opencomposer.eval.run import run_suite
from opencomposer.eval.suite import load_suite
from opencomposer.policies.oracle import OraclePolicy
from opencomposer.policies.scripted import ScriptedPolicy, tool_call

pytestmark = pytest.mark.slow
BACKEND = "local" if NS_REASON else "namespace"


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    # the good checkpoint through the CLI, as a user runs it
    r = run_cli("eval", "--suite", "smoke", "--policy", "oracle", "--k", "2", "--backend", BACKEND,
                "--out", str(root / "good"), "--price", "2.0")
    assert r.returncode == 0, r.stderr
    line = last_json(r.stdout)
    assert line["pass@1"] == 1.0 and line["results"] == str(root / "good" / "results.json")
    suite = load_suite("smoke")
    cfg = AgentConfig(max_turns=10, command_timeout=30)
    run_suite(suite, OraclePolicy, k=2, backend=BACKEND, agent_cfg=cfg, label="oracle-again",
              out_dir=root / "same", progress=False)
    run_suite(suite, lambda task: ScriptedPolicy([[tool_call("submit", message="Done.")]]), k=2,
              backend=BACKEND, agent_cfg=cfg, label="damaged", out_dir=root / "damaged", progress=False)
    return {"good": root / "good", "same": root / "same", "damaged": root / "damaged", "root": root}


def test_results_file_holds_real_episodes(runs):
    res = json.loads((runs["good"] / "results.json").read_text())
    assert res["schema"] == "opencomposer.eval/1" and res["suite"] == "smoke" and res["label"] == "oracle"
    assert len(res["episodes"]) == 10 and {e["sample"] for e in res["episodes"]} == {0, 1}
    assert all(e["reward"] == 1 and e["stop_reason"] == "submitted" and e["tool_calls"] >= 4
               for e in res["episodes"])
    s = res["summary"]
    assert s["per_difficulty"].keys() == {"block", "body", "function"} and s["per_difficulty"]["body"]["n"] == 3
    # cost = tokens x price (same price for prompt and completion here)
    tokens = sum(e["completion_tokens"] + e["prompt_tokens"] for e in res["episodes"])
    assert s["cost_usd"] == pytest.approx(tokens * 2.0 / 1e6) and s["cost_usd"] > 0
    assert len(list((runs["good"] / "transcripts").glob("*.json"))) == 10
    damaged = json.loads((runs["damaged"] / "results.json").read_text())
    assert damaged["summary"]["pass@1"] == 0.0 and damaged["summary"]["tool_calls"] == 1.0


def test_gate_blocks_damaged_and_passes_identical(runs):
    r = run_cli("eval", "compare", str(runs["good"]), str(runs["damaged"]))
    assert r.returncode == 1, r.stderr
    g = last_json(r.stdout)
    assert not g["passed"] and g["delta"] == -1.0 and g["ci_high"] < 0 and g["n_tasks"] == 5
    assert "BLOCKED" in r.stderr
    r = run_cli("eval", "compare", str(runs["good"]), str(runs["same"] / "results.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    g = last_json(r.stdout)
    assert g["passed"] and g["delta"] == 0.0 and g["label_b"] == "oracle-again"
    # a generous tolerance lets even the damaged run through
    r = run_cli("eval", "compare", str(runs["good"]), str(runs["damaged"]), "--tolerance", "1.0")
    assert r.returncode == 0 and last_json(r.stdout)["passed"]


def test_report_rebuilt_from_json_alone(runs, tmp_path):
    only = tmp_path / "only-json"
    for name in ("good", "damaged"):
        (only / name).mkdir(parents=True)
        shutil.copy(runs[name] / "results.json", only / name / "results.json")
    r = run_cli("eval", "report", str(only / "good"), str(only / "damaged"), "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    out = last_json(r.stdout)
    page = Path(out["html"]).read_text()
    assert len(out["pngs"]) == 3 and all(Path(p).stat().st_size > 10_000 for p in out["pngs"])
    assert "data:image/png;base64," in page and "textkit__clamp__function" in page and "damaged" in page


def test_bad_inputs_exit_2(runs, tmp_path):
    bad = tmp_path / "bad.json"
    res = json.loads((runs["good"] / "results.json").read_text())
    bad.write_text(json.dumps({**res, "k": 0}))
    r = run_cli("eval", "compare", str(runs["good"]), str(bad))
    assert r.returncode == 2 and "bad.json: field 'k' is 0" in last_json(r.stdout)["error"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**res, "suite": "humaneval-20",
                                 "episodes": [{**e, "task_id": "HumanEval_0"} for e in res["episodes"]]}))
    r = run_cli("eval", "compare", str(runs["good"]), str(other))
    assert r.returncode == 2 and "no common tasks" in last_json(r.stdout)["error"]
    r = run_cli("eval", "--suite", "no-such-suite", "--policy", "oracle")
    assert r.returncode == 2 and "known suites" in last_json(r.stdout)["error"]
    r = run_cli("eval", "--suite", "smoke", "--k", "0")
    assert r.returncode == 2 and "--k" in last_json(r.stdout)["error"]


# ----------------------------------------------------------------------------- checkpoints

SOLVER_TASKS = ("textkit__initials__body", "textkit__word_count__body")
EVAL_ARGS = ("--k", "1", "--temperature", "0", "--max-turns", "2", "--max-new-tokens", "128", "--backend", BACKEND)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> dict:
    """Train the solver once, make its copies, evaluate all four through the CLI."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("ckpt")
    tasks = [t for t in load_suite("smoke").tasks if t.id in SOLVER_TASKS]
    assert len(tasks) == len(SOLVER_TASKS)
    demos = record_demos(tasks, root / "demos", BACKEND, AgentConfig(max_turns=2, command_timeout=30))
    trained = train_solver(demos, tiny_base(root / "base"), root / "sft")
    assert trained["mistakes"][-1] == 0, f"SFT did not reproduce the demonstrations: {trained}"
    export = Path(trained["export"])
    models = {"good": Path(trained["checkpoint"]).parent,  # the run's checkpoints/ dir, via `latest`
              "copy": Path(shutil.copytree(export, root / "copy")),
              "resaved": resave(export, root / "resaved"),
              "damaged": root / "damaged"}
    hurt = damage(export, models["damaged"], noise=1.0)
    weights = {k: load_file(models[k] / "model.safetensors") for k in ("copy", "resaved", "damaged")}
    assert all(torch.equal(t, weights["copy"][n]) for n, t in weights["resaved"].items())
    assert sum(not torch.equal(t, weights["copy"][n]) for n, t in weights["damaged"].items()) == len(hurt["tensors"]) > 0
    suite = root / "suite.toml"  # the trained tasks, from the repo's fixture dirs
    suite.write_text('name = "smoke-sft"\n' + "".join(
        f'[[source]]\nkind = "dir"\npath = "{t.root}"\nenv = "current"\n' for t in tasks))
    out: dict = {"trained": trained, "root": root, "seconds": {"train": trained["seconds"]}}
    for name, model in models.items():
        t0 = time.monotonic()
        r = run_cli("eval", "--suite", str(suite), "--model", str(model), "--label", name,
                    "--out", str(root / "eval" / name), *EVAL_ARGS)
        assert r.returncode == 0, r.stdout + r.stderr
        out[name] = root / "eval" / name
        out[name + "_line"] = last_json(r.stdout)
        out["seconds"][name] = round(time.monotonic() - t0, 1)
    t0 = time.monotonic()  # the same weights through the built-in engine (`--policy engine`), as rollouts sample
    r = run_cli("eval", "--suite", str(suite), "--model", str(models["copy"]), "--policy", "engine", "--label",
                "engine", "--out", str(root / "eval" / "engine"), *EVAL_ARGS)
    assert r.returncode == 0, r.stdout + r.stderr
    out["engine"], out["engine_line"] = root / "eval" / "engine", last_json(r.stdout)
    out["seconds"]["engine"] = round(time.monotonic() - t0, 1)
    print(f"\n[checkpoint gate] rounds {trained['rounds']}, mistakes {trained['mistakes']}, seconds {out['seconds']}")
    return out


def test_sft_checkpoint_really_solves_and_damage_breaks_it(ckpts):
    good = json.loads((ckpts["good"] / "results.json").read_text())
    assert good["label"] == "good" and ckpts["good_line"]["pass@1"] == 1.0
    assert len(good["episodes"]) == len(SOLVER_TASKS) and {e["task_id"] for e in good["episodes"]} == set(SOLVER_TASKS)
    # solved by the model's own tool calls: an edit_file, then submit, graded by the hidden tests
    assert all(e["reward"] == 1 and e["stop_reason"] == "submitted" and e["tool_calls"] == 2 and not e["invalid_calls"]
               for e in good["episodes"])
    for task in SOLVER_TASKS:  # the model's own calls are the demonstrated ones, argument for argument
        made, shown = (json.loads(f.read_text())["messages"] for f in
                       (ckpts["good"] / "transcripts" / f"{task}-0.json", ckpts["root"] / "demos" / f"{task}.json"))
        calls = [[(c["name"], c["arguments"]) for m in msgs if m["role"] == "assistant" for c in m["tool_calls"]]
                 for msgs in (made, shown)]
        assert calls[0] == calls[1] and [c[0] for c in calls[0]] == ["edit_file", "submit"]
    damaged = json.loads((ckpts["damaged"] / "results.json").read_text())
    assert damaged["summary"]["pass@1"] == 0.0 and damaged["summary"]["tool_calls"] < 1
    # greedy decoding of identical weights: the same episodes, token for token
    for name in ("copy", "resaved"):
        same = json.loads((ckpts[name] / "results.json").read_text())
        assert [(e["task_id"], e["reward"], e["completion_tokens"]) for e in same["episodes"]] == \
               [(e["task_id"], e["reward"], e["completion_tokens"]) for e in good["episodes"]]


def test_the_engine_policy_solves_as_transformers_does(ckpts):
    """`eval --policy engine`: the built-in engine (paged KV, continuous batching) on the checkpoint's
    weights, greedy: the same tool calls, argument for argument, and the same rewards as `--policy model`."""
    assert ckpts["engine_line"]["pass@1"] == 1.0 and ckpts["engine_line"]["label"] == "engine"
    for task in SOLVER_TASKS:
        calls = [[(c["name"], c["arguments"]) for m in json.loads(f.read_text())["messages"]
                  if m["role"] == "assistant" for c in m["tool_calls"]]
                 for f in (ckpts[run] / "transcripts" / f"{task}-0.json" for run in ("good", "engine"))]
        assert calls[0] == calls[1], task


def test_gate_blocks_damaged_checkpoint_and_passes_identical_ones(ckpts):
    r = run_cli("eval", "compare", str(ckpts["good"]), str(ckpts["damaged"]))
    assert r.returncode == 1, r.stdout + r.stderr
    g = last_json(r.stdout)
    assert not g["passed"] and g["delta"] == -1.0 and g["ci_high"] < 0 and g["n_tasks"] == len(SOLVER_TASKS)
    assert g["label_a"] == "good" and g["label_b"] == "damaged" and "BLOCKED" in r.stderr
    for name in ("copy", "resaved"):
        r = run_cli("eval", "compare", str(ckpts["good"]), str(ckpts[name]))
        assert r.returncode == 0, r.stdout + r.stderr
        g = last_json(r.stdout)
        assert g["passed"] and g["delta"] == 0.0 and (g["ci_low"], g["ci_high"]) == (0.0, 0.0) and g["label_b"] == name
