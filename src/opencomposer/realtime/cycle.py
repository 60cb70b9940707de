"""The real-time loop: logs since the last cycle -> rewards -> train -> gate -> hot-swap.

    opencomposer realtime --config configs/realtime/realtime.toml --once
    opencomposer realtime --config configs/realtime/realtime.toml --every 5h

One cycle (``RealtimeLoop.cycle``), each step timed:

1. ``window``: the session logs of ``[since, now)`` (``inference/server/session_log.py``); since
   is where the last completed cycle stopped. Torn or garbled lines are skipped and counted.
2. ``rewards``: per completion, from edits kept/reverted, dissatisfied follow-ups
   (classifier) and latency (``realtime/rewards.py``).
3. ``train``: the current policy (what the server's arm serves: ``state.current``) takes
   one epoch of clipped policy-gradient steps on the logged tokens (``realtime/learn.py``)
   and is exported, atomically, as ``candidates/cycle-NNNN``.
4. ``gate``: ``eval.run_suite`` on the current policy (reused from the cycle that deployed
   it, when there is one) and on the candidate, then ``eval.gate.compare``.
5. ``deploy``: only if the gate passes, ``POST /admin/weights`` swaps the candidate into
   the running server's engine; the candidate becomes the current policy.

Outcomes: ``deployed``, ``blocked`` (gate failed: no swap, the reason recorded),
``gated`` (passed, ``server.deploy = false``), ``nothing_to_train`` (empty window or too
few usable completions). The state file (``state.json``, written atomically after every
cycle) holds the current policy, its version and eval, where the next window starts and
every cycle's record, so a restarted loop goes on where it stopped; a cycle killed
half-way is redone from its window's start (its candidate directory is simply rewritten).

Test: ``pytest tests/integration/test_realtime_cycle.py``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from opencomposer.config import ConfigError
from opencomposer.inference.server.session_log import read_window
from opencomposer.paths import atomic_write_text
from opencomposer.realtime.classifier import default_classifier
from opencomposer.realtime.config import RealtimeConfig
from opencomposer.realtime.deploy import ServerClient
from opencomposer.realtime.learn import completion_samples, train_candidate
from opencomposer.realtime.rewards import score_window

STATE_FORMAT = "opencomposer.realtime/1"


class RealtimeLoop:
    def __init__(self, cfg: RealtimeConfig, log: Callable[[str], None] = lambda m: None):
        self.cfg, self.log = cfg, log
        self.out = Path(cfg.run.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.state_path = self.out / "state.json"
        self.state = self._load_state()
        self.server = ServerClient(cfg.server.url, cfg.server.admin_token, cfg.server.timeout_s)

    def _load_state(self) -> dict[str, Any]:
        if self.state_path.exists():
            try:
                state = json.loads(self.state_path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{self.state_path}: not valid JSON ({e}); move it away to start afresh") from None
            if state.get("format") != STATE_FORMAT:
                raise ConfigError(f"{self.state_path}: format {state.get('format')!r}, expected {STATE_FORMAT!r}")
            return state
        return {"format": STATE_FORMAT, "current": self.cfg.model.name, "version": 0, "current_eval": None,
                "next_since": self.cfg.logs.since, "cycles": []}

    def _save_state(self) -> None:
        atomic_write_text(self.state_path, json.dumps(self.state, indent=1) + "\n")

    # ------------------------------------------------------------------ one cycle

    def cycle(self, until: float | None = None) -> dict[str, Any]:
        n = len(self.state["cycles"]) + 1
        name = f"cycle-{n:04d}"
        cdir = self.out / "cycles" / name
        cdir.mkdir(parents=True, exist_ok=True)
        until = time.time() if until is None else until
        since = float(self.state["next_since"])
        started = time.time()
        row: dict[str, Any] = {"cycle": n, "started": _iso(started), "started_t": started, "since": since, "until": until,
                               "current": self.state["current"], "seconds": {}}
        secs = row["seconds"]
        if self.cfg.server.deploy:  # fail before spending an hour training if the server is gone
            t = time.perf_counter()
            arms = self.server.arms()
            secs["server"] = round(time.perf_counter() - t, 3)
            row["served"] = arms["arms"].get(self.cfg.server.arm, {}).get("checkpoint")
            if row["served"] is None:
                raise ConfigError(f"server.arm: {self.cfg.server.arm!r} is not served at {self.cfg.server.url} "
                                  f"(arms: {sorted(arms['arms'])})")
            if _label(str(row["served"])) != _label(str(self.state["current"])):
                self.log(f"warning: the server's arm {self.cfg.server.arm} serves {row['served']}, but the loop's "
                         f"current policy is {self.state['current']}; training the latter")

        t = time.perf_counter()
        window = read_window(self.cfg.logs.dir, since, until)
        secs["window"] = round(time.perf_counter() - t, 3)
        row["window"] = {"files": len(window.files), "completions": len(window.completions),
                         "feedback": len(window.feedback), "skipped_lines": len(window.warnings)}
        for w in window.warnings[:5]:
            self.log(f"warning: {w}")

        t = time.perf_counter()
        scored = score_window(window, self.cfg.reward, default_classifier())
        samples, skipped = completion_samples(
            window.completions, scored.rewards, self.cfg.train.temperature, self.cfg.reward.std_normalize,
            self.cfg.learn.max_completions, arm=self.cfg.server.arm if self.cfg.learn.only_own_arm else None)
        secs["rewards"] = round(time.perf_counter() - t, 3)
        row["rewards"] = scored.summary()
        row["samples"] = {"usable": len(samples), "skipped": dict(skipped)}
        atomic_write_text(cdir / "rewards.json", json.dumps(
            {"rewards": scored.rewards, "terms": scored.terms, "sessions": scored.sessions}, indent=1))

        if len(samples) < self.cfg.learn.min_completions:
            row["outcome"] = "nothing_to_train"
            row["reason"] = (f"nothing to train on: {len(window.completions)} completions in the window "
                             f"[{_iso(since)}, {_iso(until)}), {len(samples)} usable "
                             f"(need {self.cfg.learn.min_completions}); skipped {dict(skipped)}")
            if not window.completions:  # an empty window is consumed; a small one waits for more
                self.state["next_since"] = until
            return self._finish(row, cdir)

        t = time.perf_counter()
        candidate = self.out / "candidates" / name
        row["train"] = train_candidate(self.state["current"], samples, self.cfg, candidate)
        secs["train"] = round(time.perf_counter() - t, 3)
        version = int(self.state["version"]) + int(row["train"]["optimizer_steps"])

        t = time.perf_counter()
        from opencomposer.realtime.evaluate import evaluate_checkpoint, gate_decision

        current_eval = self.state.get("current_eval")
        if not current_eval or not Path(current_eval).exists():
            evaluate_checkpoint(self.state["current"], _label(self.state["current"]), self.cfg, cdir / "eval-current")
            current_eval = str(cdir / "eval-current" / "results.json")
        secs["eval_current"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        evaluate_checkpoint(str(candidate), name, self.cfg, cdir / "eval-candidate")
        cand_eval = str(cdir / "eval-candidate" / "results.json")
        secs["eval_candidate"] = round(time.perf_counter() - t, 3)
        gate = gate_decision(Path(current_eval), Path(cand_eval), self.cfg)
        row["gate"] = {k: gate[k] for k in ("passed", "metric", "a", "b", "delta", "ci_low", "ci_high",
                                            "n_tasks", "reason")}
        atomic_write_text(cdir / "gate.json", json.dumps(gate, indent=1))

        if not gate["passed"]:
            row["outcome"], row["reason"] = "blocked", gate["reason"]
        elif not self.cfg.server.deploy:
            row["outcome"], row["reason"] = "gated", "gate passed; server.deploy = false, not swapped"
        else:
            t = time.perf_counter()
            row["deploy"] = self.server.swap(candidate, self.cfg.server.arm, version)
            secs["deploy"] = round(time.perf_counter() - t, 3)
            row["outcome"] = "deployed"
            self.state.update(current=str(candidate), version=version, current_eval=cand_eval)
        self.state["next_since"] = until
        return self._finish(row, cdir)

    def _finish(self, row: dict[str, Any], cdir: Path) -> dict[str, Any]:
        row["seconds"]["total"] = round(sum(v for v in row["seconds"].values()), 3)
        row["current_after"] = self.state["current"]
        atomic_write_text(cdir / "cycle.json", json.dumps(row, indent=1))
        self.state["cycles"].append(row)
        self._prune_candidates()
        self._save_state()
        return row

    def _prune_candidates(self) -> None:
        root = self.out / "candidates"
        if not root.is_dir():
            return
        keep = self.cfg.run.keep_candidates
        old = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))[:-keep]
        for p in old:
            if str(p) != self.state["current"]:
                shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------ many cycles

    def run(self, every_s: float | None, once: bool, on_cycle: Callable[[dict], None],
            max_cycles: int | None = None) -> None:
        """``once``: one cycle now. Else a cycle every ``every_s`` seconds, counted from the
        last cycle's start (also across restarts), until interrupted or ``max_cycles``."""
        done = 0
        while True:
            last = self.state["cycles"][-1] if self.state["cycles"] else None
            if not once and last is not None and every_s:
                wait = float(last.get("started_t") or _parse_iso(last["started"])) + every_s - time.time()
                if wait > 0:
                    self.log(f"next cycle in {wait:.0f} s")
                    time.sleep(wait)
            on_cycle(self.cycle())
            done += 1
            if once or (max_cycles is not None and done >= max_cycles):
                return


def _label(path: str) -> str:
    return Path(path).name if "/" in path else path


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def _parse_iso(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()
