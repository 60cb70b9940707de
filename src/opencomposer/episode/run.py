"""One task episode, and K of them at once: the single path of ``agent``, ``eval`` and RL rollouts.

    result = run_task(task, make_policy("oracle", task=task), backend="namespace")
    result.reward.reward, result.trajectory.counts

    with make_policy("model:smollm2-135m", max_new_tokens=256, batch=8) as policy:
        rollouts = collect_rollouts(tasks, k=4, policy=policy, backend="namespace",
                                    cfg=AgentConfig(max_turns=20), max_concurrent=8,
                                    progress="rollouts")   # live progress on stderr
    rollouts[0].group, rollouts[0].index, rollouts[0].reward, rollouts[0].tokens

``run_task``: a sandbox from the task, the harness loop with a policy, then the agent's
changes are carried to a fresh sandbox and graded there (``grading/``); the monitors void a
flagged reward. ``collect_rollouts``: K ``run_task`` episodes per task, each in its own
thread; the model calls of all live episodes meet in a ``BatchedPolicy`` and are generated as
batches. Rollouts come back ordered by (group, index) whatever order they finished in; group
``g`` is ``tasks[g]``, so its K rollouts are the group that shares an advantage baseline.
Over several engines (``policies/fanout.py``) each episode enters ``policy.episode(group=key)``
with a key of its group's own, so the K rollouts of a task run on one engine
(``Rollout.engine``); an episode whose engine failed under it is a failed rollout.

An exception inside one rollout (a sandbox that cannot be made, a grader that crashes)
becomes a failed ``Rollout``: no result, reward 0, ``error`` set. It never stops the batch.

Token counts per rollout (``TokenCounts``), for throughput and behaviour metrics:

* ``thinking``: completion tokens outside ``<tool_call>`` blocks (prose, ``<think>``, the
  end-of-turn token); ``tool_call``: completion tokens inside them. Both come from the
  sampled ids themselves, so ``thinking + tool_call`` is the trajectory's completion count.
* ``tool_io``: observations fed back, estimated by tokenising each tool observation alone
  (the ``<tool_response>`` wrapping and chat markup are not counted).

Test: ``pytest tests/unit/episode/test_rollout.py tests/unit/episode/test_progress.py``,
``pytest tests/adversarial`` (every episode graded and monitored), ``pytest tests/integration/test_rl_run.py``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

from opencomposer.config import AgentConfig
from opencomposer.episode.progress import RolloutProgress
from opencomposer.grading import collect, grade
from opencomposer.harness.loop import Agent
from opencomposer.harness.trajectory import Step, Trajectory
from opencomposer.models.codec import TOOL_CALL_BLOCK
from opencomposer.policies.batched import BatchedPolicy
from opencomposer.policies.fanout import EngineSession, FanoutPolicy
from opencomposer.protocols import Policy, RewardResult, Sandbox, SandboxSpec
from opencomposer.rewards.changes import workspace_changes
from opencomposer.rewards.config import RewardConfig
from opencomposer.rewards.length import Usage
from opencomposer.rewards.lint import lint_delta
from opencomposer.rewards.monitors import monitor, void
from opencomposer.rewards.placement import placement
from opencomposer.rewards.shaping import ShapedReward, shape
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks.format import Task


SERVES_MANY = (BatchedPolicy, FanoutPolicy)  # policies that serve concurrent episodes (``episode()``)
_collections = itertools.count()  # numbers each collect_rollouts call, for its groups' keys


@dataclass
class EpisodeResult:
    task_id: str
    trajectory: Trajectory
    reward: RewardResult
    seconds: dict[str, float]
    flags: dict[str, list[str]] = field(default_factory=dict)  # the monitors' (the reward is voided when any)

    def summary(self) -> dict:
        c = self.trajectory.counts
        return {
            "task": self.task_id, "reward": self.reward.reward, "passed": self.reward.passed,
            "exit_reason": self.trajectory.exit_reason, "turns": c["turns"],
            "tool_calls": c["tool_calls"], "invalid_calls": c["invalid_calls"],
            "f2p_passed": self.reward.details.get("f2p_passed"),
            "p2p_passed": self.reward.details.get("p2p_passed"),
            "hacking_flagged": bool(self.flags), "flags": self.flags,
            "seconds": self.seconds,
        }


def run_task(task: Task, policy: Policy, backend: str = "auto", cfg: AgentConfig | None = None,
             transcript: Path | None = None, on_step: Callable[[Step], None] | None = None,
             sandboxes: Callable[[SandboxSpec], ContextManager[Sandbox]] | None = None) -> EpisodeResult:
    """One episode of ``task``; ``sandboxes`` (e.g. ``BlockingSandboxPool(...).lease`` or a Ray
    cluster's factory) supplies the sandboxes instead of a fresh ``make_sandbox(spec, backend)``.

    The agent works in one sandbox; its changes to the code under test are then graded in
    another, fresh one (``grading/``), and the monitors read the trajectory, the changes and
    the grader's findings: a flagged episode's reward is voided here, for every caller."""
    t0 = time.time()
    open_sandbox = sandboxes or (lambda spec: make_sandbox(spec, backend))
    with open_sandbox(task.sandbox_spec()) as sb:
        t1 = time.time()
        traj = Agent(sb, policy, cfg, on_step=on_step).run(task.instruction, task_id=task.id)
        t2 = time.time()
        # what the agent changed, the lint it added, and what of it reaches the grader
        changes = workspace_changes(task.workspace, sb)
        traj.meta["changes"] = changes.to_dict()
        traj.meta["lint"] = lint_delta(task.workspace, sb, changes).to_dict()
        carry = collect(task.workspace, sb, changes)
    agent = cfg or AgentConfig()
    reward = grade(task, carry, open_sandbox, timeout=agent.grade_timeout, fail_fast=agent.grade_fail_fast)
    t3 = time.time()
    gold = task.gold_patch
    report = monitor(traj, changes, carry=carry, base=task.workspace, grader=reward.details, allowed=gold)
    traj.meta["monitor"] = {"flagged": report.flagged, "flags": report.flags}
    if report.flagged:
        reward = void(reward, report)
    traj.meta["reward"] = {"reward": reward.reward, "passed": reward.passed, **reward.details}
    if gold:  # where the change sits against the gold's (a diagnostic: RL's rows average it)
        traj.meta["placement"] = placement(gold, carry.files, task.workspace)
    if transcript is not None:
        traj.save(transcript)
    secs = {"sandbox": round(t1 - t0, 3), "episode": round(t2 - t1, 3), "reward": round(t3 - t2, 3),
            "total": round(time.time() - t0, 3)}
    return EpisodeResult(task.id, traj, reward, secs, report.flags)


@dataclass
class TokenCounts:
    thinking: int = 0
    tool_call: int = 0
    tool_io: int = 0

    @property
    def completion(self) -> int:
        return self.thinking + self.tool_call


@dataclass
class Rollout:
    """One episode of a rollout batch; ``result`` is None when the episode raised."""

    task_id: str
    group: int  # index of the task in collect_rollouts' ``tasks``
    index: int  # 0..k-1 within the group
    result: EpisodeResult | None
    tokens: TokenCounts = field(default_factory=TokenCounts)
    invalid_calls: int = 0
    policy_versions: list[int] = field(default_factory=list)  # the weights that sampled its turns
    error: str = ""
    seconds: float = 0.0
    shaped: ShapedReward | None = None  # set by shape_rollouts: the reward the update uses
    engine: int | None = None  # several engines (FanoutPolicy): the one that ran it (its last turn's)

    @property
    def reward(self) -> float:
        """The task reward (hidden tests): what pass@k counts."""
        return self.result.reward.reward if self.result is not None else 0.0

    @property
    def failed(self) -> bool:
        return self.result is None

    @property
    def train_reward(self) -> float:
        """The shaped reward when shaping ran, else the task reward."""
        return self.shaped.total if self.shaped is not None else self.reward

    @property
    def usage(self) -> Usage:
        t = self.result.trajectory if self.result is not None else None
        return Usage(thinking=self.tokens.thinking, output=self.tokens.tool_call, tool_io=self.tokens.tool_io,
                     tool_calls=t.tool_calls if t else 0, turns=t.turns if t else 0)


def shape_rollouts(rollouts: list["Rollout"], cfg: RewardConfig) -> dict[str, float]:
    """Shape every rollout's reward (``rewards/shaping.py``); returns the mean of each term
    (``r_<term>``), the share of rollouts flagged (``hacking_flagged``) and the share each
    monitor flagged (``flag_<kind>``, only the kinds that fired).

    A failed rollout (no result) keeps reward 0 and pays no terms.
    """
    sums: dict[str, float] = {}
    kinds: dict[str, int] = {}  # monitor kind -> rollouts it flagged
    flagged = 0
    for ro in rollouts:
        if ro.result is None:
            continue
        r = ro.result.reward  # graded before run_task's voiding: [reward.monitors] decides for training
        ro.shaped = shape(r.details.get("graded_reward", r.reward), r.details.get("graded_passed", r.passed),
                          ro.result.trajectory, ro.usage, cfg)
        ro.result.trajectory.meta["shaped_reward"] = {"total": ro.shaped.total, **ro.shaped.terms,
                                                      "flags": ro.shaped.flags}
        flagged += bool(ro.shaped.flags)
        for kind in ro.shaped.flags:
            kinds[kind] = kinds.get(kind, 0) + 1
        for k, v in ro.shaped.terms.items():
            sums[k] = sums.get(k, 0.0) + v
    n = max(len(rollouts), 1)
    out = {f"r_{k}": v / n for k, v in sums.items()}
    out.update({f"flag_{k}": c / n for k, c in kinds.items()})
    out["shaped_reward_mean"] = sum(ro.train_reward for ro in rollouts) / n
    out["hacking_flagged"] = flagged / n
    return out


def collect_rollouts(
    tasks: list[Task],
    k: int,
    policy: BatchedPolicy | Policy,
    backend: str = "auto",
    cfg: AgentConfig | None = None,
    max_concurrent: int = 8,
    on_progress: Callable[[int, int], None] | None = None,
    sandboxes: Callable[[Any], Any] | None = None,
    progress: str | None = None,
) -> list[Rollout]:
    """Run ``k`` episodes of every task, ``max_concurrent`` at a time; see the module docstring.

    ``on_progress(done, total)`` is called after each episode, from the episode's thread,
    one call at a time and with ``done`` increasing. A plain ``ModelPolicy`` (one turn at a
    time, e.g. as a baseline) is accepted with ``max_concurrent=1`` only: it is not thread-safe.
    ``sandboxes`` (a ``BlockingSandboxPool(...).lease``, or a Ray cluster's factory) supplies
    each episode's sandbox instead of a fresh one per episode (see ``rl/episode.run_task``).
    ``progress``: a label to show live progress under on stderr (episodes done, tokens/s,
    reward, elapsed, ETA: ``episode/progress.py``), None for none. Whether this process shows
    it is the caller's decision: ``show_progress(label, show)``.
    """
    if k < 1 or max_concurrent < 1:
        raise ValueError(f"need k >= 1 and max_concurrent >= 1; got k={k}, max_concurrent={max_concurrent}")
    if not isinstance(policy, SERVES_MANY) and max_concurrent > 1:
        raise ValueError(f"{type(policy).__name__} serves one episode at a time; wrap it in "
                         f"BatchedPolicy for max_concurrent={max_concurrent}")
    # Group-major order: with fewer slots than episodes, whole groups finish early.
    jobs = [(g, i, task) for g, task in enumerate(tasks) for i in range(k)]
    collection = next(_collections)  # group g's key is (collection, g): its own, across calls
    lock, done = threading.Lock(), [0]
    shown = RolloutProgress(len(jobs), progress, live_tokens=generated_tokens(policy)) if progress and jobs else None
    on_step = (lambda step: shown.add_tokens(step.completion_tokens)) if shown is not None else None

    def one(job: tuple[int, int, Task]) -> Rollout:
        if shown is not None:
            shown.episode_started()
        rollout = _run_one(*job, policy, backend, cfg, sandboxes, on_step, key=(collection, job[0]))
        if shown is not None:
            shown.episode_done(rollout.reward, rollout.failed)
        if on_progress is not None:
            with lock:
                done[0] += 1
                on_progress(done[0], len(jobs))
        return rollout

    with shown if shown is not None else nullcontext(), \
            ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="rollout",
                               initializer=_episode_thread_start) as pool:
        return list(pool.map(one, jobs))


_EPISODE_NICE = [0]  # process-wide, as the engine it serves is (set_episode_nice)


def set_episode_nice(n: int) -> None:
    """From now on, each episode thread of this process (and every process it starts: sandboxes, their
    commands, the graders) runs ``n`` steps nicer than the process (0-19; 0: as the process). The built-in
    engine steps in a thread of the same process at the process's own priority, so when tools and graders
    fill every core the scheduler runs its next step first (``[rollout] episode_nice``)."""
    if not 0 <= n <= 19:
        raise ValueError(f"episode niceness must be 0-19, got {n}")
    _EPISODE_NICE[0] = n


def _episode_thread_start() -> None:
    """A ``collect_rollouts`` worker thread's start: lower its own priority by ``set_episode_nice``'s steps
    (Linux keeps the nice value per thread; what the thread forks inherits it)."""
    n = _EPISODE_NICE[0]
    if n and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + n))
        except OSError:  # a platform without per-thread nice values: the thread runs as the process does
            pass


def generated_tokens(policy: Any) -> Callable[[], float] | None:
    """A running count of the tokens the policy's built-in engine(s) generated, turns still running
    included (``Engine.stats``' ``generated_tokens``), for live progress; None without such an engine."""
    counts = getattr(policy, "engine_counts", None)  # BatchedPolicy, FanoutPolicy (several: summed)
    if counts is None or not counts():
        return None
    return lambda: float(counts().get("generated_tokens", 0.0))


def show_progress(label: str, show: bool) -> str | None:
    """``collect_rollouts``' ``progress`` argument: ``label`` when this process ``show``s progress
    (the caller asks ``train.distributed.shows_progress``: rank 0 alone under torchrun), else None."""
    return label if show else None


def versions_of(traj: Trajectory) -> list[int]:
    """The policy versions that sampled any token of ``traj`` (per token: ``Step.token_versions``), sorted."""
    return sorted({v for s in traj.steps for v in s.token_versions()})


def _run_one(group: int, index: int, task: Task, policy: BatchedPolicy | FanoutPolicy | Policy, backend: str,
             cfg: AgentConfig | None, sandboxes: Callable[[Any], Any] | None = None,
             on_step: Callable[[Step], None] | None = None, key: Any = None) -> Rollout:
    t0 = time.monotonic()
    session = None
    try:
        # the policy of this episode: its group's engine over several (FanoutPolicy); leaving
        # raises when that engine failed under it (the episode is void)
        with policy.episode(group=key) if isinstance(policy, SERVES_MANY) else nullcontext(policy) as session:
            result = run_task(task, session, backend, cfg, sandboxes=sandboxes, on_step=on_step)
        traj = result.trajectory
        return Rollout(
            task.id, group, index, result, tokens=token_counts(traj, policy.tokenizer),
            invalid_calls=traj.invalid_calls, policy_versions=versions_of(traj),
            seconds=time.monotonic() - t0, engine=_engine(session),
        )
    except Exception as e:  # one broken episode is a failed rollout, never a failed batch
        return Rollout(task.id, group, index, None, error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0,
                       engine=_engine(session))


def _engine(session: Any) -> int | None:
    return session.engine if isinstance(session, EngineSession) else None


# --------------------------------------------------------------------------- token kinds


def token_counts(traj: Trajectory, tokenizer: Any) -> TokenCounts:
    """Completion tokens by kind (thinking / tool_call) and the tool observations' size."""
    counts = TokenCounts()
    for step in traj.steps:
        inside = _tool_call_tokens(step, tokenizer)
        counts.tool_call += inside
        counts.thinking += _completion_size(step, tokenizer) - inside
    observations = [e.observation for s in traj.steps for e in s.tool_events if e.observation]
    if observations:
        counts.tool_io = sum(len(ids) for ids in tokenizer(observations, add_special_tokens=False)["input_ids"])
    return counts


def _completion_size(step: Step, tokenizer: Any) -> int:
    return len(step.token_ids) if step.token_ids else len(_encode(tokenizer, step.text))


def _tool_call_tokens(step: Step, tokenizer: Any) -> int:
    """How many completion tokens fall inside <tool_call> blocks (an unclosed last one too)."""
    if not step.token_ids:  # a policy without token ids (an API): tokenise the blocks
        return sum(len(_encode(tokenizer, m.group(0))) for m in TOOL_CALL_BLOCK.finditer(step.text))
    # step.text is the decoding of the ids without the final stop token (ModelPolicy),
    # so an unclosed last block cannot swallow the stop token.
    ids = step.token_ids[:-1] if step.finish_reason == "stop" else step.token_ids
    total = 0
    for m in TOOL_CALL_BLOCK.finditer(step.text):
        total += _tokens_before(ids, m.end(), tokenizer) - _tokens_before(ids, m.start(), tokenizer)
    return total


def _tokens_before(ids: list[int], char: int, tokenizer: Any) -> int:
    """The fewest leading tokens whose decoding reaches ``char`` characters.

    Exact per-token character offsets do not exist for sampled ids (byte-level tokens may
    split a character), so we binary-search on the length of decoded prefixes; a token
    that straddles a block edge goes to the side where it ends.
    """
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=False)) >= char:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
