"""BatchedPolicy and collect_rollouts on the real tiny-random model and real local sandboxes.

Run: ``pytest tests/unit/episode/test_rollout.py`` (about 40 s on 2 busy cores).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

from opencomposer.config import AgentConfig
from opencomposer.harness.trajectory import Step, ToolEvent, Trajectory
from opencomposer.policies.model import ModelPolicy
from opencomposer.protocols import ContextLengthError
from opencomposer.protocols import Message, Policy
from opencomposer.policies.batched import BatchedPolicy, BatchGenerationError
from opencomposer.episode.run import collect_rollouts, token_counts
from opencomposer.tasks.envs import adopt_env
from opencomposer.tasks.format import Task, TaskMeta, write_task_toml

STATS = "def mean(xs):\n    return sum(xs) / len(xs)\n"
DELETED = "def mean(xs):\n    raise NotImplementedError\n"
TEST = "from mathy.stats import mean\n\n\ndef test_mean():\n    assert mean([1, 3]) == 2\n"
GOLD = """--- a/mathy/stats.py
+++ b/mathy/stats.py
@@ -1,2 +1,2 @@
 def mean(xs):
-    raise NotImplementedError
+    return sum(xs) / len(xs)
"""


@pytest.fixture(scope="module")
def tiny():
    from opencomposer.models import load_model

    return load_model("tiny-random")


def conversation(n: int) -> list[Message]:
    return [Message("system", "You are a coding agent."), Message("user", "Fix the bug. " * n)]


def make_task(root: Path, task_id: str) -> Task:
    """A real task dir: a deleted function body, its hidden test, this interpreter's env."""
    (root / "workspace" / "mathy").mkdir(parents=True)
    (root / "workspace" / "mathy" / "__init__.py").write_text("")
    (root / "workspace" / "mathy" / "stats.py").write_text(DELETED)
    (root / "tests" / "files" / "tests").mkdir(parents=True)
    (root / "tests" / "files" / "tests" / "test_stats.py").write_text(TEST)
    (root / "solution").mkdir()
    (root / "solution" / "gold.patch").write_text(GOLD)
    (root / "instruction.md").write_text("Implement `mathy.stats.mean`.\n")
    meta = TaskMeta(
        id=task_id,
        source={"kind": "local", "spec": "mathy", "package": "mathy"},
        feature={"level": "body", "file": "mathy/stats.py", "symbol": "mathy.stats.mean"},
        # the test interpreter has pytest: linked into the environments root, the one place
        # outside a task its env may be
        environment={"env": os.path.relpath(adopt_env(root.parent, Path(sys.prefix)), root)},
        tests={"command": "python -m pytest -q", "files": ["tests/test_stats.py"],
               "targets": ["tests/test_stats.py::test_mean"], "fail_to_pass": ["tests/test_stats.py::test_mean"]},
    )
    write_task_toml(root / "task.toml", meta)
    return Task.load(root)


def act_concurrently(policy: BatchedPolicy, convs: list[list[Message]]) -> list:
    """Each conversation from its own live-episode thread; results (or exceptions) in order."""
    results: list = [None] * len(convs)
    for _ in convs:  # all live before any asks, so the first request waits for the rest
        policy.register()

    def one(i: int) -> None:
        try:
            results[i] = policy.act(convs[i], [])
        except Exception as e:
            results[i] = e
        finally:
            policy.unregister()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    return results


def test_batch_gives_each_request_its_own_output(tiny):
    inner = ModelPolicy(tiny, temperature=0.7, max_new_tokens=8, seed=0, policy_version=5)
    long = conversation(40)
    inner.max_context = len(inner.encode(long, [])) - 1  # that one request cannot fit
    convs = [conversation(1), conversation(5), long, conversation(12)]
    with BatchedPolicy(inner, max_batch=8, max_wait=10.0) as policy:  # only "all live pending" can fire
        assert isinstance(policy, Policy) and policy.name == "tiny-random"
        outs = act_concurrently(policy, convs)
        assert isinstance(outs[2], ContextLengthError)  # the caller's own error, nobody else's
        assert policy.batch_sizes == {3: 1}  # the others still formed one batch once it left
    for conv, out in zip(convs[:2] + convs[3:], outs[:2] + outs[3:]):
        assert out.prompt_tokens == len(inner.encode(conv, []))
        assert out.completion_tokens == len(out.token_ids) == len(out.logprobs) == 8
        assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)
        assert out.policy_version == 5 and out.finish_reason == "length"


