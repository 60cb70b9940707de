"""Composer's CPT finding at small scale (issue 30), as one table: arms that differ only in their
continued-pretraining budget, each followed by the identical SFT and RL (``benchmarks/learn_run.py``
with ``[pretrain]``), read side by side: the held-out code loss after CPT against the RL reward and
pass@1 after RL, and whether the lower loss gave the higher reward.

    python benchmarks/cpt_table.py runs/learn-gpu/cpt-0 runs/learn-gpu/cpt-100 runs/learn-gpu/cpt-400 \\
        [--updates 24] [--stage rl@25] [--split validation] [--md table.md]

Each argument is a learn_run ``out_dir``. An arm without a pretrain stage (budget 0) takes the base
model's held-out loss: the ``before`` of the other arms, which measured the same base on the same
windows (checked: arms whose ``before`` differ were not made alike, and are refused).

- *RL reward*: over RL updates 1..``--updates`` (default: the fewest any arm made, so every arm is
  read over the same updates), the mean of the updates' task pass rate (``pass@1`` of the metrics
  rows) and of their reward, each with a 95% bootstrap interval over updates.
- *After RL*: pass@1 at ``--stage`` on ``--split`` (default: the latest RL stage every arm
  evaluated), each arm against the first (paired bootstrap over the tasks both evaluated).
- *The finding*: of the pairs of arms, how many are ordered alike by held-out loss (lower) and by RL
  reward (higher): concordant, discordant, tied.

Prints the table, then one JSON line. Test: ``pytest tests/bench/test_cpt_table.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learn_run import EVAL_SPLITS, paired, stage_order  # noqa: E402

from opencomposer.eval.gate import paired_bootstrap  # noqa: E402
from opencomposer.paths import atomic_write_text  # noqa: E402

BOOT = 10_000
PRIMARY = "held_out"  # the CPT mix's held-out documents; other sets: code never trained on (eval_data)


def _json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: missing ({what})") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}: not JSON ({e}); expected {what}") from None


def rl_rows(out: Path) -> list[dict]:
    """The RL metrics rows of an arm, one per update (a step made again after a resume: its last row)."""
    path = out / "rl_run" / "metrics.jsonl"
    rows: dict[int, dict] = {}
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise SystemExit(f"{path}: missing (the RL metrics of arm {out}: has its RL stage run?)") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows[int(row["step"])] = row
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise SystemExit(f"{path}:{n}: not a metrics row with a step ({type(e).__name__}: {e})") from None
    return [rows[k] for k in sorted(rows)]


def interval(values: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Mean and 95% percentile-bootstrap interval of ``values`` (``eval.gate.paired_bootstrap``'s)."""
    v = np.asarray(values, dtype=float)
    return (float(v.mean()), *paired_bootstrap(v, BOOT, seed, 0.95))


def cpt_losses(out: Path) -> dict | None:
    """``{"steps", "tokens", "before", "after"}`` (losses by eval set) of an arm's pretrain stage, or None."""
    path = out / "pretrain" / "result.json"
    if not path.exists():
        return None
    res = _json(path, "the result of the arm's continued pretraining")
    try:
        sets = [k for k in res["before"] if k != "step"]
        return {"steps": res["steps"], "tokens": res.get("tokens", 0),
                "before": {k: res["before"][k]["loss"] for k in sets},
                "after": {k: res["after"][k]["loss"] for k in sets}}
    except (KeyError, TypeError) as e:
        raise SystemExit(f"{path}: no held-out losses before and after ({type(e).__name__}: {e})") from None


def base_losses(arms: dict[Path, dict | None]) -> dict[str, float] | None:
    """The base model's held-out losses: every CPT arm's ``before``, which must agree."""
    seen = [(out, c["before"]) for out, c in arms.items() if c is not None]
    for out, before in seen[1:]:
        first_out, first = seen[0]
        for k in set(first) | set(before):
            a, b = first.get(k), before.get(k)
            if a is None or b is None or abs(a - b) > 1e-4:
                raise SystemExit(f"the base model's held-out loss differs between arms: {first_out} {k} = {a}, "
                                 f"{out} {k} = {b}; the arms were not measured alike (another base, data, "
                                 "seq_len or eval_windows) and cannot share one table")
    return seen[0][1] if seen else None


def default_stage(arms: list[Path], split: str) -> str | None:
    """The latest RL stage (``rl`` or ``rl@N``) with ``split`` evaluated in every arm."""
    common = None
    for out in arms:
        have = {p.parent.parent.name for p in out.glob(f"rl*/{split}/results.json")}
        common = have if common is None else common & have
    return max(common, key=stage_order) if common else None


