"""benchmarks/learn_run.py: splits never overlap, every stage runs for real at tiny size, results are
eval-compare files, a rerun redoes nothing, other splits are refused, and the deadline stops cleanly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opencomposer.config import ConfigError, load_config
from opencomposer.eval.gate import compare
from testkit.learn_config import write_config
from testkit.scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
lr = load_benchmark("learn_run")


def test_shipped_config_loads_and_its_humaneval_splits_are_disjoint():
    cfg = load_config(ROOT / "configs" / "learn" / "gpu.toml", lr.LearnConfig)
    lc = cfg.learn
    assert len(lc.humaneval_heldout) == 82 and all(n % 2 for n in lc.humaneval_heldout)
    assert not set(lc.humaneval_train) & set(lc.humaneval_validation)


def test_overlapping_humaneval_splits_are_refused(tmp_path):
    p = tmp_path / "a.toml"
    p.write_text("[learn]\ntrain_dirs = ['x']\nhumaneval_train = [1, 2]\nhumaneval_heldout = [2]\n[tasks]\ndir = 'x'\n")
    with pytest.raises(ConfigError, match=r"problems \[2\] are in both humaneval_train and humaneval_heldout"):
        load_config(p, lr.LearnConfig)


def test_a_tiny_run_end_to_end(tmp_path, toolz_tasks, capsys):
    out = tmp_path / "run"
    cfg = write_config(tmp_path, toolz_tasks, out)
    assert lr.main(["--config", str(cfg)]) == 0
    printed = capsys.readouterr().out
    last = json.loads(printed.strip().splitlines()[-1])
    assert last["stopped_before"] is None
    splits = json.loads((out / "splits.json").read_text())
    ids = [t for v in splits.values() for t in v]
    assert len(ids) == len(set(ids)) and "HumanEval_53" in splits["train"]
    assert splits["validation"] == ["HumanEval_23"] and splits["humaneval_heldout"] == ["HumanEval_2"]
    assert splits["heldout_functions"], "a toolz file is held out"
    for stage in ("base", "sft", "rl", "rl@1"):
        assert (out / stage / "validation" / "results.json").exists(), stage
        # one transcript a validation task (its first sample), to read what failed; none of other splits
        assert [p.name for p in (out / stage / "validation" / "transcripts").iterdir()] == ["HumanEval_23.json"]
        assert not (out / stage / "heldout_functions" / "transcripts").exists()
    # after the last step the weights are rl@1's: its validation read is taken, not made again
    assert (out / "rl" / "validation" / "results.json").read_bytes() == \
        (out / "rl@1" / "validation" / "results.json").read_bytes()
    assert "rl: validation is rl@1's (the same weights), not evaluated again" in printed
    for stage in ("base", "sft", "rl"):
        for split in ("heldout_functions", "humaneval_heldout"):
            res = json.loads((out / stage / split / "results.json").read_text())  # [learn] heldout_k
            assert res["k"] == 3 and len(res["episodes"]) == 3 * len(splits[split])
        assert json.loads((out / stage / "validation" / "results.json").read_text())["k"] == 2  # [eval] k
    # the results are eval-compare files: the paired bootstrap reads them as they are
    g = compare(out / "sft" / "heldout_functions", out / "rl" / "heldout_functions")
    assert g.n_tasks == len(splits["heldout_functions"])
    summary = json.loads((out / "summary.json").read_text())
    assert "heldout_functions: sft -> rl" in summary["comparisons"]
    assert (out / "sft" / "sft.json").exists() and (out / "sft_model" / "config.json").exists()

    # a rerun redoes nothing
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/*/results.json")}
    assert lr.main(["--config", str(cfg)]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/*/results.json")} == stamps

    # a second run from this run's SFT model ([learn] sft_model): evaluated as its sft stage, never trained again
    out2 = tmp_path / "run2"
    cfg2 = tmp_path / "learn2.toml"
    cfg2.write_text(cfg.read_text().replace(f'out_dir = "{out}"', f'out_dir = "{out2}"').replace(
        "oracle_workers = 2", f'oracle_workers = 2\nsft_model = "{out / "sft_model"}"').replace(
        'stages = ["base", "sft", "rl"]', 'stages = ["sft", "rl"]'))
    assert lr.main(["--config", str(cfg2)]) == 0
    assert (out2 / "sft" / "validation" / "results.json").exists() and (out2 / "rl" / "validation" / "results.json").exists()
    assert not (out2 / "sft_model").exists() and not (out2 / "sft" / "sft.json").exists()
    assert json.loads((out2 / "rl_run" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1

    # other splits (here: no held-out share) are refused, naming the file
    cfg.write_text(cfg.read_text().replace("heldout_share = 0.25", "heldout_share = 0.0"))
    with pytest.raises(SystemExit, match="splits.json: the splits differ"):
        lr.main(["--config", str(cfg)])


def test_held_out_splits_have_their_own_cap(tmp_path, toolz_tasks):
    cfg = write_config(tmp_path, toolz_tasks, tmp_path / "run")
    more = ["learn.humaneval_validation=[23, 25]", "learn.humaneval_heldout=[2, 4, 6]"]

    def splits(name: str, *sets: str) -> dict:
        (tmp_path / name).mkdir()
        return lr.make_splits(lr.config_with(cfg, [*more, *sets]), tmp_path / name, None, lambda *_: None)

    whole = splits("a")
    assert len(whole["humaneval_heldout"]) == 3 and len(whole["validation"]) == 2
    capped = splits("b", "learn.max_eval_tasks=1")
    assert len(capped["humaneval_heldout"]) == 1 and len(capped["validation"]) == 1
    apart = splits("c", "learn.max_eval_tasks=1", "learn.max_heldout_tasks=0")
    assert apart["humaneval_heldout"] == whole["humaneval_heldout"] and len(apart["validation"]) == 1


def test_held_out_splits_at_a_kept_step_after_the_last(tmp_path, toolz_tasks, capsys):
    out = tmp_path / "run"
    cfg = write_config(tmp_path, toolz_tasks, out)
    cfg.write_text(cfg.read_text().replace('stages = ["base", "sft", "rl"]', 'stages = ["sft", "rl"]')
                   .replace("steps = 1", "steps = 2\nkeep_every = 1").replace("heldout_k = 3", "heldout_k = 3\nheldout_at = [1]"))
    assert lr.main(["--config", str(cfg)]) == 0
    splits = json.loads((out / "splits.json").read_text())
    for split in ("heldout_functions", "humaneval_heldout"):
        res = json.loads((out / "rl@1" / split / "results.json").read_text())
        assert res["label"] == "rl@1" and len(res["episodes"]) == 3 * len(splits[split])
    assert (out / "rl_run" / "checkpoints" / "step-0001" / "model").is_dir()  # the weights it read
    assert "heldout_functions: sft -> rl@1" in json.loads((out / "summary.json").read_text())["comparisons"]
    cfg.write_text(cfg.read_text().replace("keep_every = 1", "keep_every = 0"))
    with pytest.raises(SystemExit, match=r"heldout_at: steps \[1\] are not kept"):
        lr.main(["--config", str(cfg)])


def test_the_deadline_stops_before_work(tmp_path, toolz_tasks, capsys):
    out = tmp_path / "run"
    cfg = write_config(tmp_path, toolz_tasks, out)
    assert lr.main(["--config", str(cfg), "--deadline-s", "0"]) == 3
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["stopped_before"] == "sft"
    assert not list(out.glob("*/*/results.json"))


def test_a_stop_file_stops_before_work_as_the_deadline_does(tmp_path, toolz_tasks, capsys):
    out = tmp_path / "run"
    cfg = write_config(tmp_path, toolz_tasks, out)
    stop = tmp_path / "stop"
    stop.touch()
    assert lr.main(["--config", str(cfg), "--stop-file", str(stop)]) == 3
    text = capsys.readouterr().out
    assert json.loads(text.strip().splitlines()[-1])["stopped_before"] == "sft" and f"{stop} exists" in text
    assert not list(out.glob("*/*/results.json"))
    assert lr.Clock(None, tmp_path / "absent").fits(1e9)  # no file, no deadline: everything fits


def test_settings_set_on_the_command_line(tmp_path):
    shipped = str(ROOT / "configs" / "learn" / "gpu.toml")
    cfg = lr.config_with(shipped, ['agent.edit_tools=["replace_lines", "write_file"]', 'learn.eval_splits=["validation"]',
                                   'run.out_dir="runs/x"'])
    assert cfg.agent.edit_tools == ["replace_lines", "write_file"] and cfg.run.out_dir == "runs/x"
    assert lr.evaluated(cfg) == ["validation"]
    assert lr.evaluated(load_config(shipped, lr.LearnConfig)) == ["validation"]  # while RL trains (the config says)
    every = json.dumps(list(reversed(lr.EVAL_SPLITS)))
    assert lr.evaluated(lr.config_with(shipped, [f"learn.eval_splits={every}"])) == list(lr.EVAL_SPLITS)
    assert lr.LearnSection.model_fields["eval_splits"].default == list(lr.EVAL_SPLITS)  # unset: every split
    with pytest.raises(ConfigError, match="expected SECTION.KEY=VALUE"):
        lr.config_with(shipped, ["max_turns=8"])
    with pytest.raises(ConfigError, match="'replace' is not a TOML value"):
        lr.config_with(shipped, ["agent.edit_tools=replace"])
    with pytest.raises(ConfigError, match="key 'agent.nope': unknown key"):
        lr.config_with(shipped, ["agent.nope=1"])
    with pytest.raises(ConfigError, match="learn.eval_splits"):
        lr.config_with(shipped, ['learn.eval_splits=["train"]'])  # never an evaluation of what is trained on


def test_traces_made_without_a_model_are_read_back(tmp_path, toolz_tasks, capsys):
    out = tmp_path / "run"
    cfg = write_config(tmp_path, toolz_tasks, out)
    assert lr.main(["--config", str(cfg), "--traces-only"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["traces"] >= 1 and not (out / "sft_model").exists()
    made = {p: p.stat().st_mtime_ns for p in (out / "sft" / "traces").glob("*.json")}
    assert len(made) == last["train"]
    assert lr.main(["--config", str(cfg), "--set", 'eval.stages=["sft"]']) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "sft" / "traces").glob("*.json")} == made
    assert (out / "sft_model" / "config.json").exists() and not (out / "sft" / "ckpt").exists()


def test_rl_on_lora_adapters_after_full_sft(tmp_path, toolz_tasks, capsys):
    """[learn] rl_lora: SFT trains every weight, RL only adapters; the RL checkpoint holds the adapter alone."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path, toolz_tasks, out)
    assert lr.main(["--config", str(cfg), "--set", 'eval.stages=["sft", "rl"]', "--set", "learn.rl_lora=true",
                    "--set", 'learn.eval_splits=["validation"]']) == 0
    step = next((out / "rl_run" / "checkpoints").glob("step-*"))
    assert (step / "model" / "adapter_model.safetensors").is_file()
    assert not list((step / "model").glob("model*.safetensors"))  # no full weights in the RL state
    assert (out / "rl" / "validation" / "results.json").exists() and not (out / "rl" / "heldout_functions").exists()
    # the curves: RL rows and the validation points of sft, rl@N, rl in one PNG (1440 x 960)
    png = (out / "learn.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1440


def test_curves_hold_every_split_and_checkpoint_in_training_order(tmp_path):
    """write_curves reads each stage's results.json: points per split in the order base, sft, rl@N, rl,
    with the interval of the same episodes as ``pipeline.report`` gives them; TensorBoard per split."""
    from opencomposer.pipeline.report import episodes_checkpoint
    eps = lambda passed: [{"task_id": f"t{i}", "reward": float(i < passed)} for i in range(6) for _ in range(4)]  # noqa: E731
    for stage, split, passed in (("sft", "validation", 1), ("rl@5", "validation", 2), ("rl", "validation", 3),
                                 ("rl", "heldout_libraries", 1), ("base", "validation", 0)):
        (tmp_path / stage / split).mkdir(parents=True)
        (tmp_path / stage / split / "results.json").write_text(json.dumps({"k": 4, "episodes": eps(passed)}))
    (tmp_path / "rl_run").mkdir()
    (tmp_path / "rl_run" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "reward_mean": 0.1 * i, "mean_completion_tokens": 500, "invalid_calls": 0.1,
                    "tool_calls": 5.0}) + "\n" for i in range(1, 11)))
    png = lr.write_curves(tmp_path)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert [lr.stage_order(s)[:3] for s in ("base", "sft", "rl@5", "rl")] == sorted(
        lr.stage_order(s)[:3] for s in ("rl", "rl@5", "sft", "base"))
    p = episodes_checkpoint("rl", "rl", 10, 4, eps(3))
    assert p.pass1 == 0.5 and p.passk == 0.5 and p.passes == {f"t{i}": 4 * (i < 3) for i in range(6)}
    assert p.method == "bootstrap over 6 tasks" and p.ci1[0] < 0.5 < p.ci1[1]
    pytest.importorskip("tensorboard")
    assert list((tmp_path / "tb" / "validation").glob("events.out.tfevents*"))
    assert list((tmp_path / "tb" / "heldout_libraries").glob("events.out.tfevents*"))


