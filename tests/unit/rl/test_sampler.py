"""Single-epoch sampler: no task twice, across a save/restore of its state."""

from pathlib import Path

import pytest

from opencomposer.rl.sampler import PoolExhausted, TaskSampler


def pool(n: int) -> list[Path]:
    return [Path(f"/tasks/t{i:02d}") for i in range(n)]


def test_no_task_twice_across_restart():
    s = TaskSampler(pool(10), per_step=3, seed=1)
    first = s.next_batch() + s.next_batch()
    resumed = TaskSampler.from_state(pool(10), s.state())
    rest = resumed.next_batch()
    names = [p.name for p in first + rest]
    assert len(set(names)) == 9
    with pytest.raises(PoolExhausted, match="never reuses a task"):
        resumed.next_batch()


def test_order_depends_on_seed_only():
    a = TaskSampler(pool(10), 2, seed=5).next_batch()
    b = TaskSampler(list(reversed(pool(10))), 2, seed=5).next_batch()
    assert a == b


def test_pool_smaller_than_a_batch():
    with pytest.raises(PoolExhausted, match="has 2 tasks but one RL step needs 3"):
        TaskSampler(pool(2), per_step=3)
