"""The run report (pipeline/report.py) from a synthetic metrics log, evals.json and held-out
transcripts: the 4-panel PNG, the Markdown and JSON with 95% intervals, and the TensorBoard
tags read back with EventAccumulator.

Run: ``pytest tests/unit/pipeline/test_run_report.py`` (a few seconds).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from opencomposer.pipeline.report import checkpoint, write_report
from opencomposer.rl.metrics import MetricsLog, train_curves

K = 4


def synthetic_run(out: Path, steps: int = 20) -> None:
    log = MetricsLog(out)
    for s in range(1, steps + 1):
        log.write({"step": s, "reward_mean": 0.1 + 0.6 * s / steps + 0.1 * (-1) ** s, "pass@1": 0.3,
                   "shaped_reward_mean": 0.05 + 0.5 * s / steps, "mean_completion_tokens": 900.0 - 20 * s,
                   "tool_calls": 6.0, "invalid_calls": 3.0 - 0.1 * s, "loss": 0.1, "kl": 0.01,
                   "task_ids": [f"t{s}"], "time_rollout": 3.0, "time_train": 1.0})
    log.tb.close()
    evals = {
        "rl": {"tasks": 10, "k": K, "rollouts": 40, "reward_mean": 0.5, "pass@1": 0.5, f"pass@{K}": 0.8,
               "mean_completion_tokens": 500.0, "invalid_calls": 0.5, "tool_calls": 6.0, "seconds": 12.0},
        "base": {"tasks": 10, "k": K, "rollouts": 40, "reward_mean": 0.2, "pass@1": 0.2, f"pass@{K}": 0.4,
                 "mean_completion_tokens": 900.0, "invalid_calls": 2.0, "tool_calls": 6.0, "seconds": 20.0},
        "sft": {"tasks": 10, "k": K, "rollouts": 40, "reward_mean": 0.3, "pass@1": 0.3, f"pass@{K}": 0.6,
                "mean_completion_tokens": 700.0, "invalid_calls": 1.0, "tool_calls": 6.0, "seconds": 15.0},
        "rl@10": {"tasks": 10, "k": K, "rollouts": 40, "reward_mean": 0.35, "pass@1": 0.35, f"pass@{K}": 0.6,
                  "mean_completion_tokens": 600.0, "invalid_calls": 0.8, "tool_calls": 6.0, "seconds": 14.0},
    }
    (out / "evals.json").write_text(json.dumps(evals))
    # the final RL evaluation kept its transcripts: task i passes i // 2 of its K samples (one
    # task's episodes all broke before grading: no transcript, counted 0)
    folder = out / "evals" / "rl"
    folder.mkdir(parents=True)
    for i in range(9):
        for j in range(K):
            traj = {"task_id": f"held-{i}", "meta": {"reward": {"reward": 1.0, "passed": j < i // 2}}, "steps": []}
            (folder / f"held-{i}-{j}.json").write_text(json.dumps(traj))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_report_writes_four_panel_png_markdown_json_and_tensorboard(tmp_path):
    synthetic_run(tmp_path)
    md = write_report(tmp_path)
    png = tmp_path / "report.png"
    w, h = png_size(png)
    assert (w, h) == (1440, 960) and png.stat().st_size > 40_000
    import matplotlib.image
    pixels = matplotlib.image.imread(str(png))
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 200  # curves, not a blank canvas
    assert not list(tmp_path.glob(".*.tmp")), "written through a temp file, none left behind"

    text = md.read_text()
    order = [text.index(f"\n| {n} |") for n in ("base", "sft", "rl@10", "rl")]
    assert order == sorted(order), "checkpoints in training order"
    assert "bootstrap over 10 tasks" in text and "Wilson" in text and "![report](report.png)" in text

    held = json.loads((tmp_path / "report.json").read_text())["heldout"]
    assert [held[n]["step"] for n in ("base", "sft", "rl@10", "rl")] == [0, 0, 10, 20]
    rl = held["rl"]  # from the transcripts: per task 0,0,1,1,2,2,3,3,4 passes of 4, and a broken task
    counts = [0, 0, 1, 1, 2, 2, 3, 3, 4, 0]
    assert rl["pass@1"] == pytest.approx(sum(counts) / (4 * 10))
    assert rl[f"pass@{K}"] == pytest.approx(7 / 10) and rl["interval"] == "bootstrap over 10 tasks"
    for name, h in held.items():
        for metric in ("pass@1", f"pass@{K}"):
            lo, hi = h[f"{metric}_ci95"]
            assert 0.0 <= lo <= h[metric] <= hi <= 1.0 and hi - lo > 0.05, (name, metric)

    train = scalars(tmp_path / "tb")
    for tag in ("train/reward_mean", "train/reward_mean_rolling", "train/tokens_per_episode", "train/invalid_call_rate"):
        assert [s for s, _ in train[tag]] == list(range(1, 21)), tag
    curves = train_curves([json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()])
    assert [v for _, v in train["train/reward_mean_rolling"]] == pytest.approx(curves["reward_mean_rolling"], abs=1e-6)
    assert [v for _, v in train["train/invalid_call_rate"]] == pytest.approx([(3.0 - 0.1 * s) / 6 for s in range(1, 21)],
                                                                              abs=1e-6)
    heldout = scalars(tmp_path / "tb" / "heldout")
    assert heldout["heldout/pass@1/rl"] == [(10, pytest.approx(0.35)), (20, pytest.approx(0.4))]
    assert heldout[f"heldout/pass@{K}/base"] == [(0, pytest.approx(0.4))]
    assert {f"heldout/pass@1_ci95_low/{s}" for s in ("base", "sft", "rl")} <= set(heldout)
    assert f"heldout/pass@{K}_ci95_high/sft" in heldout

    write_report(tmp_path)  # regenerated: the held-out points are not doubled
    assert len(list((tmp_path / "tb" / "heldout").glob("events.out.tfevents*"))) == 1
    assert len(scalars(tmp_path / "tb" / "heldout")["heldout/pass@1/rl"]) == 2


def test_report_of_a_run_without_updates_or_evaluations(tmp_path):
    md = write_report(tmp_path)
    assert png_size(tmp_path / "report.png")[0] > 0 and "## RL steps" in md.read_text()


def test_checkpoint_ignores_transcripts_that_are_not_the_evaluations():
    entry = {"tasks": 2, "k": 1, "rollouts": 2, "pass@1": 0.5}
    c = checkpoint("base", entry, Path("/nonexistent"), last_step=7)
    assert (c.stage, c.step, c.method) == ("base", 0, "Wilson") and c.ci1[0] < 0.5 < c.ci1[1]
    assert checkpoint("rl", entry, Path("/nonexistent"), last_step=7).step == 7
    assert checkpoint("rl-step-30", entry, Path("/nonexistent"), last_step=7).stage == "rl"


def test_too_few_tasks_to_bootstrap_get_wilson_intervals(tmp_path):
    folder = tmp_path / "rl"
    folder.mkdir()
    for j in range(2):  # one held-out task, k = 2, neither sample passes
        (folder / f"t-{j}.json").write_text(json.dumps({"task_id": "t", "meta": {"reward": {"passed": False}}}))
    c = checkpoint("rl", {"tasks": 1, "k": 2, "rollouts": 2, "pass@1": 0.0, "pass@2": 0.0}, folder, last_step=3)
    assert c.method == "Wilson" and c.ci1[0] == 0.0 and c.ci1[1] > 0.5 and c.cik[1] > 0.5


def test_paired_differences_between_checkpoints_on_the_same_tasks(tmp_path):
    synthetic_run(tmp_path)
    # the base's transcripts: task i passes one sample where i is 0 or 8, none elsewhere; task 9 left none
    folder = tmp_path / "evals" / "base"
    folder.mkdir(parents=True)
    for i in range(9):
        for j in range(K):
            traj = {"task_id": f"held-{i}", "meta": {"reward": {"passed": i in (0, 8) and j == 0}}}
            (folder / f"held-{i}-{j}.json").write_text(json.dumps(traj))
    write_report(tmp_path)
    rep = json.loads((tmp_path / "report.json").read_text())
    (pair,) = rep["paired"]  # sft has no transcripts: only base -> rl can be paired
    rl = [i // 2 / K for i in range(9)] + [0.0]
    base = [0.25 if i in (0, 8) else 0.0 for i in range(9)] + [0.0]
    d = np.array(rl) - np.array(base)
    assert (pair["from"], pair["to"], pair["tasks"]) == ("base", "rl", 10)
    assert pair["delta_pass@1"] == pytest.approx(d.mean())
    assert pair["better"] == int((d > 0).sum()) and pair["worse"] == int((d < 0).sum()) == 1
    lo, hi = pair["ci95"]
    assert lo < d.mean() < hi and lo > 0  # 6 tasks better, 1 worse: the interval stays above zero
    assert f"| base -> rl | 10 | {d.mean():+.3f} [" in (tmp_path / "report.md").read_text()


def test_tasks_all_alike_get_wilson_intervals_not_a_zero_width_bootstrap(tmp_path):
    folder = tmp_path / "rl"
    folder.mkdir()
    for i in range(10):  # ten held-out tasks, k = 1, none passes
        (folder / f"t{i}-0.json").write_text(json.dumps({"task_id": f"t{i}", "meta": {"reward": {"passed": False}}}))
    c = checkpoint("rl", {"tasks": 10, "k": 1, "rollouts": 10, "pass@1": 0.0}, folder, last_step=1)
    assert c.method == "Wilson" and c.ci1[0] == pytest.approx(0.0, abs=1e-12) and 0.25 < c.ci1[1] < 0.32