def test_an_rl_only_pool_of_other_libraries(tmp_path, toolz_tasks):
    """[learn] rl_extra_dirs: whole libraries RL draws from, in no SFT trace and no evaluated split;
    a library also split for training or held out is refused; a pool too small for the run is said."""
    import shutil
    import tomllib

    from opencomposer.tasks.format import TaskMeta, write_task_toml
    first = sorted(p.parent for p in toolz_tasks.glob("*/task.toml"))[0]
    extra = tmp_path / "extra"
    shutil.copytree(first, extra / "minilib_1", symlinks=True)
    data = tomllib.loads((extra / "minilib_1" / "task.toml").read_text())
    data["id"], data["source"]["spec"] = "minilib_1", "minilib==1.0"
    (extra / "_envs").symlink_to(toolz_tasks / "_envs")  # the env the copied task names, relative to it
    write_task_toml(extra / "minilib_1" / "task.toml", TaskMeta.model_validate(data))
    out = tmp_path / "run"
    text = write_config(tmp_path, toolz_tasks, out).read_text()
    cfg = tmp_path / "extra.toml"
    cfg.write_text(text.replace("oracle_workers = 2", f'oracle_workers = 2\nrl_extra_dirs = ["{extra}"]'))
    c = load_config(cfg, lr.LearnConfig)
    out.mkdir()
    said: list[str] = []
    splits = lr.make_splits(c, out, None, said.append)
    assert [p.name for p in splits["rl_extra"]] == ["minilib_1"]
    assert json.loads((out / "splits.json").read_text())["rl_extra"] == ["minilib_1"]
    assert all("minilib_1" not in [p.name for p in splits[s]] for s in lr.SPLITS)
    pool = lr.rl_pool(c, splits, said.append)
    assert pool == splits["train"] + splits["rl_extra"] and not any("runs out" in m for m in said)
    c.run.steps = 10 * len(pool)
    lr.rl_pool(c, splits, said.append)
    assert f"runs out after step {len(pool)}" in said[-1]
    c.learn.rl_extra_dirs = [str(toolz_tasks)]  # the training library again
    with pytest.raises(SystemExit, match=r"libraries \['toolz'\] are also in train_dirs"):
        lr.make_splits(c, out, None, said.append)


