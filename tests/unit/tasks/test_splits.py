"""tasks/splits.py: by-file splits keep a file's tasks together, are seeded, and refuse bad input."""

from pathlib import Path

import pytest

from opencomposer.tasks.splits import SplitError, split_by_file


def make(root: Path, spec: str, file: str, n: int) -> list[Path]:
    out = []
    for i in range(n):
        d = root / f"{spec.replace('==', '-')}__{file.replace('/', '_')}__{i}"
        d.mkdir(parents=True)
        (d / "task.toml").write_text(f'[source]\nspec = "{spec}"\n[feature]\nlevel = "body"\nfile = "{file}"\n')
        out.append(d)
    return out


@pytest.fixture
def pool(tmp_path: Path) -> list[Path]:
    dirs = []
    for lib in ("liba==1.0", "libb==2.0"):
        for j in range(12):
            dirs += make(tmp_path, lib, f"pkg/mod{j}.py", 1 + j % 3)
    dirs += make(tmp_path, "single==0.1", "single.py", 7)  # one file: trains whole
    return dirs


def test_files_never_straddle_sides_and_shares_hold(pool):
    s = split_by_file(pool, heldout=0.2, validation=0.1, seed=3)
    assert len(s.train) + len(s.validation) + len(s.heldout) == len(pool)
    side_of = {}
    for side in ("train", "validation", "heldout"):
        for d in getattr(s, side):
            key = d.name.rsplit("__", 1)[0]
            assert side_of.setdefault(key, side) == side, f"{key} is on two sides"
    for lib in ("liba-1.0", "libb-2.0"):
        held = sum(d.name.startswith(lib) for d in s.heldout)
        total = sum(d.name.startswith(lib) for d in pool)
        assert 0.2 * total <= held <= 0.3 * total
        assert sum(d.name.startswith(lib) for d in s.train) >= total / 2
    assert all(d.name.startswith("single") for d in s.train if "single" in d.name)
    assert not any("single" in d.name for d in s.heldout + s.validation)


def test_seeded_and_independent_of_order(pool):
    a = split_by_file(pool, heldout=0.2, validation=0.1, seed=3)
    assert split_by_file(list(reversed(pool)), 0.2, 0.1, seed=3).groups == a.groups
    assert split_by_file(pool, 0.2, 0.1, seed=4).groups != a.groups


def test_bad_input_is_named(tmp_path, pool):
    with pytest.raises(SplitError, match="heldout share"):
        split_by_file(pool, heldout=1.5, validation=0.1, seed=0)
    with pytest.raises(SplitError, match="less than half"):
        split_by_file(pool, heldout=0.3, validation=0.3, seed=0)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "task.toml").write_text('[source]\nkind = "humaneval"\n')
    with pytest.raises(SplitError, match=r"bad/task.toml.*\[feature\] file"):
        split_by_file([bad], 0.1, 0.1, seed=0)
