"""Train / held-out splits share no task id and no deleted symbol of one library version:
tasks deleting the same function at several levels land on one side together, and a
split.json that puts them on both sides is refused naming both tasks.

Run: ``pytest tests/unit/rl/test_split.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opencomposer.rl.taskpool import split_key, split_tasks, without_heldout
from opencomposer.tasks.format import (
    FeatureInfo,
    SourceInfo,
    Task,
    TaskMeta,
    TestsInfo,
    write_task_toml,
)


def make_task(root: Path, symbol: str, level: str = "body", spec: str = "lib==1.0", tid: str | None = None) -> Path:
    (root / "workspace").mkdir(parents=True)
    (root / "solution").mkdir()
    (root / "solution" / "gold.patch").write_text("")
    (root / "instruction.md").write_text(f"Implement `{symbol}`.\n")
    write_task_toml(root / "task.toml", TaskMeta(
        id=tid or root.name, source=SourceInfo(spec=spec),
        feature=FeatureInfo(level=level, file="lib/core.py", symbol=symbol),
        tests=TestsInfo(command="pytest", files=["t.py"], targets=["t.py"], fail_to_pass=["t.py::a"])))
    return root


@pytest.fixture
def pool(tmp_path: Path) -> list[Path]:
    d = tmp_path / "tasks"
    tasks = [make_task(d / f"lib__f__{lv}", "f", lv) for lv in ("block", "body", "function")]
    tasks += [make_task(d / f"lib__{s}__body", s) for s in ("g", "h", "k", "m")]
    tasks.append(make_task(d / "lib2__f__body", "f", spec="lib==2.0"))  # another version: another symbol
    return sorted(tasks)


@pytest.mark.parametrize("seed", range(8))
def test_drawn_splits_keep_a_symbol_on_one_side(pool, tmp_path, seed):
    train, held = split_tasks(pool, 3, seed, tmp_path / f"run{seed}")
    assert len(held) == 3 and sorted(train + held) == pool
    keys = lambda ps: {split_key(Task.load(p).meta) for p in ps}
    assert not keys(train) & keys(held)
    f_side = {p in held for p in pool if p.name.startswith("lib__f__")}
    assert len(f_side) == 1  # block, body and function of f together
    saved = json.loads((tmp_path / f"run{seed}" / "split.json").read_text())
    assert split_tasks(pool, 3, seed, tmp_path / f"run{seed}") == (train, held)  # read back
    assert sorted(saved["heldout_ids"]) == sorted(p.name for p in held)


def test_a_split_file_sharing_a_symbol_is_refused_naming_both(pool, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    names = [p.name for p in pool]
    held = ["lib__f__body"]
    (run / "split.json").write_text(json.dumps({"train": [n for n in names if n not in held], "heldout": held}))
    with pytest.raises(ValueError) as e:
        split_tasks(pool, 1, 0, run)
    msg = str(e.value)
    assert "split.json" in msg and "held-out task" in msg and str(pool[names.index("lib__f__body")]) in msg
    assert "lib__f__block" in msg and "'f'" in msg and "pypi:lib==1.0" in msg


def test_a_shared_task_id_is_refused(tmp_path):
    a = make_task(tmp_path / "a" / "one", "f", tid="same")
    b = make_task(tmp_path / "b" / "two", "g", tid="same")
    run = tmp_path / "run"
    run.mkdir()
    (run / "split.json").write_text(json.dumps({"train": ["one"], "heldout": ["two"]}))
    with pytest.raises(ValueError, match=r"training task .*one and held-out task .*two share the task id 'same'"):
        split_tasks([a, b], 1, 0, run)
    assert split_tasks([a, b, make_task(tmp_path / "c" / "three", "h")], 1, 0, tmp_path / "r2")[1] == [
        tmp_path / "c" / "three"]  # drawn: the two of one id stay together


def test_tasks_added_later_never_teach_a_heldout_symbol(pool, tmp_path):
    run = tmp_path / "run"
    _, held = split_tasks(pool, 3, 1, run)
    later = tmp_path / "factory_tasks"
    sym = Task.load(held[0]).meta.feature.symbol
    spec = Task.load(held[0]).meta.source.spec
    clash = make_task(later / "new__clash__block", sym, "block", spec=spec)
    fine = make_task(later / "new__other__body", "zzz")
    assert without_heldout([clash, fine], run) == [fine]