def test_rl_s_extra_pool_may_change_until_rl_begins_and_after_only_grow(tmp_path, toolz_tasks):
    """A run whose SFT ran before its RL-only pool was complete: the pool may change (logged, splits.json
    rewritten) until RL's first update; after it, it may only grow (splits.json keeps the pool it grew from,
    whose RL checkpoints resume: earlier_rl_pool); any other split never changes."""
    import shutil
    import tomllib

    from opencomposer.tasks.format import TaskMeta, write_task_toml
    out = tmp_path / "run"
    out.mkdir()
    base = load_config(write_config(tmp_path, toolz_tasks, out), lr.LearnConfig)
    said: list[str] = []
    assert "rl_extra" not in lr.make_splits(base, out, None, said.append)  # SFT's session: no extra pool yet
    extra = tmp_path / "extra"
    (extra).mkdir()
    (extra / "_envs").symlink_to(toolz_tasks / "_envs")
    first = sorted(p.parent for p in toolz_tasks.glob("*/task.toml"))[0]
    for i in (1, 2):
        shutil.copytree(first, extra / f"minilib_{i}", symlinks=True)
        data = tomllib.loads((extra / f"minilib_{i}" / "task.toml").read_text())
        data["id"], data["source"]["spec"] = f"minilib_{i}", "minilib==1.0"
        write_task_toml(extra / f"minilib_{i}" / "task.toml", TaskMeta.model_validate(data))
    grown = base.model_copy(deep=True)
    grown.learn.rl_extra_dirs = [str(extra)]
    splits = lr.make_splits(grown, out, None, said.append)
    assert [p.name for p in splits["rl_extra"]] == ["minilib_1", "minilib_2"]
    assert json.loads((out / "splits.json").read_text())["rl_extra"] == ["minilib_1", "minilib_2"]
    assert "RL's extra pool 0 -> 2 tasks" in said[-2]
    shutil.rmtree(extra / "minilib_2")  # the pool changes again before RL: still allowed
    assert [p.name for p in lr.make_splits(grown, out, None, said.append)["rl_extra"]] == ["minilib_1"]
    assert lr.earlier_rl_pool(grown, splits, out) is None  # never grew while RL was at work
    (out / "rl_run").mkdir()
    (out / "rl_run" / "metrics.jsonl").write_text('{"step": 1}\n')  # RL's first update was made
    with pytest.raises(SystemExit, match=r"RL has begun and its extra pool may only grow, but 1 of its tasks are "
                                         r"missing now \(\['minilib_1'\]\)"):
        lr.make_splits(base, out, None, said.append)
    assert json.loads((out / "splits.json").read_text())["rl_extra"] == ["minilib_1"]  # unchanged
    shutil.copytree(first, extra / "minilib_2", symlinks=True)  # new tasks join the pool while RL is at work
    data = tomllib.loads((extra / "minilib_2" / "task.toml").read_text())
    data["id"], data["source"]["spec"] = "minilib_2", "minilib==1.0"
    write_task_toml(extra / "minilib_2" / "task.toml", TaskMeta.model_validate(data))
    splits = lr.make_splits(grown, out, None, said.append)
    assert "RL's extra pool grew 1 -> 2 tasks" in said[-2]
    saved = json.loads((out / "splits.json").read_text())
    assert saved["rl_extra"] == ["minilib_1", "minilib_2"] and saved[lr.GROWN_FROM] == ["minilib_1"]
    before = lr.earlier_rl_pool(grown, splits, out)  # the pool RL's checkpoints so far were written with
    now = [p.name for p in lr.rl_pool(grown, splits, said.append)]
    assert [p.name for p in before] == [n for n in now if n != "minilib_2"] and now[-1] == "minilib_2"
    lr.make_splits(grown, out, None, said.append)  # the same pool again: splits.json, and what it grew from, kept
    assert json.loads((out / "splits.json").read_text()) == saved
    other = grown.model_copy(deep=True)
    other.learn.validation_share = 0.2
    (out / "rl_run" / "metrics.jsonl").unlink()
    with pytest.raises(SystemExit, match="the splits differ from this run's"):
        lr.make_splits(other, out, None, said.append)  # SFT's and evaluation's splits never change


