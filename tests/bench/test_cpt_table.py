"""benchmarks/cpt_table.py on two real tiny arms of benchmarks/learn_run.py: one without continued
pretraining, one with a [pretrain] stage (tiny-random, 2 steps on this repository's own code) whose
export SFT starts from; the table reads the held-out losses, the RL rows and the evaluations, and bad
arms are refused naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from testkit.learn_config import write_config
from testkit.scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
lr = load_benchmark("learn_run")
ct = load_benchmark("cpt_table")


def cpt_section(code: Path) -> str:
    return f"""
[pretrain]
enabled = true
data = ["{code}"]
steps = 2
seq_len = 64
batch_size = 2
warmup_steps = 0
held_out = 0.3
eval_every = 0
eval_windows = 4
save_every = 1
"""


@pytest.fixture(scope="module")
def arms(tmp_path_factory, toolz_tasks):
    tmp = tmp_path_factory.mktemp("cpt-arms")
    code = tmp / "code"  # real Python, never a task's: the RL package of this repository
    shutil.copytree(ROOT / "src" / "opencomposer" / "rl", code)
    none, cpt = tmp / "none", tmp / "cpt"
    for out, extra in ((none, ""), (cpt, cpt_section(code))):
        cfg = write_config(tmp, toolz_tasks, out, extra=extra, name=f"{out.name}.toml")
        assert lr.main(["--config", str(cfg), "--set", 'eval.stages=["sft", "rl"]']) == 0
    return none, cpt


def test_a_cpt_arm_pretrains_then_starts_sft_from_its_export(arms):
    none, cpt = arms
    res = json.loads((cpt / "pretrain" / "result.json").read_text())
    assert res["steps"] == 2 and (cpt / "pretrain" / "model" / "config.json").exists()
    s = json.loads((cpt / "summary.json").read_text())
    assert s["pretrain"]["loss_after"]["held_out"] == res["after"]["held_out"]["loss"]
    assert "pretrain" not in json.loads((none / "summary.json").read_text())
    assert "Continued pretraining (2 steps)" in (cpt / "summary.md").read_text()
    # the same traces, seed and SFT on another start: other SFT weights (SFT on the CPU is deterministic)
    a, b = (load_file(next((arm / "sft_model").glob("*.safetensors"))) for arm in arms)
    assert a.keys() == b.keys() and any(not a[k].equal(b[k]) for k in a)


def test_the_table_reads_losses_rewards_and_pass_rates_of_both_arms(arms, capsys, tmp_path):
    none, cpt = arms
    md = tmp_path / "cpt.md"
    assert ct.main([str(none), str(cpt), "--md", str(md)]) == 0
    t = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    res = json.loads((cpt / "pretrain" / "result.json").read_text())
    base, after = res["before"]["held_out"]["loss"], res["after"]["held_out"]["loss"]
    first, second = t["arms"]
    assert (first["cpt_steps"], first["loss"]) == (0, base)  # no CPT: the base model's loss, from the other arm
    assert (second["cpt_steps"], second["loss"], second["cpt_tokens"]) == (2, after, 2 * 2 * 64)
    assert t["updates"] == 1 and t["stage"] == "rl"
    for arm, out in ((first, none), (second, cpt)):
        row = json.loads((out / "rl_run" / "metrics.jsonl").read_text().splitlines()[0])
        assert arm["train_pass@1"][0] == row["pass@1"] and arm["reward"][0] == row["reward_mean"]
        assert arm["pass@1"] == json.loads((out / "rl" / "validation" / "results.json").read_text())["summary"]["pass@1"]
    assert second["vs_first"]["tasks"] == 1 and "vs_first" not in first
    assert sum(t["pairs"].values()) == 1
    assert md.read_text().startswith("| arm | CPT steps") and "| cpt | 2 (256) |" in md.read_text()


def test_arms_that_cannot_share_a_table_are_refused(arms, tmp_path):
    none, cpt = arms
    with pytest.raises(SystemExit, match="at least two arms"):
        ct.main([str(none)])
    with pytest.raises(SystemExit, match="an arm is given twice"):
        ct.main([str(none), str(cpt), str(none)])
    light = shutil.ignore_patterns("sft_model", "rl_run", "checkpoints", "model", "sft", "traces")
    shutil.copytree(none, tmp_path / "none-again", ignore=light)
    with pytest.raises(SystemExit, match="no arm has a pretrain stage"):
        ct.main([str(none), str(tmp_path / "none-again")])
    other = tmp_path / "cpt-other"
    shutil.copytree(cpt, other, ignore=light)
    with pytest.raises(SystemExit, match=r"rl_run/metrics.jsonl: missing"):
        ct.main([str(cpt), str(other)])
    (other / "rl_run").mkdir()
    shutil.copy(cpt / "rl_run" / "metrics.jsonl", other / "rl_run" / "metrics.jsonl")
    with pytest.raises(SystemExit, match=r"--updates 3: arms with fewer RL updates"):
        ct.main([str(cpt), str(other), "--updates", "3"])
    res = json.loads((other / "pretrain" / "result.json").read_text())
    res["before"]["held_out"]["loss"] += 0.5  # another base, or other windows
    (other / "pretrain" / "result.json").write_text(json.dumps(res))
    with pytest.raises(SystemExit, match="held-out loss differs between arms"):
        ct.main([str(cpt), str(other)])
