"""``RolloutsAhead``: the bound, the order, the stop, errors; and the config checks of
``[rollout] max_staleness``. The thread runs real Python callables (no model needed)."""

from __future__ import annotations

import threading
import time
import traceback

import pytest

from opencomposer.config import ConfigError, load_config
from opencomposer.rl.async_rollouts import RolloutsAhead, RolloutThreadError
from opencomposer.rl.config import RLRunConfig


class Producer:
    """Batches 0, 1, 2, ...; records how many batches were in flight (this one included) at each start."""

    def __init__(self):
        self.started = 0
        self.ahead: RolloutsAhead | None = None
        self.in_flight_at_start: list[int] = []

    def __call__(self) -> int:
        self.in_flight_at_start.append(self.ahead.in_flight)
        self.started += 1
        return self.started - 1


@pytest.mark.parametrize("ahead", [1, 2])
def test_batches_come_in_order_at_most_ahead_of_the_trainer_and_stop_at_total(ahead):
    p = Producer()
    r = p.ahead = RolloutsAhead(p, ahead=ahead, total=5)
    r.start()
    try:
        got = []
        for _ in range(5):
            time.sleep(0.05)  # a slow trainer: the thread fills its room, never more
            got.append(r.get()[0])
        assert got == [0, 1, 2, 3, 4] and max(p.in_flight_at_start) == ahead
        time.sleep(0.1)
        assert p.started == 5 and r.idle_seconds > 0  # no sixth batch nobody would train
        r.redo()  # a dropped batch is replaced
        assert r.get()[0] == 5
    finally:
        r.close()
    assert not r.alive


def test_an_error_in_the_thread_is_raised_by_get_with_its_traceback():
    def produce():
        raise KeyError("no such task")

    r = RolloutsAhead(produce, ahead=1, total=3).start()
    with pytest.raises(RolloutThreadError, match="KeyError") as e:
        r.get()
    assert isinstance(e.value.__cause__, KeyError)
    assert "in produce" in "".join(traceback.format_exception(e.value.__cause__))
    r.close()
    assert not r.alive


def test_close_interrupts_a_collection_in_progress():
    release, started = threading.Event(), threading.Event()

    def produce():  # a collection that ends only when interrupted (the policy closed)
        started.set()
        assert release.wait(10), "never interrupted"
        return "cut short"

    r = RolloutsAhead(produce, ahead=1, total=2, interrupt=release.set).start()
    assert started.wait(5)
    t0 = time.monotonic()
    r.close()
    assert not r.alive and time.monotonic() - t0 < 5


def write(tmp_path, text: str):
    p = tmp_path / "c.toml"
    p.write_text("[tasks]\ndir = 'x'\n" + text)
    return p


def test_max_staleness_needs_an_engine_with_its_own_weights(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "[rollout]\nmax_staleness = 1\n"), RLRunConfig)  # engine 'hf' by default
    assert "rollout.max_staleness" in str(e.value) and "rollout.engine='hf'" in str(e.value)
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        load_config(write(tmp_path, "[rollout]\nmax_staleness = -1\nengine = 'builtin'\n"), RLRunConfig)
    # LoRA ahead of the trainer: the engine takes the merged weights in flight (tests/integration/test_async_rl.py)
    assert load_config(write(tmp_path, "[rollout]\nmax_staleness = 1\nengine = 'builtin'\n[train]\nlora = true\n"),
                       RLRunConfig).train.lora
    cfg = load_config(write(tmp_path, "[rollout]\nmax_staleness = 2\nengine = 'builtin'\n"), RLRunConfig)
    assert cfg.rollout.max_staleness == 2 and RLRunConfig(tasks={"dir": "x"}).rollout.max_staleness == 0
