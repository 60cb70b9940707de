"""Live rollout progress (episode/progress.py): the plain lines a non-TTY gets, on a fake clock;
counts under threads; and collect_rollouts drawing it on stderr, never on stdout.

Run: ``pytest tests/unit/episode/test_progress.py`` (a few seconds; the last test runs two
tiny-random episodes in local sandboxes).
"""

from __future__ import annotations

import io
import threading

import pytest

from opencomposer.episode.progress import RolloutProgress, duration


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def lines(buf: io.StringIO) -> list[str]:
    return buf.getvalue().splitlines()


def test_non_tty_prints_episodes_tokens_per_second_and_eta_every_interval():
    buf, clock = io.StringIO(), Clock()
    p = RolloutProgress(8, "rollouts", stream=buf, interval=20.0, clock=clock, heartbeat=False).start()
    assert lines(buf) == ["[rollouts] 0/8 episodes, 0 tok/s, reward -, elapsed 0s, eta ?"]
    clock.t += 5
    p.add_tokens(400)
    p.episode_done(1.0)
    assert len(lines(buf)) == 1  # within the interval: quiet
    clock.t += 25  # 30 s in: 3000 tokens, 2 of 8 episodes done, one failed
    p.add_tokens(2600)
    p.episode_done(0.0, failed=True)
    assert lines(buf)[-1] == "[rollouts] 2/8 episodes (1 failed), 100 tok/s, reward 0.500, elapsed 30s, eta 1m30s"
    clock.t += 10
    p.tick()  # the heartbeat's call: 10 s since the last line, nothing yet
    assert len(lines(buf)) == 2
    clock.t += 15
    p.tick()  # 25 s since the last line: a line even though no episode ended
    assert lines(buf)[-1].startswith("[rollouts] 2/8 episodes (1 failed), 55 tok/s, reward 0.500, elapsed 55s")
    for _ in range(6):
        p.episode_done(1.0)
    p.close()
    assert lines(buf)[-1] == "[rollouts] 8/8 episodes (1 failed), 55 tok/s, reward 0.875, elapsed 55s, done"
    assert p.fields()["tokens"] == 3000


def test_the_heartbeat_speaks_when_no_episode_ends():
    buf = io.StringIO()
    with RolloutProgress(2, "eval", stream=buf, interval=0.05) as p:
        p.add_tokens(10)
        threading.Event().wait(0.4)  # no episode ends; the heartbeat still prints
    assert sum(l.startswith("[eval] 0/2 episodes") for l in lines(buf)) >= 3
    assert lines(buf)[-1].endswith("stopped")


def test_counts_are_exact_under_threads_and_a_plain_stream_gets_no_bar():
    buf = io.StringIO()
    p = RolloutProgress(64, stream=buf, interval=3600, heartbeat=False)  # rich=None: a StringIO is no TTY
    p.start()

    def work() -> None:
        for _ in range(8):
            for _ in range(100):
                p.add_tokens(3)
            p.episode_done(0.5)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    p.close()
    f = p.fields()
    assert (f["done"], f["tokens"], f["reward"]) == (64, 8 * 8 * 100 * 3, pytest.approx(0.5))
    assert "\x1b[" not in buf.getvalue() and lines(buf)[-1].startswith("[rollouts] 64/64 episodes")


def test_duration():
    assert [duration(s) for s in (0, 9.4, 65, 3725)] == ["0s", "9s", "1m05s", "1h02m05s"]


def test_collect_rollouts_shows_progress_on_stderr_only(tmp_path, capfd):
    from test_rollout import make_task  # tests/unit/episode/test_rollout.py: a real task dir

    from opencomposer.config import AgentConfig
    from opencomposer.episode.run import collect_rollouts, show_progress
    from opencomposer.models import load_model
    from opencomposer.policies.batched import BatchedPolicy
    from opencomposer.policies.model import ModelPolicy

    task = make_task(tmp_path / "t", "task-0")
    cfg = AgentConfig(max_turns=1, command_timeout=30)
    assert show_progress("rollouts", False) is None
    with BatchedPolicy(ModelPolicy(load_model("tiny-random"), max_new_tokens=6, seed=0)) as policy:
        rollouts = collect_rollouts([task], 2, policy, "local", cfg, max_concurrent=2,
                                    progress=show_progress("rollouts", True))
    out, err = capfd.readouterr()
    assert out == ""
    last = [l for l in err.splitlines() if l.startswith("[rollouts]")][-1]
    assert last.startswith("[rollouts] 2/2 episodes, ") and " tok/s, reward 0.000, " in last and last.endswith("done")
    assert sum(r.tokens.completion for r in rollouts) > 0


def test_live_tokens_count_turns_still_running_and_open_episodes_are_shown():
    """With a live count (the engine's generated tokens) the rate includes unfinished turns; episodes
    started and not done show as running, so a step waiting on its slowest episode says so."""
    buf, clock, generated = io.StringIO(), Clock(), [1000.0]  # the engine had generated 1000 before
    p = RolloutProgress(3, "rollouts", stream=buf, interval=20.0, clock=clock, heartbeat=False,
                        live_tokens=lambda: generated[0]).start()
    for _ in range(3):
        p.episode_started()
    clock.t += 20
    generated[0] += 800  # 800 tokens generated, no turn finished yet
    p.tick()
    assert lines(buf)[-1] == "[rollouts] 0/3 episodes, 3 running, 40 tok/s, reward -, elapsed 20s, eta ?"
    p.add_tokens(800)  # the turn ends: counted once, from the engine
    p.episode_done(1.0)
    p.episode_done(0.0)
    clock.t += 20
    p.tick()
    assert lines(buf)[-1] == "[rollouts] 2/3 episodes, 1 running, 20 tok/s, reward 0.500, elapsed 40s, eta 20s"
    p.live_tokens = lambda: 1 / 0
    p.episode_done(1.0)
    p.close()
    assert lines(buf)[-1] == "[rollouts] 3/3 episodes, 20 tok/s, reward 0.667, elapsed 40s, done"
