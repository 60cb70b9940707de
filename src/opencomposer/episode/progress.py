"""Live progress of a batch of episodes: done/total, generated tokens/s, reward so far, elapsed, ETA.

    with RolloutProgress(total=32, label="rollouts") as p:   # collect_rollouts(..., progress="rollouts")
        p.add_tokens(step.completion_tokens)                  # per model turn, from any thread
        p.episode_done(reward=1.0, failed=False)              # per episode, from any thread

Everything goes to stderr: stdout carries the commands' result (their last line is the JSON).
On a terminal (stderr a TTY) it is a rich bar redrawn in place; elsewhere (CI, a log file,
``2>&1 | tee``) it is one plain line at the start, one every ``interval`` seconds (20 s by
default) and one at the end. A heartbeat thread prints the periodic line even when no episode
finished in between, so the console is never silent for minutes:

    [rollouts] 12/32 episodes (1 failed), 842 tok/s, reward 0.417, elapsed 1m05s, eta 1m48s

``tok/s`` counts the tokens generated since the start over the wall time since the start: read
from the engine as it generates when the caller gives ``live_tokens`` (a running count, e.g. the
built-in engine's ``generated_tokens``: unfinished turns count too), else the completion tokens of
every finished model turn (``Step.completion_tokens``); ``reward`` is the mean task reward of the
finished episodes (a failed one counts 0); ``eta`` is elapsed x (total - done) / done. Episodes
announced with ``episode_started`` and not yet done show as ``N running`` (a step waiting on its
slowest episode says so: ``127/128 episodes, 1 running``).

Cheap and threadsafe: a lock and a few integer adds per model turn and per episode; the drawing
happens on rich's refresh thread or the heartbeat thread (a line at most every ``interval``). Only
one rich display may be live at a time, and only the main thread starts one: a second display,
or one started in a background thread (rollouts running ahead of the learner, whose step lines
must not be torn by a redrawn bar), prints plain lines instead.

Which process shows progress is its caller's decision (under torchrun rank 0 alone:
``train.distributed.shows_progress``); this module only draws.

Test: ``pytest tests/unit/episode/test_progress.py``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

_LIVE = threading.Lock()  # held by the one rich display that is live


def duration(seconds: float) -> str:
    """``65`` -> ``1m05s``, ``3725`` -> ``1h02m05s``, ``9`` -> ``9s``."""
    s = max(int(round(seconds)), 0)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"


class RolloutProgress:
    """See the module docstring. ``rich``: None decides by the stream (a TTY, the main thread, no
    other live display); ``clock`` and ``heartbeat=False`` are for tests (a fake clock, ``tick``
    called by hand)."""

    def __init__(self, total: int, label: str = "rollouts", *, stream: IO[str] | None = None,
                 rich: bool | None = None, interval: float = 20.0,
                 clock: Callable[[], float] = time.monotonic, heartbeat: bool = True,
                 live_tokens: Callable[[], float] | None = None):
        self.total, self.label, self.interval, self.clock = int(total), label, float(interval), clock
        self.stream = stream if stream is not None else sys.stderr
        self.done = self.failed = self.tokens = self.started = 0
        self.live_tokens, self._live0 = live_tokens, 0.0
        self.reward_sum = 0.0
        self._rich, self._heartbeat = rich, heartbeat
        self._lock = threading.Lock()
        self._t0 = self._last = 0.0
        self._bar: Any = None
        self._task: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ fed by the episodes

    def add_tokens(self, n: int) -> None:
        """``n`` completion tokens generated (a model turn ended)."""
        with self._lock:
            self.tokens += int(n)

    def episode_started(self) -> None:
        """One episode began (optional: without it no ``running`` count is shown)."""
        with self._lock:
            self.started += 1

    def _generated(self) -> int:
        """Tokens generated since the start: the live count when there is one (and it answers)."""
        if self.live_tokens is not None:
            try:
                return max(int(self.live_tokens() - self._live0), 0)
            except Exception:  # noqa: BLE001 -- an engine that cannot say: the finished turns' count
                self.live_tokens = None
        return self.tokens

    def episode_done(self, reward: float, failed: bool = False) -> None:
        """One episode ended (``failed``: it raised; its reward counts 0)."""
        with self._lock:
            self.done += 1
            self.failed += bool(failed)
            self.reward_sum += 0.0 if failed else float(reward)
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done)
        if self._bar is None:
            self.tick()

    # ------------------------------------------------------------------ what it says

    def fields(self, now: float | None = None) -> dict[str, Any]:
        """The figures of the line, at ``now`` (the clock's time by default)."""
        now = self.clock() if now is None else now
        elapsed = max(now - self._t0, 0.0)
        done, tokens = self.done, self._generated()
        return {"done": done, "total": self.total, "failed": self.failed, "tokens": tokens,
                "running": max(self.started - done, 0),
                "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
                "reward": self.reward_sum / done if done else None, "elapsed": elapsed,
                "eta": elapsed * (self.total - done) / done if done else None}

    def stats_text(self, now: float | None = None, final: bool = False) -> str:
        """Everything but ``done/total``: ``842 tok/s, reward 0.417, elapsed 1m05s, eta 1m48s``
        (``final``: ``done`` or ``stopped`` instead of the ETA)."""
        f = self.fields(now)
        reward = "-" if f["reward"] is None else f"{f['reward']:.3f}"
        if final:
            eta = "done" if f["done"] >= f["total"] else "stopped"
        else:
            eta = "eta " + ("?" if f["eta"] is None else duration(f["eta"]))
        return f"{f['tokens_per_s']:.0f} tok/s, reward {reward}, elapsed {duration(f['elapsed'])}, {eta}"

    def line(self, now: float | None = None, final: bool = False) -> str:
        """The plain line: ``[label] 12/32 episodes (1 failed), 842 tok/s, ...``."""
        failed = f" ({self.failed} failed)" if self.failed else ""
        running = max(self.started - self.done, 0)
        busy = f", {running} running" if running and not final else ""
        return f"[{self.label}] {self.done}/{self.total} episodes{failed}{busy}, {self.stats_text(now, final)}"

    def tick(self, force: bool = False, final: bool = False) -> None:
        """Plain mode: print the line if ``interval`` seconds passed since the last one (or ``force``)."""
        if self._bar is not None:
            return
        now = self.clock()
        with self._lock:
            if self._closed or not (force or now - self._last >= self.interval):
                return
            self._last = now
            text = self.line(now, final)
            try:
                print(text, file=self.stream, flush=True)
            except (OSError, ValueError):  # a closed or broken stream: progress is never worth a failure
                pass

    # ------------------------------------------------------------------ start and stop

    def start(self) -> "RolloutProgress":
        self._t0 = self._last = self.clock()
        if self.live_tokens is not None:
            try:
                self._live0 = float(self.live_tokens())
            except Exception:  # noqa: BLE001
                self.live_tokens = None
        if self._use_rich():
            self._start_rich()
        else:
            self.tick(force=True)
            if self._heartbeat:
                self._thread = threading.Thread(target=self._beat, name="rollout-progress", daemon=True)
                self._thread.start()
        return self

    def close(self) -> None:
        """Stop drawing; plain mode prints the final line."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._bar is not None:
            with self._lock:
                bar, self._bar = self._bar, None
                bar.update(self._task, completed=self.done)
            try:
                bar.stop()
            finally:
                _LIVE.release()
        else:
            self.tick(force=True, final=True)
        self._closed = True

    def __enter__(self) -> "RolloutProgress":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _beat(self) -> None:
        while not self._stop.wait(min(self.interval, 5.0)):
            self.tick()

    def _use_rich(self) -> bool:
        if self._rich is False:
            return False
        if self._rich is None:
            try:
                tty = self.stream.isatty()
            except (AttributeError, ValueError):
                tty = False
            if not tty or threading.current_thread() is not threading.main_thread():
                return False
        return _LIVE.acquire(blocking=False)  # another display is live: plain lines

    def _start_rich(self) -> None:
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
            from rich.text import Text

            owner = self

            class Stats(ProgressColumn):
                def render(self, task: Any) -> Text:  # on rich's refresh thread: no per-token work
                    return Text(owner.stats_text().replace(", ", " · "), no_wrap=True, overflow="ellipsis")

            bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(), Stats(), console=Console(file=self.stream),
                           redirect_stdout=False, redirect_stderr=True, refresh_per_second=4)
            self._task = bar.add_task(self.label, total=self.total, completed=self.done)
            bar.start()
            self._bar = bar
        except Exception:  # no display is worth a failed collection: plain lines instead
            _LIVE.release()
            self._bar = None
            self.tick(force=True)
