"""RL groups stay informative: zero-variance groups kept, skipped or resampled
(``[rollout] zero_variance``), and difficulty-aware task draws (``[tasks] sampling``)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from opencomposer.config import ConfigError, validate
from opencomposer.rl.actor import Actor, Published
from opencomposer.rl.transcripts import KeptTranscripts
from opencomposer.rl.advantages import is_zero_variance, split_groups
from opencomposer.rl.config import RLRunConfig, RolloutSection, TasksSection
from opencomposer.rl.sampler import Informative, PoolExhausted, TaskSampler
from opencomposer.rl.taskpool import task_sampler, task_stratum

# ------------------------------------------------------------------ zero-variance groups


def test_zero_variance_detection_and_counts():
    assert is_zero_variance([1.0, 1.0, 1.0]) and is_zero_variance([0.0, 0.0])
    assert is_zero_variance([0.1, 0.1 + 1e-9]) and not is_zero_variance([0.0, 1.0])
    with pytest.raises(ValueError, match="empty"):
        is_zero_variance([])
    split = split_groups({"pass": [1.0] * 4, "fail": [0.0] * 4, "mixed": [1.0, 0.0, 0.0, 1.0],
                          "shaped": [0.9, 0.7, 0.9, 0.9]},
                         task_rewards={"pass": [1.0] * 4, "fail": [0.0] * 4, "mixed": [1.0, 0.0, 0.0, 1.0],
                                       "shaped": [1.0] * 4})
    assert split.informative == ["mixed", "shaped"] and split.zero_variance == ["pass", "fail"]
    # all-pass by the task reward: a length penalty that differs makes "shaped" informative all the same
    assert split.all_pass == ["pass", "shaped"] and split.all_fail == ["fail"]
    assert split.metrics() == {"groups_informative": 2.0, "groups_zero_variance": 2.0,
                               "groups_all_pass": 2.0, "groups_all_fail": 1.0}


@dataclass
class FakeRollout:
    """What collect_batch and score read of a rollout (no episode: no samples)."""

    task_id: str
    reward: float
    result: None = None
    policy_versions: list[int] = field(default_factory=list)

    @property
    def train_reward(self) -> float:
        return self.reward


def fake_actor(monkeypatch, outcomes: dict[str, list[float]], pool: int, tasks_per_step: int = 2,
               **rollout) -> Actor:
    """An Actor with only what collect_batch uses; task tNN's K rollouts get ``outcomes[tNN]``
    (default: all fail)."""
    monkeypatch.setattr("opencomposer.rl.actor.shape_rollouts", lambda ros, cfg: {"r_x": float(len(ros))})
    cfg = RLRunConfig(tasks={"dir": "t"}, rollout={"k": 2, "tasks_per_step": tasks_per_step, **rollout})
    a = Actor.__new__(Actor)
    a.cfg, a.tokenizer, a.tools, a.pool, a.harder, a.external = cfg, None, [], None, None, None
    a.weights = SimpleNamespace(version=0)
    a.policy = SimpleNamespace(policy_version=0, stats={}, engine_counts=dict)  # a BatchedPolicy without an engine
    a.sampler = TaskSampler([Path(f"/tasks/t{i:02d}") for i in range(pool)], tasks_per_step, seed=0)
    a.kept = KeptTranscripts(Path("unused"), "none")  # (fake rollouts have no transcripts to keep)
    a.rolled = []

    def roll(paths):
        a.rolled.append([p.name for p in paths])
        return [p.name for p in paths], [FakeRollout(p.name, r) for p in paths
                                         for r in outcomes.get(p.name, [0.0, 0.0])]

    a._roll = roll
    return a


MIXED = [1.0, 0.0]


def test_keep_trains_on_every_group_and_counts_the_zero_variance_ones(monkeypatch):
    a = fake_actor(monkeypatch, {}, pool=6)  # every group all-fail
    batch = a.collect_batch()
    assert [p.name for p in batch.paths] == a.sampler.order[:2] and len(batch.rollouts) == 4 == len(batch.drawn)
    assert batch.groups["groups_zero_variance"] == 2 and batch.groups["groups_all_fail"] == 2
    assert batch.groups["groups_trained"] == 2 and batch.groups["groups_resampled"] == 0
    assert batch.train.rollouts == 4


def test_skip_drops_exactly_the_zero_variance_groups(monkeypatch):
    outcomes = {f"t{i:02d}": MIXED for i in range(0, 10, 2)}  # even tasks informative, odd all-fail
    outcomes.update({"t03": [1.0, 1.0]})  # all-pass
    a = fake_actor(monkeypatch, outcomes, pool=10, tasks_per_step=4, zero_variance="skip")
    batch = a.collect_batch()
    drawn = [p.name for p in batch.paths]
    assert len(drawn) == 4 and len(a.rolled) == 1  # skip draws nothing more
    informative = [n for n in drawn if n in outcomes and outcomes[n] == MIXED]
    assert {ro.task_id for ro in batch.rollouts} == set(informative)
    assert len(batch.rollouts) == 2 * len(informative) and batch.train.rollouts == len(batch.rollouts)
    assert {ro.task_id for ro in batch.drawn} == set(drawn)
    g = batch.groups
    assert g["groups_zero_variance"] == 4 - len(informative) == 4 - g["groups_trained"]
    assert g["groups_all_pass"] == ("t03" in drawn) and g["groups_drawn"] == 4
    # every task drawn counts as used once trained, its group left out or not (single epoch)
    a.sampler.trained(batch.paths, batch.outcomes)
    assert sorted(a.sampler.used) == sorted(drawn) and batch.task_ids == drawn
    assert batch.outcomes == {n: outcomes.get(n, [0.0, 0.0]) for n in drawn}


def test_zero_variance_on_the_task_reward_leaves_out_groups_that_differ_only_in_shaping(monkeypatch):
    """Session 41's run: 15 of 16 groups a step failed every test but differed in shaping terms (+-0.02-0.05), so
    all were trained on; judged on the task reward, only the groups with a pass and a fail are."""
    shaping = {"t00": [0.0, -0.05], "t01": [0.0, -0.02]}  # t00 all fail, shaped apart; t01 a pass and a fail

    @dataclass
    class Shaped(FakeRollout):
        offset: float = 0.0

        @property
        def train_reward(self) -> float:
            return self.reward + self.offset

    def actor(**rollout):
        a = fake_actor(monkeypatch, {}, pool=2, tasks_per_step=2, zero_variance="skip", **rollout)
        outcomes = {"t00": [0.0, 0.0], "t01": MIXED}

        def roll(paths):
            return [p.name for p in paths], [Shaped(p.name, r, offset=o) for p in paths
                                             for r, o in zip(outcomes[p.name], shaping[p.name])]
        a._roll = roll
        return a

    by_shaped = actor().collect_batch()
    assert {ro.task_id for ro in by_shaped.rollouts} == {"t00", "t01"} and by_shaped.groups["groups_trained"] == 2
    by_task = actor(zero_variance_on="task").collect_batch()
    assert {ro.task_id for ro in by_task.rollouts} == {"t01"} and by_task.groups["groups_trained"] == 1
    assert by_task.groups["groups_all_fail"] == 1 and len(by_task.drawn) == 4
    with pytest.raises(ValueError, match=r"zero_variance_on='task' .* rollout.zero_variance is 'keep'"):
        RolloutSection(zero_variance_on="task")


def test_skip_of_every_group_leaves_an_empty_update(monkeypatch):
    a = fake_actor(monkeypatch, {}, pool=4, zero_variance="skip")
    batch = a.collect_batch()
    assert batch.rollouts == [] and batch.samples == [] and batch.train.rollouts == 0
    assert len(batch.drawn) == 4 and batch.groups["groups_trained"] == 0


def test_resample_draws_replacements_until_the_batch_is_informative(monkeypatch):
    a = fake_actor(monkeypatch, {}, pool=20, tasks_per_step=2, zero_variance="resample", max_resample_rounds=10)
    order = a.sampler.order
    # the 1st and 4th tasks of the seeded order are informative, the others all fail
    outcomes = {order[0]: MIXED, order[3]: MIXED}
    a = fake_actor(monkeypatch, outcomes, pool=20, tasks_per_step=2, zero_variance="resample",
                   max_resample_rounds=10)
    batch = a.collect_batch()
    assert a.rolled == [order[0:2], order[2:3], order[3:4]]  # one missing group, one task a round
    assert [p.name for p in batch.paths] == order[:4]
    assert {ro.task_id for ro in batch.rollouts} == {order[0], order[3]}
    assert batch.groups["groups_resampled"] == 2 and batch.groups["resample_rounds"] == 2
    assert batch.groups["groups_drawn"] == 4 and batch.groups["groups_trained"] == 2
    assert batch.shaping == {"r_x": 4 / 8 * 4 + 2 / 8 * 2 + 2 / 8 * 2}  # pooled over the three collections


def test_resample_stops_at_the_rounds_the_cap_and_the_pool_end(monkeypatch):
    # all fail: rounds bound it
    a = fake_actor(monkeypatch, {}, pool=20, tasks_per_step=2, zero_variance="resample", max_resample_rounds=3)
    batch = a.collect_batch()
    assert len(a.rolled) == 4 and batch.groups["groups_resampled"] == 6 and batch.rollouts == []
    # the cap on extra groups
    a = fake_actor(monkeypatch, {}, pool=20, tasks_per_step=2, zero_variance="resample", max_resample_rounds=9,
                   max_resample_groups=3)
    batch = a.collect_batch()
    assert [len(r) for r in a.rolled] == [2, 2, 1] and batch.groups["groups_resampled"] == 3
    # the pool's end: what is left, then stop; the next step finds the pool exhausted
    a = fake_actor(monkeypatch, {}, pool=5, tasks_per_step=2, zero_variance="resample", max_resample_rounds=9)
    batch = a.collect_batch()
    assert [len(r) for r in a.rolled] == [2, 2, 1] and len(batch.paths) == 5
    assert batch.groups["resample_rounds"] == 2 and batch.groups["groups_trained"] == 0
    a.sampler.trained(batch.paths, batch.outcomes)
    with pytest.raises(PoolExhausted):
        a.sampler.issue()
    # rounds = 0: resample is skip
    a = fake_actor(monkeypatch, {}, pool=6, zero_variance="resample", max_resample_rounds=0)
    assert len(a.collect_batch().paths) == 2 and len(a.rolled) == 1


def test_the_row_counts_groups_and_its_pass_rate_is_of_every_group_drawn(monkeypatch):
    outcomes = {f"t{i:02d}": [1.0, 1.0] for i in range(10)}  # every group all-pass
    a = fake_actor(monkeypatch, outcomes, pool=10, zero_variance="skip")
    batch = a.collect_batch()
    train = {"samples": 0.0, "staleness_mean": 0.0, "staleness_max": 0.0, "skipped": 1.0}
    row = a.report(1, batch, train, Published(train_s=0.0, publish_s=0.0, step_s=0.0, rollout_idle_s=0.0, sync={}))
    assert row["pass@1"] == 1.0 and row["tasks"] == 2  # not the (empty) trained part
    assert row["groups_zero_variance"] == 2 == row["groups_all_pass"] and row["groups_trained"] == 0
    assert row["update_skipped"] and row["task_ids"] == [p.name for p in batch.paths]


def test_the_zero_variance_settings():
    r = RolloutSection()
    assert r.zero_variance == "keep" and r.max_resample_rounds == 4 and r.max_resample_groups is None
    with pytest.raises(ConfigError, match="zero_variance"):
        validate({"zero_variance": "drop"}, RolloutSection, "run.toml")
    with pytest.raises(ConfigError, match="max_resample_groups"):
        validate({"max_resample_groups": 0}, RolloutSection, "run.toml")


# ------------------------------------------------------------------ informative sampling


def two_levels(n: int = 100) -> tuple[list[Path], dict[str, str]]:
    paths = [Path(f"/tasks/{lv}{i:03d}") for lv in "AB" for i in range(n)]
    return paths, {p.name: p.name[0] for p in paths}


def informative(paths, strata, per_step=2, seed=0, **kw) -> TaskSampler:
    return TaskSampler(paths, per_step, seed, stratum=lambda p: strata[Path(p).name],
                       informative=Informative(**kw))


def feed(s: TaskSampler, steps: int) -> Counter:
    """``steps`` synthetic updates: level A passes 95% of its rollouts, level B 50%; the levels drawn."""
    drawn: Counter = Counter()
    for _ in range(steps):
        batch = s.issue()
        drawn.update(p.name[0] for p in batch)
        s.trained(batch, {p.name: [1.0] * 19 + [0.0] if p.name[0] == "A" else [1.0, 0.0] * 10 for p in batch})
    return drawn


def test_informative_prefers_the_stratum_near_the_target_and_still_explores():
    paths, strata = two_levels()
    s = informative(paths, strata)
    feed(s, 5)  # a few updates
    assert s.estimate("A") > 0.85 and abs(s.estimate("B") - 0.5) < 0.05
    wa, wb = s.weights(["A", "B"])
    assert wb > 10 * wa and wa >= 0.1 / 2  # the exploration floor: explore / strata
    later = feed(s, 40)
    assert later["B"] > 5 * later["A"] and later["A"] >= 1, later  # seed 0: 73 B, 7 A
    assert s.metrics() == {"pass_est_A": round(s.estimate("A"), 4), "pass_est_B": round(s.estimate("B"), 4)}


def test_an_untried_stratum_starts_at_the_target_and_strata_weigh_the_same():
    paths, strata = two_levels(50)
    s = informative(paths, strata, explore=0.0)
    assert s.estimate("A") == s.estimate("B") == 0.5 and s.weights(["A", "B"]) == [0.5, 0.5]
    first = feed(s, 10)
    assert first["A"] and first["B"]  # both tried before the estimates settle


def test_informative_state_round_trips_and_a_resumed_run_draws_the_same():
    paths, strata = two_levels()
    s = informative(paths, strata, seed=3)
    feed(s, 6)
    state = json.loads(json.dumps(s.state()))  # as a checkpoint keeps it
    assert set(state["estimates"]) == {"A", "B"}
    resumed = TaskSampler.from_state(paths, state, stratum=lambda p: strata[Path(p).name], informative=Informative())
    assert resumed.evidence == s.evidence and resumed.used == s.used
    for _ in range(10):
        a, b = s.issue(), resumed.issue()
        assert a == b
        out = {p.name: [1.0, 0.0, 0.0] for p in a}
        s.trained(a, out)
        resumed.trained(b, out)
    assert resumed.state() == s.state()
    # no task twice, tasks in flight at a stop are not saved
    assert len(set(s.used)) == len(s.used)
    c = s.issue()
    again = TaskSampler.from_state(paths, s.state(), stratum=lambda p: strata[Path(p).name],
                                   informative=Informative())
    assert again.issue() == c  # drawn again, with the same estimates and draw index


def test_uniform_mode_keeps_its_state_and_order():
    paths, _ = two_levels(5)
    u = TaskSampler(paths, 2, seed=1)
    plain = TaskSampler(paths, 2, seed=1)
    batch = u.issue()
    u.trained(batch, {p.name: [1.0] for p in batch})  # results are ignored when uniform
    assert u.state() == {"seed": 1, "per_step": 2, "used": [p.name for p in batch]}
    assert batch == plain.next_batch() and u.metrics() == {}
    with pytest.raises(ValueError, match="stratum function"):
        TaskSampler(paths, 2, informative=Informative())
    with pytest.raises(ValueError, match="0 < target < 1"):
        Informative(target=1.0)


def test_extended_pool_composes_with_informative_draws():
    """HarderTasks extends the pool; a new level starts at the target and is drawn soon."""
    paths, strata = two_levels(30)
    s = informative(paths, strata)
    for _ in range(6):  # both known levels turn out easy
        batch = s.issue()
        s.trained(batch, {p.name: [1.0] * 10 for p in batch})
    new = [Path(f"/tasks/C{i:03d}") for i in range(20)]
    strata.update({p.name: "C" for p in new})
    assert s.extend(new) == 20
    drawn = Counter(p.name[0] for _ in range(5) for p in s.next_batch())
    assert drawn["C"] >= 6, drawn  # seed 0: 8 of 10
    assert s.issue(100, allow_fewer=True) and s.remaining == 0  # allow_fewer: the rest of the pool
    assert s.issue(3, allow_fewer=True) == []


def write_task_toml(d: Path, level: str, spec: str, package: str = "") -> Path:
    d.mkdir(parents=True)
    (d / "task.toml").write_text(f'id = "{d.name}"\n[source]\nspec = "{spec}"\npackage = "{package}"\n'
                                 f'[feature]\nlevel = "{level}"\nfile = "f.py"\nsymbol = "f"\n')
    return d


def test_task_stratum_and_the_runs_sampler_from_the_config(tmp_path: Path):
    a = write_task_toml(tmp_path / "a", "body", "more-itertools==10.5.0")
    b = write_task_toml(tmp_path / "b", "class", "/srcs/minilib", package="minilib")
    c = write_task_toml(tmp_path / "c", "function", "/srcs/toolz-0.12/")
    assert task_stratum(a) == "body" and task_stratum(b, ["level", "library"]) == "class/minilib"
    assert task_stratum(a, ["library"]) == "more-itertools" and task_stratum(c, ["library"]) == "toolz-0.12"
    (tmp_path / "bad").mkdir()
    with pytest.raises(ValueError, match="bad/task.toml: cannot read feature.level"):
        task_stratum(tmp_path / "bad")

    cfg = validate({"dir": str(tmp_path), "sampling": "informative", "strata": ["level", "library"],
                    "target_pass_rate": 0.4, "estimate_decay": 1.0}, TasksSection, "run.toml")
    s = task_sampler(cfg, [a, b, c], 1, seed=0)
    assert s.informative == Informative(target=0.4, decay=1.0) and s.stratum_of("b") == "class/minilib"
    s.trained(s.issue(), {"a": [1.0, 1.0], "b": [0.0, 1.0], "c": [0.0, 0.0]})
    resumed = task_sampler(cfg, [a, b, c], 1, seed=0, state=json.loads(json.dumps(s.state())))
    assert resumed.evidence == s.evidence and resumed.used == s.used
    assert task_sampler(TasksSection(dir="t"), [a, b, c], 1, seed=0).informative is None
    with pytest.raises(ConfigError, match="target_pass_rate"):
        validate({"dir": "t", "target_pass_rate": 1.0}, TasksSection, "run.toml")
    with pytest.raises(ConfigError, match="strata"):
        validate({"dir": "t", "strata": ["size"]}, TasksSection, "run.toml")
