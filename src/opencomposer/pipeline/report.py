"""The run report: JSON, a Markdown summary, the run's curves as one PNG, and the same in TensorBoard.

    write_report(Path("runs/demo"))   # -> runs/demo/report.md (+ report.png, report.json, tb/heldout/)

Everything in the report is rebuilt from ``metrics.jsonl``, ``evals.json``, the held-out
transcripts under ``evals/<checkpoint>/`` and (when the run had a ``[pretrain]`` stage)
``pretrain/result.json`` in the run directory, so a report can be regenerated after the fact
(``write_report(out)``); every file is written atomically (temp file + rename).

``report.png``, four panels:

* (a) train reward per update: the mean task reward of the update's rollouts, its rolling mean
  over the last ``ROLLING`` (10) updates, and the shaped reward the update used, if any;
* (b) held-out pass@1 and pass@K (K = the evaluation's samples per task) per evaluated
  checkpoint, in training order (base, SFT, RL: ``evals.json`` keys ``base``, ``sft``, ``rl``,
  and ``rl@N`` / entries with a ``step`` for RL every N updates), each with its 95% interval:
  a bootstrap over tasks from the transcripts' outcomes, or (no transcripts, fewer than 5
  tasks, or every task alike) a Wilson interval over episodes (pass@1) or tasks (pass@K);
* (c) completion tokens per episode per update (and its rolling mean);
* (d) invalid-call rate per update: invalid tool calls / all tool calls.

TensorBoard (``tensorboard --logdir <out>/tb``): the train curves are logged live, per update,
by ``rl.metrics.MetricsLog`` (``train/reward_mean``, ``train/reward_mean_rolling``,
``train/tokens_per_episode``, ``train/invalid_call_rate``); the report writes the held-out ones
to ``tb/heldout`` (rewritten each time, so a regenerated report never doubles a point), at
step = the checkpoint's update (base and SFT: 0), one tag per checkpoint kind
(``<stage>``: ``base``, ``sft``, ``rl``):

* ``heldout/pass@1/<stage>``, ``heldout/pass@1_ci95_low/<stage>``, ``heldout/pass@1_ci95_high/<stage>``;
* ``heldout/pass@K/<stage>`` and its ``_ci95_low`` / ``_ci95_high``, K the evaluation's k (e.g. ``pass@8``).

Test: ``pytest tests/unit/pipeline/test_run_report.py``, ``pytest tests/integration/test_rl_run.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opencomposer.eval.report import png_bytes, task_interval, wilson_interval
from opencomposer.paths import atomic_write_bytes, atomic_write_text
from opencomposer.rl.metrics import ROLLING, pass_at_k, train_curves

HELDOUT_TB = "heldout"  # under <out>/tb
MIN_BOOTSTRAP_TASKS = 5  # fewer held-out tasks: Wilson intervals (episodes for pass@1, tasks for pass@K)
_STAGES = {"base": 0, "sft": 1}
_RL_AT = re.compile(r"^rl[@_-]?(?:step-?)?(\d+)$")


@dataclass
class Checkpoint:
    """One held-out evaluation of ``evals.json``, with its intervals."""

    name: str
    stage: str  # base, sft, rl (or the name itself, for a kind the report does not know)
    step: int  # the update it was measured after (base, sft: 0)
    k: int
    pass1: float
    passk: float
    ci1: tuple[float, float]
    cik: tuple[float, float]
    method: str  # "bootstrap over N tasks" or "Wilson"
    passes: dict[str, int] | None = None  # task id -> passing episodes, from the transcripts (None: none read)


def write_report(out: Path) -> Path:
    """Write ``report.png``, ``report.md``, ``report.json`` and ``tb/heldout``; returns report.md."""
    out = Path(out)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()] \
        if (out / "metrics.jsonl").exists() else []
    evals = json.loads((out / "evals.json").read_text()) if (out / "evals.json").exists() else {}
    last_step = max((r["step"] for r in rows), default=0)
    points = sorted((checkpoint(n, e, out / "evals" / n, last_step) for n, e in evals.items()),
                    key=lambda c: (_STAGES.get(c.stage, 2), c.step, c.name == "rl"))
    evals = {c.name: evals[c.name] for c in points}  # stages in training order
    curves = train_curves(rows)
    atomic_write_bytes(out / "report.png", figure(curves, {"held-out": points}))
    points_tensorboard(out / "tb" / HELDOUT_TB, points)
    md = out / "report.md"
    paired = paired_differences(points, evals)
    atomic_write_text(md, _markdown(out, rows, evals, points, paired))
    cpt = _pretrain(out)
    extra = {"pretrain": {k: cpt[k] for k in ("steps", "before", "after", "model_dir")}} if cpt else {}
    heldout = {c.name: {"stage": c.stage, "step": c.step, "k": c.k, "pass@1": c.pass1, "pass@1_ci95": list(c.ci1),
                        f"pass@{c.k}": c.passk, f"pass@{c.k}_ci95": list(c.cik), "interval": c.method}
               for c in points}
    atomic_write_text(out / "report.json", json.dumps({"evals": evals, "heldout": heldout, "paired": paired,
                                                       "steps": rows, **extra}, indent=1))
    return md


# --------------------------------------------------------------------------- held-out points


def checkpoint(name: str, entry: Mapping[str, Any], transcripts: Path, last_step: int) -> Checkpoint:
    """The held-out point of ``evals.json``'s ``name``: its stage and update, pass@1 / pass@K and
    their 95% intervals (bootstrap over tasks when ``transcripts`` holds the evaluation's
    episodes, else Wilson)."""
    k = int(entry.get("k", 1))
    m = _RL_AT.match(name)
    stage = "rl" if m or name == "rl" else name
    step = int(entry["step"]) if "step" in entry else int(m.group(1)) if m else last_step if name == "rl" else 0
    p1, pk = float(entry.get("pass@1", 0.0)), float(entry.get(f"pass@{k}", entry.get("pass@1", 0.0)))
    passes = _task_passes(transcripts, entry, k)
    counts = _task_counts(passes, entry)
    if counts:
        return _from_counts(name, stage, step, k, counts, passes)
    tasks = int(entry.get("tasks", 0)) or 1
    rollouts = int(entry.get("rollouts", tasks * k)) or 1
    return Checkpoint(name, stage, step, k, p1, pk, wilson_interval(p1 * rollouts, rollouts),
                      wilson_interval(pk * tasks, tasks), "Wilson")


def episodes_checkpoint(name: str, stage: str, step: int, k: int, episodes: list[Mapping[str, Any]]) -> Checkpoint:
    """The point of one evaluation's episode records (``opencomposer.eval/1`` ``episodes``: ``task_id``
    and ``reward``, a task passing at reward >= 1), with the same intervals as ``checkpoint``'s."""
    passes: dict[str, int] = {}
    for e in episodes:
        passes[e["task_id"]] = passes.get(e["task_id"], 0) + (float(e.get("reward", 0.0)) >= 1.0)
    return _from_counts(name, stage, step, k, list(passes.values()), passes)