def test_an_earlier_sft_model_is_checked_against_the_held_out_libraries(tmp_path, toolz_tasks):
    """[learn] sft_model: another run's SFT model, evaluated and trained on by RL instead of a new SFT;
    refused when it is not a model directory, when what it trained on is unknown, or when that run
    trained on a library this run holds out."""
    out = tmp_path / "run"
    c = load_config(write_config(tmp_path, toolz_tasks, out), lr.LearnConfig)
    held = sorted(p.parent for p in toolz_tasks.glob("*/task.toml"))[:2]
    splits = {"heldout_libraries": held}
    earlier = tmp_path / "earlier"
    c.learn.sft_model = str(earlier / "sft_model")
    with pytest.raises(SystemExit, match="no config.json there"):
        lr.earlier_sft_model(c, splits)
    (earlier / "sft_model").mkdir(parents=True)
    (earlier / "sft_model" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="cannot be checked"):
        lr.earlier_sft_model(c, splits)
    lib = lr.library_of(held[0].name)
    (earlier / "splits.json").write_text(json.dumps({"train": [held[1].name, "HumanEval_53"]}))
    with pytest.raises(SystemExit, match=rf"trained on \['{lib}'\], which this run holds out"):
        lr.earlier_sft_model(c, splits)
    (earlier / "splits.json").write_text(json.dumps({"train": ["other-1.0__other__f__body", "HumanEval_53"]}))
    assert lr.earlier_sft_model(c, splits) == earlier / "sft_model"