def test_batched_greedy_equals_unbatched(tiny):
    """Left padding must not change a row: same ids and logprobs as ModelPolicy alone."""
    plain = ModelPolicy(tiny, temperature=0, max_new_tokens=10)
    convs = [conversation(1), conversation(9), conversation(25)]
    # The first row's first token becomes a stop token: it ends after one token while
    # the other rows go on, so each row must be cut at its own stop.
    plain.stop_ids = plain.stop_ids | {plain.act(convs[0], []).token_ids[0]}
    alone = [plain.act(c, []) for c in convs]
    with BatchedPolicy(plain, max_wait=10.0) as policy:
        together = act_concurrently(policy, convs)
        assert policy.batch_sizes == {3: 1}
    assert alone[0].finish_reason == "stop" and len(alone[0].token_ids) == 1
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason and b.text == a.text
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_generation_error_reaches_every_waiting_caller(tiny):
    inner = ModelPolicy(tiny, temperature=0.7, max_new_tokens=4)
    inner.temperature = -1.0  # past the constructor's check: generate itself rejects it
    with BatchedPolicy(inner, max_wait=10.0) as policy:
        outs = act_concurrently(policy, [conversation(1), conversation(2), conversation(3)])
        for e in outs:
            assert isinstance(e, BatchGenerationError) and "temperature" in str(e)
            assert e.__cause__ is not None
        inner.temperature = 0.7  # the worker survived and serves the next request
        assert len(policy.act(conversation(1), []).token_ids) == 4


def test_token_counts_split_thinking_tool_calls_and_observations(tiny):
    tok = tiny[1]
    prose, block = "Let me read it.\n", '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids = enc(prose) + enc(block) + [tok.eos_token_id]
    step = Step(turn=0, text=prose + block, token_ids=ids, finish_reason="stop",
                tool_events=[ToolEvent("c0", "read_file", {"path": "a.py"}, "x = 1\n", ok=True)])
    counts = token_counts(Trajectory(messages=[], steps=[step]), tok)
    assert counts.tool_call == len(enc(block))
    assert counts.thinking == len(enc(prose)) + 1  # the end-of-turn token counts as thinking
    assert counts.tool_io == len(enc("x = 1\n"))
    api_step = Step(turn=1, text=prose + block)  # no token ids: an API policy; tokenised instead
    assert token_counts(Trajectory(messages=[], steps=[api_step]), tok).tool_call == len(enc(block))


def test_collect_rollouts_runs_groups_concurrently(tiny, tmp_path):
    tasks = [make_task(tmp_path / f"t{i}", f"task-{i}") for i in range(2)]
    inner = ModelPolicy(tiny, temperature=1.0, max_new_tokens=12, seed=0, policy_version=3)
    progress: list[tuple[int, int]] = []
    cfg = AgentConfig(max_turns=2, command_timeout=30)
    with BatchedPolicy(inner, max_batch=6, max_wait=2.0) as policy:
        rollouts = collect_rollouts(tasks, 3, policy, "local", cfg, max_concurrent=6,
                                    on_progress=lambda d, t: progress.append((d, t)))
        sizes = dict(policy.batch_sizes)
        assert policy.stats["requests"] == sum(s * n for s, n in sizes.items()) and policy.stats["generate_seconds"] > 0
    assert [(r.task_id, r.group, r.index) for r in rollouts] == [
        (f"task-{g}", g, i) for g in range(2) for i in range(3)]
    assert progress == [(d, 6) for d in range(1, 7)]
    assert max(sizes) > 1, f"no batch had more than one request: {sizes}"
    turns = sum(r.result.trajectory.turns for r in rollouts)
    assert sum(size * n for size, n in sizes.items()) == turns  # every turn went through a batch
    for r in rollouts:
        assert not r.failed and r.error == "" and r.reward == 0.0  # a random model does not fix code
        traj = r.result.trajectory
        assert traj.exit_reason == "max_turns" and r.result.reward.details["f2p_passed"] == 0
        assert r.tokens.completion == traj.completion_tokens > 0
        assert r.invalid_calls == traj.invalid_calls and r.policy_versions == [3]


def test_a_broken_episode_is_a_failed_rollout_not_a_failed_batch(tiny, tmp_path):
    good, broken = make_task(tmp_path / "good", "good"), make_task(tmp_path / "broken", "broken")
    shutil.rmtree(broken.workspace)  # its sandbox cannot be made
    cfg = AgentConfig(max_turns=1, command_timeout=30)
    with BatchedPolicy(ModelPolicy(tiny, max_new_tokens=4, seed=0)) as policy:
        rollouts = collect_rollouts([broken, good], 1, policy, "local", cfg, max_concurrent=2)
    assert rollouts[0].failed and rollouts[0].reward == 0.0 and "workspace" in rollouts[0].error
    assert not rollouts[1].failed and rollouts[1].result.trajectory.turns == 1