def _from_counts(name: str, stage: str, step: int, k: int, counts: list[int], passes: dict[str, int]) -> Checkpoint:
    """pass@1 / pass@K from passing episodes per task (of ``k``) and their 95% intervals."""
    v1 = [pass_at_k(k, c, 1) for c in counts]
    vk = [pass_at_k(k, c, k) for c in counts]
    p1, pk = sum(v1) / len(v1), sum(vk) / len(vk)
    # every task alike (all failed, say): a bootstrap over tasks has zero width, which claims a
    # certainty ten tasks cannot give; Wilson's interval says how little 0/10 rules out
    if len(counts) >= MIN_BOOTSTRAP_TASKS and len(set(v1)) > 1:
        return Checkpoint(name, stage, step, k, p1, pk, task_interval(v1), task_interval(vk),
                          f"bootstrap over {len(counts)} tasks", passes)
    # a bootstrap over one or two tasks says nothing (a single task: a zero-width interval)
    return Checkpoint(name, stage, step, k, p1, pk, wilson_interval(sum(counts), k * len(counts)),
                      wilson_interval(sum(c > 0 for c in counts), len(counts)), "Wilson", passes)


def _task_counts(passes: dict[str, int] | None, entry: Mapping[str, Any]) -> list[int]:
    """Passing episodes per task of the entry's tasks (``_task_passes``); a task none of whose
    episodes left a transcript (they broke before grading) counts 0. [] without transcripts."""
    if passes is None:
        return []
    return list(passes.values()) + [0] * (int(entry.get("tasks", 0)) - len(passes))