def test_rl_only_files_keep_whole_files_from_sft(tmp_path):
    """[learn] rl_only_share: per library, whole files of the train split go to RL alone (about the
    share, as split_by_file holds out files; at least half the library stays with SFT); the same seed
    gives the same files."""
    from opencomposer.tasks.splits import task_key

    tasks = []
    for lib, files, per in (("a==1", 10, 2), ("b==2", 3, 1), ("c==3", 1, 4)):
        for f in range(files):
            for t in range(per):
                d = tmp_path / f"{lib[0]}_{f}_{t}"
                d.mkdir()
                (d / "task.toml").write_text(f'[source]\nspec = "{lib}"\n[feature]\nfile = "m{f}.py"\n')
                tasks.append(d)
    split = lr.Split(train=sorted(tasks))
    sft, rl = lr.rl_only_files(split, 0.3, seed=7)
    assert sorted(sft + rl) == sorted(tasks) and not set(sft) & set(rl)
    key = {d: task_key(d) for d in tasks}
    assert not {key[d] for d in sft} & {key[d] for d in rl}  # no file on both sides
    per_lib = lambda side, lib: sum(key[d][0] == lib for d in side)  # noqa: E731
    assert per_lib(rl, "a==1") == 6 and per_lib(rl, "b==2") == 1  # 30% of 20 tasks, of 3 (one file at least)
    assert per_lib(rl, "c==3") == 0 and per_lib(sft, "c==3") == 4  # a one-file library trains whole
    assert lr.rl_only_files(split, 0.3, seed=7) == (sft, rl)
    assert lr.rl_only_files(split, 0.3, seed=8)[1] != rl


