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


def test_tasks_in_flight_are_not_saved_and_come_back_after_a_restart():
    """Batches collected ahead of the trainer: only tasks trained on count as used."""
    s = TaskSampler(pool(10), per_step=2, seed=3)
    a, b, c = s.issue(), s.issue(), s.issue()  # a trained, b and c in flight at the stop
    assert len({p.name for p in a + b + c}) == 6 and s.remaining == 4
    s.trained(a)
    with pytest.raises(ValueError, match="not in flight"):
        s.trained(a)  # a task is trained once
    resumed = TaskSampler.from_state(pool(10), s.state())
    assert resumed.used == [p.name for p in a]
    assert resumed.issue() + resumed.issue() == b + c  # handed out again, in the same order
    assert not {p.name for p in resumed.issue()} & {p.name for p in a + b + c}


def test_a_released_batch_is_handed_out_again_and_never_twice_at_once():
    s = TaskSampler(pool(6), per_step=2, seed=0)
    a, b = s.issue(), s.issue()
    s.release(a)  # dropped as too stale: not trained
    assert s.issue() == a and s.in_flight == [p.name for p in b + a]
    s.trained(b)
    s.trained(a)
    rest = s.issue()
    with pytest.raises(PoolExhausted, match="4 of 6 tasks used \\(2 more in flight\\)"):
        s.issue()
    s.trained(rest)
    assert sorted(s.used) == sorted(p.name for p in pool(6))


def test_the_sampler_is_shared_by_threads():
    """A rollout thread issues while the trainer marks batches trained: no task twice."""
    import threading

    s = TaskSampler(pool(400), per_step=1, seed=0)
    got: list[str] = []

    def take():
        for _ in range(100):
            [p] = s.issue()
            got.append(p.name)
            s.trained([p])

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == len(set(got)) == 400 == len(s.used) and s.remaining == 0
