"""``Scheduler``: how many waiting prompts one prefill step admits, and chunked prefill."""

from __future__ import annotations

from opencomposer.inference.engine.block_manager import BlockManager
from opencomposer.inference.engine.scheduler import Scheduler
from opencomposer.inference.engine.sequence import SamplingParams, Sequence, Status


def _scheduler(max_num_seqs: int, budget: int) -> Scheduler:
    return Scheduler(BlockManager(num_blocks=256, block_size=16), max_num_seqs, budget)


def test_one_prefill_step_admits_up_to_max_num_seqs_prompts():
    """Eight agent turns arriving together are one prefill step (an admitted sequence used to
    count twice, so a step took at most half of max_num_seqs)."""
    s = _scheduler(max_num_seqs=8, budget=8192)
    seqs = [Sequence(str(i), list(range(1000 * i, 1000 * i + 100)), SamplingParams()) for i in range(10)]
    for seq in seqs:
        s.add(seq)
    batch = s.schedule()
    assert not batch.decode and batch.seqs == seqs[:8] and batch.chunks == [100] * 8
    assert all(q.status is Status.RUNNING for q in seqs[:8]) and list(s.waiting) == seqs[8:]
    for q in seqs[:8]:
        q.num_computed = len(q)
    assert s.schedule().decode  # no slot left: the other two wait for one
    s.finish(seqs[0])
    batch = s.schedule()
    assert not batch.decode and batch.seqs == [seqs[8]]


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    s = _scheduler(max_num_seqs=4, budget=64)
    long, short = Sequence("a", list(range(1, 151)), SamplingParams()), Sequence("b", [5] * 10, SamplingParams())
    s.add(long)
    s.add(short)
    for _ in range(2):
        batch = s.schedule()
        assert batch.seqs == [long] and batch.chunks == [64]  # the budget is spent: the short one waits
        long.num_computed += 64
        assert long.status is Status.WAITING
    batch = s.schedule()  # the long prompt's last 22 tokens, and the short prompt in the budget left
    assert batch.seqs == [long, short] and batch.chunks == [22, 10]
    assert long.status is Status.RUNNING and short.status is Status.RUNNING


def test_samples_of_one_prompt_in_one_step_compute_it_once():
    """n rollouts of one prompt submitted together: the first computes the prompt's full
    blocks, the others reuse them in the same step and compute only the rest."""
    s = _scheduler(max_num_seqs=8, budget=8192)
    prompt = list(range(1, 101))  # 6 full blocks of 16 and 4 tokens
    other = Sequence("other", list(range(500, 600)), SamplingParams())
    seqs = [Sequence(str(i), list(prompt), SamplingParams()) for i in range(3)]
    for seq in (seqs[0], other, *seqs[1:]):
        s.add(seq)
    batch = s.schedule()
    assert batch.seqs == [seqs[0], other, *seqs[1:]] and batch.chunks == [100, 100, 4, 4]
    assert [q.num_computed for q in seqs] == [0, 96, 96] and other.num_computed == 0
    assert seqs[1].block_table[:6] == seqs[2].block_table[:6] == seqs[0].block_table[:6]
    assert len(set(seqs[0].block_table[6:] + seqs[1].block_table[6:] + seqs[2].block_table[6:])) == 3  # own tails
    assert s.blocks.ref[seqs[0].block_table[0]] == 3


def test_blocks_published_for_a_step_that_never_ran_are_withdrawn():
    """A sequence scheduled (its blocks published for the step) and finished before the step
    ran leaves nothing reusable: its K/V was never written."""
    s = _scheduler(max_num_seqs=4, budget=8192)
    prompt = list(range(1, 101))
    first = Sequence("a", list(prompt), SamplingParams())
    s.add(first)
    s.schedule()
    s.finish(first)  # never run
    again = Sequence("b", list(prompt), SamplingParams())
    s.add(again)
    batch = s.schedule()
    assert again.num_computed == 0 and batch.chunks == [100]
    assert s.blocks.num_used == len(again.block_table)