def test_two_engines_run_each_group_on_one_and_a_failed_engine_voids_only_its_episodes(tiny, tmp_path):
    """Over a FanoutPolicy each group's K rollouts run on one engine (``Rollout.engine``); when
    engine 1's step raises, the rollouts whose turn was in it fail (no result: nothing to
    train on), the others finish, and the collection returns whole."""
    from opencomposer.inference.engine.core import Engine
    from opencomposer.policies.engine import EnginePolicy
    from opencomposer.policies.fanout import FanoutPolicy

    tasks = [make_task(tmp_path / f"t{i}", f"task-{i}") for i in range(2)]
    cfg = AgentConfig(max_turns=2, command_timeout=30)
    engines = [BatchedPolicy(EnginePolicy(Engine(*tiny), temperature=1.0, max_new_tokens=12, seed=i))
               for i in range(2)]
    with FanoutPolicy(engines, ["engine 0 (cpu)", "engine 1 (cpu)"]) as policy:
        rollouts = collect_rollouts(tasks, 2, policy, "local", cfg, max_concurrent=4)
        assert not any(r.failed for r in rollouts)
        on = {g: {r.engine for r in rollouts if r.group == g} for g in (0, 1)}
        assert on[0] | on[1] == {0, 1} and len(on[0]) == len(on[1]) == 1, on
        eng1 = engines[1].policy.engine
        real, calls = eng1.step, [0]

        def step():  # engine 1's next step dies; the engine object is real
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("CUDA error: device-side assert triggered")
            return real()

        eng1.step = step
        with pytest.warns(RuntimeWarning, match=r"rollout engine 1 \(cpu\) failed"):
            rollouts = collect_rollouts(tasks, 2, policy, "local", cfg, max_concurrent=4)
        assert [(r.group, r.index) for r in rollouts] == [(g, i) for g in range(2) for i in range(2)]
        failed = [r for r in rollouts if r.failed]
        assert failed and all(r.engine == 1 and "engine 1 (cpu) failed" in r.error and "CUDA error" in r.error
                              for r in failed)
        for r in rollouts:
            if not r.failed:  # the other group, and any of engine 1's between turns then (moved to engine 0)
                assert r.result.trajectory.exit_reason == "max_turns" and r.engine == 0
        assert policy.up == 1 and policy.figures()["engine_failures_1"] == 1


def test_live_progress_reads_the_engines_generated_tokens(tiny, tmp_path):
    """``generated_tokens``: the engine's running count (one engine, or several summed) grows by the
    tokens the rollouts sampled, so live progress counts turns still running; other policies: None."""
    from opencomposer.episode.run import generated_tokens
    from opencomposer.inference.engine.core import Engine
    from opencomposer.policies.engine import EnginePolicy
    from opencomposer.policies.fanout import FanoutPolicy

    tasks = [make_task(tmp_path / "t0", "task-0")]
    cfg = AgentConfig(max_turns=2, command_timeout=30)
    one = BatchedPolicy(EnginePolicy(Engine(*tiny), temperature=1.0, max_new_tokens=12, seed=0))
    two = FanoutPolicy([one, BatchedPolicy(EnginePolicy(Engine(*tiny), temperature=1.0, max_new_tokens=12, seed=1))],
                       ["engine 0 (cpu)", "engine 1 (cpu)"])
    with two:
        for policy in (one, two):
            count = generated_tokens(policy)
            before = count()
            rollouts = collect_rollouts(tasks, 2, policy, "local", cfg, max_concurrent=2)
            sampled = sum(len(s.token_ids) for r in rollouts for s in r.result.trajectory.steps)
            assert sampled > 0 and count() - before == sampled
    assert generated_tokens(object()) is None


def test_episode_threads_and_what_they_start_run_nicer_than_the_process():
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from opencomposer.episode import run as episode_run

    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base > 16:
        pytest.skip(f"this process already runs at niceness {base}")

    def seen() -> tuple[int, int]:  # this thread's nice value, and that of a process it starts
        child = subprocess.run(["sh", "-c", "cut -d' ' -f19 /proc/self/stat"], capture_output=True, text=True)
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), int(child.stdout)

    with pytest.raises(ValueError, match="0-19"):
        episode_run.set_episode_nice(20)
    try:
        episode_run.set_episode_nice(3)
        with ThreadPoolExecutor(1, initializer=episode_run._episode_thread_start) as pool:
            assert pool.submit(seen).result() == (base + 3, base + 3)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller's thread is as it was
    finally:
        episode_run.set_episode_nice(0)
    with ThreadPoolExecutor(1, initializer=episode_run._episode_thread_start) as pool:
        assert pool.submit(seen).result() == (base, base)