def test_rl_without_sft_tasks_needs_another_pool(tmp_path, toolz_tasks):
    out = tmp_path / "run"
    text = write_config(tmp_path, toolz_tasks, out).read_text()
    cfg = tmp_path / "only.toml"
    cfg.write_text(text.replace("oracle_workers = 2", "oracle_workers = 2\nrl_sft_tasks = false"))
    with pytest.raises(ConfigError, match="rl_sft_tasks = false leaves RL no tasks"):
        load_config(cfg, lr.LearnConfig)
    cfg.write_text(text.replace("oracle_workers = 2", "oracle_workers = 2\nrl_sft_tasks = false\nrl_only_share = 0.5"))
    c = load_config(cfg, lr.LearnConfig)
    out.mkdir()
    splits = lr.make_splits(c, out, None, lambda m: None)
    ids = json.loads((out / "splits.json").read_text())
    assert ids["rl_only"] and not set(ids["rl_only"]) & set(ids["train"])
    assert lr.rl_pool(c, splits, lambda m: None) == splits["rl_only"]  # never a task SFT fitted


def test_the_next_step_is_budgeted_as_the_slowest_recent_one():
    clock = lr.Clock(deadline_s=100.0)
    assert clock.sec_per_step == 40.0  # nothing measured yet
    clock.step_seconds += [30.0, 66.0, 50.0]
    assert clock.sec_per_step == pytest.approx(1.2 * 66.0)  # not the last (50): one slow step of three counts
    clock.step_seconds += [20.0, 20.0, 20.0]
    assert clock.sec_per_step == pytest.approx(24.0)  # only the last three
    assert not lr.Clock(deadline_s=10.0).fits(lr.Clock(deadline_s=10.0).sec_per_step)


