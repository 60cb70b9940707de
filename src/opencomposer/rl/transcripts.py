"""The transcripts an RL run keeps of its rollouts, for a person to audit what was rewarded.

An RL run finds every shortcut a reward leaves open. The metrics rows say how many episodes
passed and how many the monitors flagged; only the episodes themselves say *how*. With
``[rollout] keep_transcripts``:

* ``"notable"`` (default): every episode the hidden tests passed (graded, before any voiding)
  and every episode a monitor flagged: the ones whose reward a forgery would have raised, and
  the ones caught trying; a few a step, so a 100-step run keeps a few hundred; and
  ``keep_transcripts_sample`` (default 2) of the step's other episodes, drawn by a seeded draw
  (run seed, step): what the policy typically does, to read a drift (longer episodes, more
  calls) that the rows only count;
* ``"all"``: every episode (large: 128 an update at 16 x 8);
* ``"none"``: none.

Each is a transcript (``harness/trajectory.py``, ``Trajectory.load`` reads it back) at
``<out>/transcripts/step-NNNN/<task id>__g<group>r<index>.json``, written atomically, without
the per-token fields the update read (token ids, sampler log-probs, routes: the bulk of it).
Its ``meta`` holds what the episode was judged by: the grader's details (``reward``), the
monitors' flags with their evidence (``monitor``), the shaped reward's terms
(``shaped_reward``) and the changed files (``changes``); ``keep`` adds ``rl`` (step, group,
index, passed, flagged, ``kept_as``: passed, flagged or sample).

A step's transcripts are written before its checkpoint; a resumed run (``truncate``) removes
those of steps after the checkpoint, which it runs again, as ``MetricsLog.truncate`` does rows.

    kept = KeptTranscripts(out, "notable")
    kept.keep(step, rollouts)     # -> the paths written
    kept.truncate(step)           # on resume: drop steps > step
    audit(out)                    # what was kept: passes by library, flags by kind, one entry each

``python benchmarks/rl_audit.py RUN_DIR`` prints ``audit``'s entries with each episode's edits,
for a person to judge whether a pass was earned.

Test: ``pytest tests/unit/rl/test_transcripts.py``.
"""

from __future__ import annotations

import random
import re
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from opencomposer.harness.trajectory import Trajectory
from opencomposer.rewards.behaviour import LOOKUPS

if TYPE_CHECKING:
    from opencomposer.episode.run import Rollout

__all__ = ["KEEP", "KeptTranscripts", "audit", "notable"]

KEEP = ("none", "notable", "all")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def graded_passed(ro: Rollout) -> bool:
    """The hidden tests passed it (as graded, before a monitor voided it)."""
    r = ro.result.reward
    return bool(r.details.get("graded_passed", r.passed))


def notable(ro: Rollout) -> bool:
    """The hidden tests passed it or a monitor flagged it."""
    return ro.result is not None and (graded_passed(ro) or bool(ro.result.flags))


class KeptTranscripts:
    """``<out>/transcripts``: the rollouts ``mode`` keeps, one folder a step."""

    def __init__(self, out: Path, mode: Literal["none", "notable", "all"] = "notable", sample: int = 0,
                 seed: int = 0):
        if mode not in KEEP:
            raise ValueError(f"[rollout] keep_transcripts = {mode!r}: expected one of {', '.join(KEEP)}")
        if sample < 0:
            raise ValueError(f"[rollout] keep_transcripts_sample = {sample}: expected 0 or more")
        self.root, self.mode, self.sample, self.seed = Path(out) / "transcripts", mode, sample, seed

    def chosen(self, step: int, rollouts: list[Rollout]) -> list[tuple[Rollout, str]]:
        """The rollouts of ``step`` that ``mode`` keeps, each with why (passed, flagged, sample, all)."""
        done = [ro for ro in rollouts if ro.result is not None]
        if self.mode == "none":
            return []
        if self.mode == "all":
            return [(ro, "all") for ro in done]
        picked, rest = [], []
        for ro in done:
            if notable(ro):
                picked.append((ro, "flagged" if ro.result.flags else "passed"))
            else:
                rest.append(ro)
        draw = random.Random(f"{self.seed}:{step}").sample(range(len(rest)), min(self.sample, len(rest)))
        return picked + [(rest[i], "sample") for i in sorted(draw)]

    def keep(self, step: int, rollouts: list[Rollout]) -> list[Path]:
        """Write the transcripts of ``step``'s rollouts that ``mode`` keeps; the paths written."""
        folder = self.root / f"step-{step:04d}"
        written = []
        for ro, why in self.chosen(step, rollouts):
            traj = ro.result.trajectory
            lean = replace(traj, steps=[replace(s, token_ids=[], logprobs=[], policy_versions=[], routes="")
                                        for s in traj.steps],
                           meta={**traj.meta, "rl": {
                               "step": step, "group": ro.group, "index": ro.index,
                               "passed": graded_passed(ro),
                               "reward": ro.reward, "train_reward": ro.train_reward,
                               "flagged": sorted(ro.result.flags), "kept_as": why,
                               "policy_versions": sorted(set(ro.policy_versions))}})
            name = f"{_UNSAFE.sub('_', ro.task_id)}__g{ro.group}r{ro.index}.json"
            written.append(lean.save(folder / name))
        return written

    def truncate(self, step: int) -> list[int]:
        """Remove the folders of steps after ``step`` (a resumed run does them again); the steps removed."""
        gone = []
        if self.root.is_dir():
            for d in sorted(self.root.iterdir()):
                m = _STEP_DIR.match(d.name)
                if m and int(m.group(1)) > step:
                    shutil.rmtree(d)
                    gone.append(int(m.group(1)))
        return gone


def _library(task_id: str) -> str:
    """A factory task's library: its id's first ``__`` part (``tinycss2__parser__line_42`` -> ``tinycss2``)."""
    return task_id.split("__", 1)[0]


def audit(out: Path) -> dict[str, Any]:
    """What ``<out>/transcripts`` holds: counts (kept, passed, flagged, sampled, by monitor kind, passes
    by library) and one entry a transcript (step, task, passed, reward, kept_as, flags with their
    evidence, edit calls, tokens, path), in step order. A transcript that cannot be read is an error
    naming it."""
    root = Path(out) / "transcripts"
    entries, kinds, libraries = [], Counter(), Counter()
    for path in sorted(root.glob("step-*/*.json")) if root.is_dir() else []:
        t = Trajectory.load(path)  # ValueError naming the file
        rl, flags = t.meta.get("rl", {}), t.meta.get("monitor", {}).get("flags", {})
        edits = [e for s in t.steps for e in s.tool_events if e.name not in (*LOOKUPS, "submit")]
        entries.append({"step": rl.get("step"), "task": t.task_id, "passed": bool(rl.get("passed")),
                        "reward": rl.get("reward"), "kept_as": rl.get("kept_as", ""), "flags": flags, "turns": t.turns,
                        "tool_calls": t.tool_calls, "completion_tokens": t.completion_tokens,
                        "calls": [{"name": e.name, "arguments": e.arguments, "ok": e.ok} for e in edits],
                        "final_message": t.final_message, "path": str(path)})
        kinds.update(list(flags))  # each kind once an episode
        if rl.get("passed"):
            libraries[_library(t.task_id)] += 1
    return {"kept": len(entries), "passed": sum(e["passed"] for e in entries),
            "flagged": sum(bool(e["flags"]) for e in entries),
            "sampled": sum(e["kept_as"] == "sample" for e in entries), "by_flag": dict(sorted(kinds.items())),
            "passed_by_library": dict(libraries.most_common()), "entries": entries}
