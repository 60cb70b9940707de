"""The eval report: one HTML page and its PNGs, rebuilt from results.json files alone.

    opencomposer eval report runs/eval/base runs/eval/rl-step-40 --out runs/eval/report
    build_report([res_a, res_b], Path("runs/eval/report"))   # -> .../index.html

Charts (matplotlib, Agg):

* ``score_vs_tokens.png``: pass@1 against mean completion tokens per episode, one labelled
  point per run (model/checkpoint), with its 95% bootstrap interval over tasks; pass@k is
  the hollow marker above it. Up and to the left is better: the chart Cursor reports
  CursorBench with.
* ``pass_at_k.png``: unbiased pass@k for k = 1..K, one curve per run.
* ``per_difficulty.png``: pass@1 per difficulty level (bars, one colour per run, n tasks
  under each level).

The page embeds the PNGs (so it is one file you can mail) and they are also written
beside it (atomically: ``paths.atomic_write_bytes``); a summary table and a per-task table (pass rate per
run) follow.

Intervals, shared with the training run's report (``pipeline/report.py``): ``task_interval``,
the percentile bootstrap of a mean over tasks (each task one draw: its samples are not
independent), and ``wilson_interval``, the Wilson score interval of c successes in n trials,
for results that kept no per-task outcomes.

Test: ``pytest tests/unit/eval/test_report.py``.
"""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from opencomposer.eval.gate import paired_bootstrap
from opencomposer.eval.results import load_results, pass_at_k_curve, per_task
from opencomposer.paths import atomic_write_bytes, atomic_write_text

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def run_name(res: Mapping[str, Any], several_suites: bool) -> str:
    return f"{res['label']} ({res['suite']})" if several_suites else res["label"]


def pass_interval(res: Mapping[str, Any], confidence: float = 0.95) -> tuple[float, float]:
    """Bootstrap interval (over tasks) of pass@1."""
    return task_interval(list(per_task(res, "pass@1").values()), confidence)


