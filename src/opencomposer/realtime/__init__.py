"""The real-time loop: production sessions -> rewards -> train -> eval gate -> hot-swap.

Server side (``inference/``, so the server needs nothing from here): ``session_log.py``
(append-only JSONL per window) and ``front.py`` (sessions, A/B arms, ``/v1/feedback``,
``/admin/weights``). Here, in the order a cycle uses them:

    classifier.py   dissatisfied follow-up?  (n-gram logistic regression, shipped data/)
    rewards.py      window of logs -> reward per completion (documented formula)
    learn.py        logged tokens -> samples -> one epoch of clipped policy-gradient steps
    evaluate.py     checkpoint -> eval.run_suite results; eval.gate.compare
    deploy.py       the running server's admin API (arms, hot-swap)
    cycle.py        RealtimeLoop: one cycle, state file, --every scheduling
    ab_report.py    per-arm edit persistence, dissatisfied follow-ups, latency
    users.py        simulated users driving the served agent through the harness

    opencomposer realtime --config configs/realtime/realtime.toml [--once | --every 5h]
"""
