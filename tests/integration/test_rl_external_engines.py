"""An RL step of tiny-random on real toolz tasks in real sandboxes, its rollouts sampled by a
vLLM- or SGLang-shaped stand-in (tests/testkit/vllm_standin.py, sglang_standin.py; no real
vLLM or SGLang here): every trained token is one the server sampled for exactly the prompt ids
the trainer renders, tagged with the version the server acknowledged; after the update the
server loads the new weights from a directory and the next tokens carry the new version.

Run: ``pytest tests/integration/test_rl_external_engines.py`` (about a minute on 2 cores; needs
PyPI once for the toolz tasks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opencomposer.config import load_config
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.run import RLRun
from opencomposer.train.samples import Sample

from testkit.engine_standin import Backend, serving
from testkit.rl_tasks import write_cfg
from testkit.sglang_standin import SGLangStandin
from testkit.vllm_standin import VLLMStandin

KINDS = {"vllm": VLLMStandin, "sglang": SGLangStandin}


def _spans(s: Sample) -> list[tuple[int, int]]:
    """(start, end) of each run of generated tokens (loss mask 1)."""
    out, start = [], None
    for t, m in enumerate(s.loss_mask + [0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            out.append((start, t))
            start = None
    return out


def _check_samples(samples: list[Sample], answers: list[tuple[list[int], list[int], list[float]]], version: int):
    """Each generated span of each sample is a server answer to exactly the ids before it."""
    by_prompt: dict[tuple, list] = {}  # the K rollouts of a task share their first prompt
    for p, ids, lps in answers:
        by_prompt.setdefault(tuple(p), []).append((ids, lps))
    assert samples and sum(s.loss_tokens for s in samples) > 0
    for s in samples:
        for a, b in _spans(s):
            got = [(ids, lps) for ids, lps in by_prompt[tuple(s.input_ids[:a])]  # KeyError: a prompt never sent
                   if ids[:b - a] == s.input_ids[a:b]]
            assert got, f"tokens {s.input_ids[a:b][:8]}... were not sampled by the server for that prompt"
            assert s.old_logprobs[a:b] == pytest.approx(got[0][1][:b - a], abs=1e-5)
            assert set(s.policy_version[a:b]) == {version}

@pytest.mark.parametrize("kind", KINDS)
def test_an_rl_step_through_the_standin(kind, toolz_tasks: Path, tmp_path: Path):
    backend = Backend("tiny-random")
    standin = KINDS[kind](backend)
    with serving(standin.app) as url:
        out = tmp_path / "run"
        cfg = load_config(write_cfg(tmp_path, toolz_tasks, out, steps=2, kl=0.05, engine=kind, base_url=url),
                          RLRunConfig)
        tasks = sorted(p for p in toolz_tasks.iterdir() if (p / "task.toml").exists())
        run = RLRun(cfg, tasks, out)
        try:
            # at start the server got the trainer's weights (version 0) and acknowledged them
            assert [Path(p).name for p in backend.loaded] == ["v0"]
            run.reference()
            batch = run.actor.next_batch()
            _check_samples(batch.samples, backend.answers, version=0)
            sent = standin.requests
            assert sent and all(isinstance(b.get("prompt", b.get("input_ids")), list) and "text" not in b
                                for b in sent)  # token ids, never text
            metrics = run.learner.update(batch.train)
            assert metrics["samples"] > 0
            weights = run.learner.weights()
            assert weights.version == 1
            run.actor.publish(weights, batch)
            # the next collection pushes version 1 first: the server runs the trainer's new weights
            answered = len(backend.answers)
            batch2 = run.actor.next_batch()
            assert [Path(p).name for p in backend.loaded] == ["v0", "v1"]
            assert batch2.times["time_engine_push"] > 0
            for name, view in backend.engine.weight_views({k: v.shape for k, v in weights.state.items()}).items():
                assert torch.equal(view, weights.state[name]), name
            _check_samples(batch2.samples, backend.answers[answered:], version=1)
        finally:
            run.close()


def test_the_pipeline_trains_on_the_standin_and_evaluates_the_last_version(toolz_tasks: Path, tmp_path: Path):
    """``opencomposer train``'s pipeline with ``engine = "sglang"``: two steps, each on the version
    the server acknowledged (no staleness), and the held-out "rl" evaluation on the last one."""
    import json

    from opencomposer.pipeline.run import run_pipeline

    backend = Backend("tiny-random")
    with serving(SGLangStandin(backend).app) as url:
        out = tmp_path / "run"
        cfg = load_config(write_cfg(tmp_path, toolz_tasks, out, steps=2, kl=0.05, engine="sglang", base_url=url),
                          RLRunConfig)
        result = run_pipeline(cfg, log=lambda m: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["policy_version"], r["staleness_max"]) for r in rows] == [(1, 1, 0.0), (2, 2, 0.0)]
    assert "time_engine_push" in rows[1] and set(result["evals"]) == {"base", "rl"}
    assert [Path(p).name for p in backend.loaded] == ["v0", "v1", "v2"]  # v2: for the "rl" evaluation
    assert sorted(p.name for p in (out / "engine_weights").iterdir()) == ["v1", "v2"]


def test_two_vllm_servers_each_serve_a_group_and_both_load_each_version(toolz_tasks: Path, tmp_path: Path):
    """``base_urls`` of two vLLM-shaped stand-ins: a group on each a step, every version written
    once and loaded by both, every trained token one of the server that sampled it."""
    import json

    from opencomposer.pipeline.run import run_pipeline

    backends = [Backend("tiny-random"), Backend("tiny-random")]
    with serving(VLLMStandin(backends[0]).app) as a, serving(VLLMStandin(backends[1]).app) as b:
        out = tmp_path / "run"
        text = write_cfg(tmp_path, toolz_tasks, out, steps=2, kl=0.05, engine="vllm").read_text()
        text = text.replace("heldout = 1", "heldout = 0").replace(
            "tasks_per_step = 1", f'tasks_per_step = 2\nbase_urls = ["{a}/v1", "{b}/v1"]')
        p = tmp_path / "two-vllm.toml"
        p.write_text(text)
        run_pipeline(load_config(p, RLRunConfig), log=lambda m: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["policy_version"], r["staleness_max"]) for r in rows] == [(1, 1, 0.0), (2, 2, 0.0)]
    for r in rows:  # one group (k = 2) on each server, none split
        assert r["engine_episodes_0"] == r["engine_episodes_1"] == 2 and r["engines_up"] == 2, r
        assert r["failed_rollouts"] == 0 and r["engine_groups_split"] == 0
    assert rows[1]["engine_version_0"] == rows[1]["engine_version_1"] == 1
    # both servers loaded v0 (start) and v1 (before step 2), from the one directory each was written to
    for backend in backends:
        assert [Path(p).name for p in backend.loaded][:2] == ["v0", "v1"]
        assert backend.answers  # each sampled
    assert backends[0].loaded[1] == backends[1].loaded[1]


def test_a_second_server_of_another_model_is_refused_naming_it(toolz_tasks: Path, tmp_path: Path):
    backends = [Backend("tiny-random"), Backend("tiny-random-moe")]
    with serving(VLLMStandin(backends[0]).app) as a, serving(VLLMStandin(backends[1]).app) as b:
        text = write_cfg(tmp_path, toolz_tasks, tmp_path / "run", steps=1, kl=0.05, engine="vllm").read_text()
        text = text.replace("tasks_per_step = 1", f'tasks_per_step = 1\nbase_urls = ["{a}/v1", "{b}/v1"]')
        p = tmp_path / "mixed.toml"
        p.write_text(text)
        cfg = load_config(p, RLRunConfig)
        tasks = sorted(q for q in toolz_tasks.iterdir() if (q / "task.toml").exists())
        with pytest.raises(Exception, match=rf"rollout engine 1 \({b}/v1\): could not start: .*tiny-random-moe.*"
                                            r"not the run's model 'tiny-random'"):
            RLRun(cfg, tasks, tmp_path / "run")