def task_interval(values: Sequence[float], confidence: float = 0.95, n_boot: int = 2000,
                  seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-task ``values`` (tasks resampled)."""
    if len(values) == 0:
        raise ValueError("task_interval needs at least one task")
    return paired_bootstrap(np.asarray(values, dtype=float), n_boot, seed, confidence)


def wilson_interval(successes: float, n: float, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion: ``successes`` of ``n`` trials (n > 0)."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval needs 0 <= successes <= n and n > 0; got {successes}, {n}")
    from statistics import NormalDist
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def build_report(results: Sequence[Mapping[str, Any] | str | Path], out: Path, title: str = "") -> Path:
    """Write ``out/index.html`` and the PNGs; returns the HTML path."""
    runs = [load_results(r) for r in results]
    if not runs:
        raise ValueError("build_report needs at least one results file")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    several = len({r["suite"] for r in runs}) > 1
    names = [run_name(r, several) for r in runs]
    if len(set(names)) < len(names):  # two runs with one label: number them
        names = [f"{n} #{i + 1}" for i, n in enumerate(names)]
    import matplotlib
    matplotlib.use("Agg")
    pngs = {"score_vs_tokens.png": _score_vs_tokens(runs, names),
            "pass_at_k.png": _pass_at_k(runs, names),
            "per_difficulty.png": _per_difficulty(runs, names)}
    for fname, data in pngs.items():
        atomic_write_bytes(out / fname, data)
    page = out / "index.html"
    atomic_write_text(page, _html(runs, names, pngs, title))
    return page


def png_bytes(fig) -> bytes:
    """The figure as PNG bytes (and closed)."""
    import io

    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()


def _score_vs_tokens(runs: list[dict], names: list[str]) -> bytes:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 5))
    xs = [r["summary"]["mean_completion_tokens"] for r in runs]
    span = max(xs) - min(xs) if len(xs) > 1 else max(xs[0], 1.0)
    placed: list[tuple[float, float]] = []  # label anchors so far, (x / span, y)
    for i, (r, name) in enumerate(zip(runs, names)):
        c = COLORS[i % len(COLORS)]
        s = r["summary"]
        lo, hi = pass_interval(r)
        p1 = s["pass@1"]
        ax.errorbar([xs[i]], [p1], yerr=[[p1 - lo], [hi - p1]], fmt="o", color=c, ms=9, capsize=4, zorder=3)
        if r["k"] > 1:
            ax.plot([xs[i]], [s["pass@k"]], marker="o", mfc="none", mec=c, ms=9, ls="none", zorder=3)
            ax.plot([xs[i], xs[i]], [p1, s["pass@k"]], color=c, lw=0.8, ls=":", zorder=2)
        # label below-right of the point (above it near the bottom edge), moved further
        # away while it would land on a label already placed near it
        low = p1 < 0.2
        step = 0.09 if low else -0.09
        y = p1 + step / 3
        while any(abs(xs[i] / span - px) < 0.45 and abs(y - py) < 0.08 for px, py in placed):
            y += step
        placed.append((xs[i] / span, y))
        ax.annotate(f"{name}\npass@1 {p1:.2f}" + (f", pass@{r['k']} {s['pass@k']:.2f}" if r["k"] > 1 else ""),
                    (xs[i], p1), xytext=(xs[i] + 0.02 * span, y), fontsize=9, color=c,
                    va="bottom" if low else "top",
                    arrowprops={"arrowstyle": "-", "color": c, "lw": 0.5} if abs(y - p1) > 0.1 else None)
    from matplotlib.lines import Line2D
    fig.legend(handles=[Line2D([], [], marker="o", color="gray", ls="none", label="pass@1 (bar: 95% CI over tasks)"),
                        Line2D([], [], marker="o", mfc="none", mec="gray", ls="none", label="pass@k (k samples per task)")],
               fontsize=8, loc="lower center", ncol=2, frameon=False)
    ax.set_xlabel("mean completion tokens per episode (fewer is cheaper and faster)")
    ax.set_ylabel("pass rate")
    ax.set_title(f"Score vs tokens ({_suites(runs)})")
    ax.set_xlim(min(xs) - 0.06 * span, max(xs) + 0.45 * span + 1)
    ax.set_ylim(-0.06, 1.12)
    ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return png_bytes(fig)


def _pass_at_k(runs: list[dict], names: list[str]) -> bytes:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 5))
    kmax = 1
    for i, (r, name) in enumerate(zip(runs, names)):
        curve = pass_at_k_curve(r)
        ks = list(range(1, len(curve) + 1))
        kmax = max(kmax, len(curve))
        ax.plot(ks, curve, "o-", color=COLORS[i % len(COLORS)], label=f"{name} (pass@{ks[-1]} {curve[-1]:.2f})")
    ax.set_xlabel("k (samples per task)")
    ax.set_ylabel("pass@k (unbiased)")
    ax.set_title(f"pass@k ({_suites(runs)})")
    ax.set_xticks(range(1, kmax + 1))
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="best")
    fig.tight_layout()
    return png_bytes(fig)


def _per_difficulty(runs: list[dict], names: list[str]) -> bytes:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    levels = sorted({lv for r in runs for lv in r["summary"]["per_difficulty"]}, key=_level_order)
    having = {lv: [i for i, r in enumerate(runs) if lv in r["summary"]["per_difficulty"]] for lv in levels}
    most = max(len(v) for v in having.values())
    width = 0.8 / most
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 0.55 * sum(map(len, having.values())) + 2)), 4.8))
    for x, lv in enumerate(levels):
        for j, i in enumerate(having[lv]):
            v = runs[i]["summary"]["per_difficulty"][lv]["pass@1"]
            px = x + (j - (len(having[lv]) - 1) / 2) * width
            ax.bar(px, v, width * 0.92, color=COLORS[i % len(COLORS)])
            ax.text(px, v + 0.015, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    counts = {lv: max(runs[i]["summary"]["per_difficulty"][lv]["n"] for i in having[lv]) for lv in levels}
    ax.set_xticks(range(len(levels)), [f"{lv}\n(n={counts[lv]})" for lv in levels])
    ax.set_ylabel("pass@1")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"pass@1 per difficulty ({_suites(runs)})")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(handles=[Patch(color=COLORS[i % len(COLORS)], label=n) for i, n in enumerate(names)],
               fontsize=9, loc="lower center", ncol=min(len(names), 4), frameon=False)
    fig.tight_layout(rect=(0, 0.06 * ((len(names) + 3) // 4), 1, 1))
    return png_bytes(fig)


def _level_order(level: str) -> tuple[int, str]:
    from opencomposer.tasks.deletion import LEVELS
    return (LEVELS.index(level), level) if level in LEVELS else (len(LEVELS), level)


def _natural(name: str) -> list:
    """HumanEval_2 before HumanEval_10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _suites(runs: list[dict]) -> str:
    return ", ".join(sorted({r["suite"] for r in runs}))


def _html(runs: list[dict], names: list[str], pngs: dict[str, bytes], title: str) -> str:
    e = html.escape
    title = title or f"opencomposer eval: {_suites(runs)}"
    rows = []
    for r, name in zip(runs, names):
        s = r["summary"]
        lo, hi = pass_interval(r)
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in (
            e(name), e(r["suite"]), s["tasks"], r["k"], f"{s['pass@1']:.3f} [{lo:.2f}, {hi:.2f}]",
            f"{s['pass@k']:.3f}", f"{s['mean_completion_tokens']:.0f}", f"{s['tool_calls']:.1f}",
            f"{s['invalid_calls']:.2f}", f"{s['wall_s']:.0f}", f"{s['cost_usd']:.4f}", e(r.get("created", "")))) + "</tr>")
    task_ids = sorted({ep["task_id"] for r in runs for ep in r["episodes"]}, key=_natural)
    scores = [per_task(r, "pass@1") for r in runs]
    diff = {ep["task_id"]: ep["difficulty"] for r in runs for ep in r["episodes"]}
    trows = []
    for t in task_ids:
        cells = []
        for sc in scores:
            v = sc.get(t)
            # red (0) through yellow to green (1)
            cells.append("<td>-</td>" if v is None else
                         f"<td style='background:hsl({120 * v:.0f},65%,82%)'>{v:.2f}</td>")
        trows.append(f"<tr><td><code>{e(t)}</code></td><td>{e(diff[t])}</td>{''.join(cells)}</tr>")
    imgs = "\n".join(
        f"<figure><img alt='{e(f)}' src='data:image/png;base64,{base64.b64encode(d).decode()}'>"
        f"<figcaption><a href='{e(f)}'>{e(f)}</a></figcaption></figure>" for f, d in pngs.items())
    head = "".join(f"<th>{e(n)}</th>" for n in names)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{e(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 14px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th {{ background: #f3f3f3; }} td:first-child, td:nth-child(2) {{ text-align: left; }}
figure {{ display: inline-block; margin: 0.5em; }} img {{ max-width: 520px; border: 1px solid #eee; }}
.note {{ color: #555; font-size: 13px; }}
</style></head><body>
<h1>{e(title)}</h1>
<p class="note">pass@1 is the mean over tasks of each task's fraction of passing samples (the
unbiased estimate); pass@k is the unbiased estimator of Chen et al. 2021 over the k samples per
task; the interval is a 95% bootstrap over tasks. Tokens, tool calls and invalid calls are per
episode; wall is the whole run's seconds; cost is tokens x the price the run was given.
Rebuild this page with <code>opencomposer eval report RESULTS... --out DIR</code>.</p>
<h2>Summary</h2>
<table><tr><th>run</th><th>suite</th><th>tasks</th><th>k</th><th>pass@1 [95% CI]</th><th>pass@k</th>
<th>tokens/ep</th><th>tool calls/ep</th><th>invalid/ep</th><th>wall s</th><th>cost $</th><th>created</th></tr>
{''.join(rows)}
</table>
<h2>Charts</h2>
{imgs}
<h2>Per task (pass@1)</h2>
<table><tr><th>task</th><th>difficulty</th>{head}</tr>
{''.join(trows)}
</table>
</body></html>
"""
