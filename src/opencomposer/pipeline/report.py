"""The run report: JSON, a Markdown summary and a PNG of reward per step.

Everything in the report is rebuilt from ``metrics.jsonl``, ``evals.json`` and (when the run
had a ``[pretrain]`` stage) ``pretrain/result.json`` in the run directory, so a report can be
regenerated after the fact (``write_report(out)``).
"""

from __future__ import annotations

import json
from pathlib import Path


def write_report(out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()] \
        if (out / "metrics.jsonl").exists() else []
    evals = json.loads((out / "evals.json").read_text()) if (out / "evals.json").exists() else {}
    # stages in training order, whatever order they were measured in
    order = {"base": 0, "sft": 1, "rl": 2}
    evals = dict(sorted(evals.items(), key=lambda kv: order.get(kv[0], 3)))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = [r["step"] for r in rows]
    axes[0].plot(steps, [r.get("reward_mean", 0) for r in rows], "o-", label="reward mean")
    axes[0].plot(steps, [r.get("pass@1", 0) for r in rows], "s--", label="pass@1 (train groups)")
    if any("shaped_reward_mean" in r for r in rows):  # what the update used (rewards/shaping.py)
        axes[0].plot(steps, [r.get("shaped_reward_mean", 0) for r in rows], "^:", label="shaped reward mean")
    low = min([0.0] + [r.get("shaped_reward_mean", 0) for r in rows])
    axes[0].set(title="reward per RL step", xlabel="step", ylim=(low - 0.05, 1.05))
    axes[0].legend(fontsize=8)
    for ax in axes[:2]:
        ax.set_xticks(steps)
    axes[1].plot(steps, [r.get("invalid_calls", 0) for r in rows], "o-", color="tab:red", label="invalid calls / rollout")
    axes[1].plot(steps, [r.get("tool_calls", 0) for r in rows], "s-", color="tab:green", label="tool calls / rollout")
    axes[1].set(title="tool use per rollout", xlabel="step")
    axes[1].legend(fontsize=8)
    names = list(evals)
    axes[2].bar(names, [evals[n].get("pass@1", 0) for n in names], color="tab:purple")
    for i, n in enumerate(names):
        axes[2].text(i, evals[n].get("pass@1", 0) + 0.02, f"{evals[n].get('pass@1', 0):.2f}", ha="center")
    axes[2].set(title="held-out pass@1", ylim=(0, 1.05))
    fig.tight_layout()
    png = out / "report.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    lines = ["# opencomposer run report", "", f"run dir: `{out}`", "", "## Held-out pass@1", "",
             "| stage | tasks | k | pass@1 | invalid calls/ep | tokens/ep | s |", "|---|---|---|---|---|---|---|"]
    for n, e in evals.items():
        lines.append(f"| {n} | {e.get('tasks')} | {e.get('k')} | {e.get('pass@1', 0):.3f} | "
                     f"{e.get('invalid_calls', 0):.2f} | {e.get('mean_completion_tokens', 0):.0f} | {e.get('seconds')} |")
    cpt = json.loads((out / "pretrain" / "result.json").read_text()) if (out / "pretrain" / "result.json").exists() else None
    if cpt:
        lines += ["", "## Continued pretraining", "",
                  (f"{cpt['steps']} steps x {cpt['batch_size']} x {cpt['seq_len']} tokens, {cpt['tokens_per_second']} "
                   f"tok/s; model `{cpt['model_dir']}`"), "",
                  "| held-out set | loss before | loss after | perplexity before | perplexity after |", "|---|---|---|---|---|"]
        for name in (k for k in cpt["before"] if k != "step"):
            b, a = cpt["before"][name], cpt["after"][name]
            lines.append(f"| {name} | {b['loss']:.4f} | {a['loss']:.4f} | {b['perplexity']:.2f} | {a['perplexity']:.2f} |")
    lines += ["", "## RL steps", "", "| step | reward | pass@1 | tokens | tool calls | invalid | loss | kl | grad norm | rollout s | train s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r.get('reward_mean', 0):.3f} | {r.get('pass@1', 0):.3f} | "
                     f"{r.get('mean_completion_tokens', 0):.0f} | {r.get('tool_calls', 0):.1f} | {r.get('invalid_calls', 0):.1f} | "
                     f"{r.get('loss', 0):.4g} | {r.get('kl', 0):.3g} | {r.get('grad_norm', 0):.3g} | "
                     f"{r.get('time_rollout')} | {r.get('time_train')} |")
    lines += ["", "![report](report.png)", ""]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    extra = {"pretrain": {k: cpt[k] for k in ("steps", "before", "after", "model_dir")}} if cpt else {}
    (out / "report.json").write_text(json.dumps({"evals": evals, "steps": rows, **extra}, indent=1))
    return md