def test_a_split_longer_than_a_call_is_evaluated_in_chunks_over_calls(tmp_path, toolz_tasks):
    """A held-out split can outlast one device call (1,200 episodes at ~0.4 s): it is evaluated in chunks of
    whole tasks, each written as it ends; the next call finishes the rest with the same weights, and the
    results hold every task's k episodes once. A leftover chunk of other tasks is refused by name."""
    from collections import Counter

    from opencomposer.tasks.format import Task

    out = tmp_path / "run"
    out.mkdir()
    cfg = lr.config_with(write_config(tmp_path, toolz_tasks, out),
                         ["learn.eval_concurrency=3", "learn.humaneval_heldout=[2, 4, 6]"])  # a task fills it
    splits = lr.make_splits(cfg, out, None, lambda *_: None)
    tasks = splits["humaneval_heldout"]
    assert len(tasks) == 3
    k = cfg.learn.heldout_k

    class OneChunk(lr.Clock):
        """Time for one task's episodes at the first look, none after: the end of a call."""

        def __init__(self):
            super().__init__(None)
            self.looks = 0

        def left(self) -> float:
            self.looks += 1
            return 1.5 * k * self.sec_per_episode if self.looks == 1 else 0.0

    split_dir = out / "base" / "humaneval_heldout"
    run = lr.RLRun(lr.sub_config(cfg, out / "base"), splits["train"], out / "base")
    try:
        with pytest.raises(lr.OutOfTime, match=f"base/humaneval_heldout \\(1 of {len(tasks)} tasks done\\)"):
            lr.eval_split(run, cfg, "base", "humaneval_heldout", tasks, out, OneChunk(), lambda *_: None)
        assert [p.name for p in (split_dir / "chunks").iterdir()] == ["0000.json"]
        assert not (split_dir / "results.json").exists()
        res = lr.eval_split(run, cfg, "base", "humaneval_heldout", tasks, out, lr.Clock(None), lambda *_: None)
    finally:
        run.actor.policy.close()
    per_task = Counter(r["task_id"] for r in res["episodes"])
    assert set(per_task) == {Task.load(p).meta.id for p in tasks} and set(per_task.values()) == {k}
    assert res["k"] == k and not (split_dir / "chunks").exists()
    assert json.loads((split_dir / "results.json").read_text())["summary"] == res["summary"]

    other = out / "rl" / "humaneval_heldout" / "chunks"  # left by an evaluation of other tasks
    other.mkdir(parents=True)
    (other / "0000.json").write_text(json.dumps({"k": k, "seconds": 1.0, "episodes": [{"task_id": "not-in-this-split"}]}))
    with pytest.raises(SystemExit, match=r"0000.json: a partial evaluation of other tasks \(\['not-in-this-split'\]\)"):
        lr.eval_split(None, cfg, "rl", "humaneval_heldout", tasks, out, lr.Clock(None), lambda *_: None)


def test_rl_rollouts_on_a_server_process_of_its_own(tmp_path, toolz_tasks, capsys, monkeypatch):
    """[learn] rollout_server: RL samples from an `opencomposer serve` of the SFT model that the run starts in a
    child process, which follows a weight store under the run (LoRA's weights merged, as the GPU run trains); the
    RL stages' evaluations go through it too (no engine is built in this process once it is up), and the server
    is gone when the run returns."""
    import subprocess

    from opencomposer.inference.engine.core import Engine

    start = lr.RolloutServer._start

    def start_then_no_engine_here(self):
        served = start(self)
        monkeypatch.setattr(Engine, "for_agents", classmethod(lambda *a, **k: pytest.fail("an in-process engine")))
        return served

    monkeypatch.setattr(lr.RolloutServer, "_start", start_then_no_engine_here)
    out = tmp_path / "run"
    cfg = write_config(tmp_path, toolz_tasks, out)
    assert lr.main(["--config", str(cfg), "--set", 'eval.stages=["sft", "rl"]', "--set", "learn.rl_lora=true",
                    "--set", 'learn.eval_splits=["validation"]', "--set", "learn.rollout_server=true"]) == 0
    printed = capsys.readouterr().out
    assert "RL: rollouts on http://127.0.0.1:" in printed and "opencomposer serve of" in printed
    row = json.loads((out / "rl_run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["step"] == 1 and row["rollouts"] == 2 and row["policy_version"] == 0
    # the weights RL starts from went to the store whole (tiny-random's 20 tensors, adapters merged)
    snapshot = json.loads(next((out / "serve_store").glob("0000000000-*-full/rank00000-of-00001.json")).read_text())
    names = set(snapshot["tensors"])
    assert snapshot["version"] == 0 and "model.layers.0.self_attn.q_proj.weight" in names
    assert not [n for n in names if "lora" in n or "base_layer" in n]
    assert (out / "rl@1" / "validation" / "results.json").exists() and (out / "rl" / "validation" / "results.json").exists()
    left = subprocess.run(["pgrep", "-f", f"--weights-from {out / 'serve_store'}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"the server outlived the run: pid {left.stdout.strip()}"
