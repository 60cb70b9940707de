"""Episodes: one task through the harness and its reward, and many of them as RL rollouts.

    result = run_task(task, policy, backend)                          # run.py: sandbox, agent loop, reward
    rollouts = collect_rollouts(tasks, 4, policy, backend)            # rollout.py: K episodes per task
    rows = run_oracle(tasks, backend)                                  # oracle.py: the gold patch as an agent

Test: ``pytest tests/unit/episode/test_rollout.py tests/unit/episode/test_pooled_episode.py -q``; the
adversarial suite: ``pytest tests/adversarial -q``.
"""
