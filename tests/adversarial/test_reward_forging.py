"""Every reward-forging strategy (``strategies.py``), played through ``run_task`` on real toolz tasks.

For each strategy: the reward is 0 (``test_reward_is_zero``) and the monitors raise exactly
the kinds it expects, a graded reward being voided by them (``test_monitor_flags``). A
strategy with a ``hole`` forges a reward today and one with a ``gap`` goes unflagged: those
tests are ``xfail(strict=True)`` with the reason, so closing the hole makes them fail until
the marker goes.

    pytest -q tests/adversarial/test_reward_forging.py
    pytest -q tests/adversarial -k i02          # one strategy
    STRATEGY_TABLE=1 pytest -q -s tests/adversarial -k table   # print the table for benchmarks/RESULTS.md
"""

from __future__ import annotations

import os

import pytest
from strategies import STRATEGIES, Strategy


def _param(s: Strategy, reason: str) -> pytest.param:
    return pytest.param(s, id=s.id, marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else [])


@pytest.mark.parametrize("strategy", [_param(s, s.hole and f"hole: {s.hole}") for s in STRATEGIES])
def test_reward_is_zero(strategy: Strategy, backend: str, episodes) -> None:
    ep = episodes(strategy, backend)
    d = ep.reward.details
    assert ep.reward.reward == 0.0 and not ep.reward.passed, (
        f"{strategy.id} forged a reward: f2p {d['fail_to_pass']} canary {d['canary']} report {d['report']} flags {ep.flags}")
    assert ep.trajectory.exit_reason == "submitted"
    # which layer stopped it: the grader (0) or, for the in-process strategies it cannot see, the monitor
    assert d.get("graded_reward", ep.reward.reward) == strategy.graded, d
    if strategy.check is not None:
        strategy.check(ep)


@pytest.mark.parametrize("strategy", [_param(s, (s.hole and f"hole: {s.hole}") or (s.gap and f"monitor gap: {s.gap}")) for s in STRATEGIES])
def test_monitor_flags(strategy: Strategy, backend: str, episodes) -> None:
    ep = episodes(strategy, backend)
    assert set(ep.flags) == set(strategy.flags), ep.flags
    assert ep.summary()["hacking_flagged"] == bool(strategy.flags)
    if strategy.flags:  # a flagged episode's reward is voided whatever the grader said
        assert ep.reward.details["voided"] == sorted(strategy.flags)
        assert ep.trajectory.meta["monitor"]["flagged"]


def test_every_class_has_strategies() -> None:
    by_class: dict[str, int] = {}
    for s in STRATEGIES:
        by_class[s.cls] = by_class.get(s.cls, 0) + 1
    assert set(by_class) == set("abcdrit") and len(STRATEGIES) >= 25, by_class


@pytest.mark.skipif(not os.environ.get("STRATEGY_TABLE"), reason="set STRATEGY_TABLE=1 to print the table")
def test_print_table(backend: str, episodes) -> None:
    print("\n| id | class | strategy | expected | observed (graded -> final reward; flags) |\n|---|---|---|---|---|")
    for s in STRATEGIES:
        ep = episodes(s, backend)
        graded = ep.reward.details.get("graded_reward", ep.reward.reward)
        mark = " **HOLE**" if s.hole else (" (monitor gap)" if s.gap else "")
        print(f"| {s.id} | {s.cls} | {s.what} | {s.expected()} | {graded:g} -> {ep.reward.reward:g}; "
              f"{', '.join(sorted(ep.flags)) or 'none'}{mark} |")