def _task_passes(folder: Path, entry: Mapping[str, Any], k: int) -> dict[str, int] | None:
    """Task id -> passing episodes (of ``k``) of the tasks that left a transcript in ``folder``;
    None when the folder does not match the entry (missing, or more transcripts than episodes:
    not this evaluation's)."""
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    tasks, rollouts = int(entry.get("tasks", 0)), int(entry.get("rollouts", 0))
    if not files or not tasks or len(files) > rollouts:
        return None
    passed: dict[str, int] = {}
    for f in files:
        try:
            t = json.loads(f.read_text())
            tid, ok = t["task_id"], bool(t["meta"]["reward"]["passed"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        passed[tid] = passed.get(tid, 0) + ok
    if len(passed) > tasks or any(c > k for c in passed.values()):
        return None
    return passed


def paired_differences(points: list[Checkpoint], evals: Mapping[str, Mapping[str, Any]], n_boot: int = 10_000,
                       seed: int = 0) -> list[dict[str, Any]]:
    """pass@1 of each later checkpoint minus an earlier one's (base -> sft, base -> rl, sft -> rl,
    where both were evaluated on the same tasks with transcripts kept): the mean over tasks of the
    per-task difference and its paired-bootstrap 95% interval (``eval.gate.paired_bootstrap``). A
    task without a transcript on one side counts as failed there, as in ``_task_counts``."""
    import numpy as np

    from opencomposer.eval.gate import paired_bootstrap

    rates = {c.name: {t: n / c.k for t, n in c.passes.items()} for c in points if c.passes is not None}
    found = []
    for a, b in (("base", "sft"), ("base", "rl"), ("sft", "rl")):
        if a not in rates or b not in rates or evals[a].get("tasks") != evals[b].get("tasks"):
            continue
        ids = sorted(set(rates[a]) | set(rates[b]))
        d = np.array([rates[b].get(t, 0.0) - rates[a].get(t, 0.0) for t in ids], dtype=float)
        tasks = int(evals[a]["tasks"])
        d = np.concatenate([d, np.zeros(max(tasks - len(ids), 0))])  # neither side left a transcript
        lo, hi = paired_bootstrap(d, n_boot, seed, 0.95)
        found.append({"from": a, "to": b, "tasks": len(d), "delta_pass@1": float(d.mean()), "ci95": [lo, hi],
                      "better": int((d > 0).sum()), "worse": int((d < 0).sum())})
    return found


# --------------------------------------------------------------------------- the PNG


def figure(curves: dict[str, list[float]], series: Mapping[str, list[Checkpoint]], title: str = "held-out") -> bytes:
    """The four panels of the module docstring; panel (b) holds one line pair (pass@1, pass@K) per
    ``series`` (label -> its checkpoints in training order; e.g. one per evaluation split)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ax_r, ax_h), (ax_t, ax_i) = axes
    steps = curves["step"]
    marker = "o" if len(steps) <= 40 else None

    # (a) train reward per update
    ax_r.plot(steps, curves["reward_mean"], marker=marker, ms=3, lw=1, alpha=0.45, color="tab:blue",
              label="reward mean (update)")
    ax_r.plot(steps, curves["reward_mean_rolling"], lw=2.2, color="tab:blue",
              label=f"rolling mean ({ROLLING} updates)")
    low = 0.0
    if "shaped_reward_mean" in curves:
        ax_r.plot(steps, curves["shaped_reward_mean"], ls=":", lw=1.2, color="tab:orange", label="shaped reward mean")
        low = min([0.0] + curves["shaped_reward_mean"])
    top_r = _top(curves["reward_mean"] + curves.get("shaped_reward_mean", []))
    ax_r.set(title="(a) train reward per update", xlabel="update", ylabel="reward",
             ylim=(low - (0.05 if top_r > 1 else 0.01), top_r))

    # (b) pass@1 / pass@K per checkpoint, one pair of lines per series
    labels: list[str] = []  # every checkpoint of any series, in training order (series agree on it)
    for pts in series.values():
        for c in pts:
            if _label(c) not in labels:
                labels.append(_label(c))
    one = len(series) == 1
    colors = ["tab:purple", "tab:green", "tab:blue", "tab:orange", "tab:red", "tab:brown"]
    top = 0.0
    for i, (name, pts) in enumerate(series.items()):
        if not pts:
            continue
        shift = 0.0 if one else (i - (len(series) - 1) / 2) * 0.12
        c1, ck = (colors[0], colors[1]) if one else (colors[i % len(colors)],) * 2
        xs = [labels.index(_label(c)) + shift for c in pts]
        p1 = [c.pass1 for c in pts]
        ax_h.errorbar(xs, p1, yerr=_yerr(p1, [c.ci1 for c in pts]), fmt="o-", color=c1, ms=7 if one else 5,
                      capsize=4, lw=1, label="pass@1" if one else f"{name} pass@1")
        with_k = [(x, c) for x, c in zip(xs, pts) if c.k > 1]
        if with_k:
            pk = [c.passk for _, c in with_k]
            ks = "/".join(map(str, sorted({c.k for _, c in with_k})))
            ax_h.errorbar([x + 0.04 for x, _ in with_k], pk, yerr=_yerr(pk, [c.cik for _, c in with_k]), fmt="s--",
                          mfc="none", ms=7 if one else 5, capsize=4, lw=1, color=ck,
                          label=f"pass@{ks}" if one else f"{name} pass@{ks}")
            top = max([top] + [c.cik[1] for _, c in with_k])
        top = max([top] + [c.ci1[1] for c in pts])
        if one:
            for x, c in zip(xs, pts):
                ax_h.annotate(f"{c.pass1:.2f}", (x, c.pass1), xytext=(-6, 0), textcoords="offset points",
                              ha="right", va="center", fontsize=8, color=c1)
    if labels:
        ax_h.set_xticks(range(len(labels)), labels)
        ax_h.set_xlim(-0.5, len(labels) - 0.5)
    else:
        ax_h.text(0.5, 0.5, f"no {title} evaluation", ha="center", va="center", transform=ax_h.transAxes)
    methods = sorted({c.method.split(" over")[0] for pts in series.values() for c in pts})
    ax_h.set(title=f"(b) {title} pass@k per checkpoint, 95% CI" + (f" ({'/'.join(methods)})" if methods else ""),
             xlabel="checkpoint", ylabel="pass rate", ylim=(-0.01 if top < 0.5 else -0.03, _top([top])))

    # (c) tokens per episode
    ax_t.plot(steps, curves["tokens_per_episode"], marker=marker, ms=3, lw=1, color="tab:brown",
              label="completion tokens / episode")
    ax_t.plot(steps, _rolling(curves["tokens_per_episode"]), lw=2, alpha=0.6, color="tab:brown",
              label=f"rolling mean ({ROLLING} updates)")
    ax_t.set(title="(c) tokens per episode", xlabel="update", ylabel="tokens", ylim=(0, None))

    # (d) invalid-call rate
    ax_i.plot(steps, curves["invalid_call_rate"], marker=marker, ms=3, lw=1, color="tab:red",
              label="invalid / all tool calls")
    ax_i.set(title="(d) invalid-call rate per update", xlabel="update", ylabel="rate",
             ylim=(-0.02, max([0.2] + curves["invalid_call_rate"]) * 1.1))

    for ax in (ax_r, ax_h, ax_t, ax_i):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    from matplotlib.ticker import MaxNLocator
    for ax in (ax_r, ax_t, ax_i):
        if not steps:
            ax.text(0.5, 0.5, "no RL updates", ha="center", va="center", transform=ax.transAxes)
        elif len(steps) <= 12:
            ax.set_xticks(steps)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return png_bytes(fig)


def _top(values: list[float]) -> float:
    """The y-axis top for rates: the whole [0, 1] once a value reaches 0.5; below, zoomed to the data
    (pass rates of a few percent are unreadable on a 0-1 axis)."""
    hi = max(values, default=0.0)
    return 1.05 if hi >= 0.5 else max(0.1, hi * 1.3)


def _yerr(values: list[float], cis: list[tuple[float, float]]) -> list[list[float]]:
    return [[max(v - lo, 0.0) for v, (lo, _) in zip(values, cis)], [max(hi - v, 0.0) for v, (_, hi) in zip(values, cis)]]


def _rolling(values: list[float]) -> list[float]:
    return [sum(values[max(0, i + 1 - ROLLING): i + 1]) / (i + 1 - max(0, i + 1 - ROLLING)) for i in range(len(values))]


def _label(c: Checkpoint) -> str:
    return f"rl\n(update {c.step})" if c.stage == "rl" else c.name


# --------------------------------------------------------------------------- TensorBoard


def points_tensorboard(folder: Path, points: list[Checkpoint], tag: str = HELDOUT_TB) -> None:
    """The checkpoints' scalars under ``<tag>/...``, in a folder of their own rewritten each time
    (see the module docstring)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard not installed: the PNG and the JSON only
        return
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("events.out.tfevents*"):
        old.unlink()
    if not points:
        return
    writer = SummaryWriter(str(folder))
    try:
        for c in points:
            for metric, value, (lo, hi) in (("pass@1", c.pass1, c.ci1), (f"pass@{c.k}", c.passk, c.cik)):
                if metric == f"pass@{c.k}" and c.k == 1:
                    continue
                writer.add_scalar(f"{tag}/{metric}/{c.stage}", value, c.step)
                writer.add_scalar(f"{tag}/{metric}_ci95_low/{c.stage}", lo, c.step)
                writer.add_scalar(f"{tag}/{metric}_ci95_high/{c.stage}", hi, c.step)
    finally:
        writer.close()


# --------------------------------------------------------------------------- Markdown


def _pretrain(out: Path) -> dict | None:
    p = out / "pretrain" / "result.json"
    return json.loads(p.read_text()) if p.exists() else None


def _markdown(out: Path, rows: list[dict], evals: dict, points: list[Checkpoint],
              paired: list[dict] | None = None) -> str:
    lines = ["# opencomposer run report", "", f"run dir: `{out}`", "", "## Held-out pass@k", "",
             "| checkpoint | update | tasks | k | pass@1 [95% CI] | pass@k [95% CI] | interval | tool calls/ep "
             "| invalid calls/ep | tokens/ep | s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in points:
        e = evals[c.name]
        lines.append(f"| {c.name} | {c.step} | {e.get('tasks')} | {c.k} | {c.pass1:.3f} [{c.ci1[0]:.2f}, {c.ci1[1]:.2f}] | "
                     f"{c.passk:.3f} [{c.cik[0]:.2f}, {c.cik[1]:.2f}] | {c.method} | {e.get('tool_calls', 0):.2f} | "
                     f"{e.get('invalid_calls', 0):.2f} | "
                     f"{e.get('mean_completion_tokens', 0):.0f} | {e.get('seconds')} |")
    if paired:
        lines += ["", "Paired on the same tasks (per-task pass@1 difference, bootstrap over tasks, 10,000 resamples):",
                  "", "| from -> to | tasks | delta pass@1 [95% CI] | tasks better / worse |", "|---|---|---|---|"]
        for p in paired:
            ci = (f"[{p['ci95'][0]:+.2f}, {p['ci95'][1]:+.2f}]" if p["better"] or p["worse"]
                  else "(no task changed)")
            lines.append(f"| {p['from']} -> {p['to']} | {p['tasks']} | {p['delta_pass@1']:+.3f} {ci} | "
                         f"{p['better']} / {p['worse']} |")
    cpt = _pretrain(out)
    if cpt:
        lines += ["", "## Continued pretraining", "",
                  (f"{cpt['steps']} steps x {cpt['batch_size']} x {cpt['seq_len']} tokens, {cpt['tokens_per_second']} "
                   f"tok/s; model `{cpt['model_dir']}`"), "",
                  "| held-out set | loss before | loss after | perplexity before | perplexity after |", "|---|---|---|---|---|"]
        for name in (k for k in cpt["before"] if k != "step"):
            b, a = cpt["before"][name], cpt["after"][name]
            lines.append(f"| {name} | {b['loss']:.4f} | {a['loss']:.4f} | {b['perplexity']:.2f} | {a['perplexity']:.2f} |")
    lines += ["", "## RL steps", "",
              "| step | reward | pass@1 | tokens | tool calls | invalid | invalid rate | loss | kl | grad norm "
              "| rollout s | train s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rates = train_curves(rows)["invalid_call_rate"]
    for r, rate in zip(rows, rates):
        lines.append(f"| {r['step']} | {r.get('reward_mean', 0):.3f} | {r.get('pass@1', 0):.3f} | "
                     f"{r.get('mean_completion_tokens', 0):.0f} | {r.get('tool_calls', 0):.1f} | {r.get('invalid_calls', 0):.1f} | "
                     f"{rate:.2f} | {r.get('loss', 0):.4g} | {r.get('kl', 0):.3g} | {r.get('grad_norm', 0):.3g} | "
                     f"{r.get('time_rollout')} | {r.get('time_train')} |")
    lines += ["", "![report](report.png)", "",
              f"TensorBoard: `tensorboard --logdir {out / 'tb'}` (train/... per update, heldout/... per checkpoint).", ""]
    return "\n".join(lines)