def table(arms: list[Path], updates: int | None, stage: str | None, split: str) -> dict:
    if len(arms) < 2:
        raise SystemExit("give at least two arms (learn_run out_dirs) to compare")
    if len(set(arms)) != len(arms):
        raise SystemExit(f"an arm is given twice: {sorted(str(a) for a in arms if arms.count(a) > 1)[0]}")
    cpt = {out: cpt_losses(out) for out in arms}
    base = base_losses(cpt)
    if base is None:
        raise SystemExit("no arm has a pretrain stage (<out>/pretrain/result.json): nothing gives the held-out "
                         "loss; run the CPT arms first")
    rows = {out: rl_rows(out) for out in arms}
    made = {out: len(r) for out, r in rows.items()}
    n = updates if updates is not None else min(made.values())
    short = [f"{out} ({made[out]})" for out in arms if made[out] < n]
    if n < 1 or short:
        raise SystemExit(f"--updates {n}: arms with fewer RL updates: {', '.join(short) or 'all'}")
    stage = stage or default_stage(arms, split)
    results = {}
    if stage is not None:
        for out in arms:
            results[out] = _json(out / stage / split / "results.json", f"the {split} evaluation at {stage}")
    out_rows = []
    for out in arms:
        c = cpt[out]
        losses = c["after"] if c is not None else base
        first = [r for r in rows[out] if r["step"] <= n]
        passed, reward = interval([r["pass@1"] for r in first]), interval([r["reward_mean"] for r in first])
        other = [v for k, v in losses.items() if k != PRIMARY]
        row = {"arm": str(out), "cpt_steps": c["steps"] if c else 0, "cpt_tokens": c["tokens"] if c else 0,
               "loss": losses.get(PRIMARY), "loss_other_code": float(np.mean(other)) if other else None,
               "updates": n, "train_pass@1": passed, "reward": reward}
        sft = out / "sft" / split / "results.json"
        if sft.exists():
            row["sft_pass@1"] = _json(sft, "the SFT evaluation")["summary"]["pass@1"]
        if stage is not None:
            r = results[out]
            row["stage"] = stage
            row["pass@1"] = r["summary"]["pass@1"]
            if out != arms[0]:
                row["vs_first"] = paired(results[arms[0]], r, 0)
        out_rows.append(row)
    conc = disc = tied = 0
    for i, a in enumerate(out_rows):
        for b in out_rows[i + 1:]:
            dl, dr = (a["loss"] - b["loss"]), (a["train_pass@1"][0] - b["train_pass@1"][0])
            if dl == 0 or dr == 0:
                tied += 1
            elif (dl < 0) == (dr > 0):  # lower loss with higher reward
                conc += 1
            else:
                disc += 1
    return {"split": split, "stage": stage, "updates": n, "base_loss": base, "arms": out_rows,
            "pairs": {"concordant": conc, "discordant": disc, "tied": tied},
            "lower_loss_higher_reward": conc > 0 and disc == 0 and tied == 0}


def markdown(t: dict) -> str:
    at = f"{t['split']} pass@1 at {t['stage']}" if t["stage"] else "(no RL evaluation)"
    lines = [f"| arm | CPT steps (tokens) | held-out loss, CPT mix | loss, other code | SFT pass@1 | train pass@1, "
             f"updates 1-{t['updates']} [95% CI] | reward [95% CI] | {at} | vs the first arm [95% CI] |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in t["arms"]:
        f = lambda m: f"{m[0]:.4f} [{m[1]:.4f}, {m[2]:.4f}]"  # noqa: E731
        other = f"{r['loss_other_code']:.4f}" if r["loss_other_code"] is not None else "-"
        vs = r.get("vs_first")
        vs = f"{vs['delta']:+.3f} [{vs['ci_low']:+.3f}, {vs['ci_high']:+.3f}] ({vs['tasks']} tasks)" if vs else "-"
        lines.append(f"| {Path(r['arm']).name} | {r['cpt_steps']} ({r['cpt_tokens']:,}) | {r['loss']:.4f} | {other} | "
                     f"{r.get('sft_pass@1', float('nan')):.3f} | {f(r['train_pass@1'])} | {f(r['reward'])} | "
                     f"{r.get('pass@1', float('nan')):.3f} | {vs} |")
    p = t["pairs"]
    lines += ["", f"Pairs of arms ordered alike by lower loss and higher train pass@1: {p['concordant']} concordant, "
              f"{p['discordant']} discordant, {p['tied']} tied."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arms", nargs="+", type=Path, help="learn_run out_dirs, the reference arm first")
    ap.add_argument("--updates", type=int, default=None, help="RL updates 1..N read in every arm (default: the fewest)")
    ap.add_argument("--stage", default=None, help="the RL stage read after RL, e.g. rl@25 (default: the latest in all)")
    ap.add_argument("--split", default="validation", choices=EVAL_SPLITS)
    ap.add_argument("--md", type=Path, default=None, help="also write the table to this file")
    a = ap.parse_args(argv)
    t = table(a.arms, a.updates, a.stage, a.split)
    md = markdown(t)
    if a.md is not None:
        atomic_write_text(a.md, md)
    print(md)
    print(json.dumps(t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
