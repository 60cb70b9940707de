"""Reinforcement learning: the run loop (``run.py``), its actor (``actor.py``: tasks, rollouts,
scoring, publishing weights) and learner (``learner.py``: update, checkpoint, weights), which hand
each other only a batch and weights; group advantages, textual-feedback distillation, the
single-epoch task sampler and pool, asynchronous rollouts and their staleness, metrics.

    opencomposer train --config configs/train/demo.toml     # pipeline/run.py drives RLRun

Test: ``pytest tests/unit/rl tests/integration/test_rl_run.py``.
"""
