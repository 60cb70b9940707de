"""The factory end to end on two tiny real sdists: one library makes validated tasks (all
checked and solved by the oracle), with its flaky test found and dropped; one will not run its
tests and is reported with the reason while the run goes on; ``harder`` moves the next batch
from block-level to feature-level tasks."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
from testkit.dists import make_sdist

from opencomposer.config import validate
from opencomposer.episode.run import run_task
from opencomposer.grading.check import check_task, staged_check
from opencomposer.policies.oracle import OraclePolicy
from opencomposer.tasks.factory import FactoryConfig, TaskFactory
from opencomposer.tasks.format import Task, find_tasks

CORE = '''\
"""Small text utilities."""
from minilib.util import clean, shout


def words(text):
    """Split text into clean words."""
    out = []
    for w in text.split():
        w = clean(w)
        if w:
            out.append(w)
    return out


def count(text):
    """Count each word."""
    seen = {}
    for w in words(text):
        seen[w] = seen.get(w, 0) + 1
    if not seen:
        return {}
    return dict(sorted(seen.items()))


def longest(text):
    """The longest word."""
    best = ""
    for w in words(text):
        if len(w) > len(best):
            best = w
    return best
'''

UTIL = '''\
def clean(word):
    """Lower-case, strip punctuation."""
    word = word.lower()
    word = word.strip(".,;:!?")
    return word


def shout(word):
    """Upper-case, with a bang."""
    word = word.upper()
    word = word + "!"
    return word
'''

TESTS = '''\
from pathlib import Path
from minilib.core import count, longest, words
from minilib.util import clean, shout

COUNTER = Path({counter!r})


def test_words():
    assert words("Hello, world!") == ["hello", "world"]
    assert words("  ") == []


def test_count():
    assert count("a b a") == {{"a": 2, "b": 1}}
    assert count("") == {{}}


def test_longest():
    assert longest("a bbb cc") == "bbb"


def test_clean():
    assert clean("Hi!") == "hi"


def test_shout():
    assert shout("a") == "A!"


def test_flaky():
    n = int(COUNTER.read_text()) if COUNTER.exists() else 0
    COUNTER.write_text(str(n + 1))
    assert n % 2 == 0
'''


@pytest.mark.slow  # two small venvs, three suite runs and a dozen validations: ~1-2 minutes
def test_factory_makes_reports_and_gets_harder(tmp_path: Path) -> None:
    good = make_sdist(tmp_path, "minilib", {
        "minilib/__init__.py": "", "minilib/core.py": CORE, "minilib/util.py": UTIL,
        "tests/test_core.py": TESTS.format(counter=str(tmp_path / "flaky-count"))})
    bad = make_sdist(tmp_path, "brokenlib", {
        "brokenlib/__init__.py": "X = 1\n",
        # its only test fails against the code as shipped (X is 1): the library cannot be used
        "tests/test_b.py": "from brokenlib import X\n\n\ndef test_b():\n    assert X == 2\n"})
    cfg = validate({
        "factory": {"max_per_library": 3, "workers": 1, "test_timeout": 120,
                    "backend": "local"},  # by name: test_flaky counts its runs in a host file
        "difficulty": {"position": 1.0, "width": 0.5, "floor": 0.0, "step": 4.0},
        "libraries": [{"spec": str(bad)}, {"spec": str(good)}],
    }, FactoryConfig, "test")
    out = tmp_path / "tasks"
    factory = TaskFactory(cfg, out, check=staged_check("local"))  # as `tasks make --config` does
    s = factory.make().summary()
    assert s["failed"] and "brokenlib" in next(iter(s["failed"])) and \
        "its tests cannot run here" in next(iter(s["failed"].values()))
    assert s["install_success_rate"] == 0.5 and s["libraries_with_tasks"] == 1
    lib = s["per_library"][str(good)]
    assert lib["install"] == "recipe" and lib["flaky"] == 1 and lib["baseline_passed"] == 5
    assert lib["made"] >= 2 and set(lib["levels"]) == {"block"}, lib
    assert lib["runs"]["grade"] >= lib["made"], lib  # every task written was graded in its staging dir first
    assert (out / "factory_summary.json").exists()
    factory.harder(0.9)  # the policy solves most: next batch at the top of the ladder
    s2 = factory.make().summary()
    assert set(s2["levels"]) == {"feature"} and s2["made"] >= 1, s2
    assert s2["per_library"][str(good)]["install"] == "cached"
    tasks = find_tasks([out])
    assert len(tasks) == lib["made"] + s2["made"]
    for p in tasks:
        t = Task.load(p)
        assert "tests/test_core.py::test_flaky" not in t.meta.tests.fail_to_pass + t.meta.tests.pass_to_pass
        res = check_task(p, "local")
        assert res.ok, res.problems
        ep = run_task(t, OraclePolicy(t), "local")
        assert ep.reward.reward == 1.0, ep.reward.details
    features = [Task.load(p) for p in tasks if Task.load(p).meta.feature.level == "feature"]
    assert any(t.gold_patch.count("diff --git") == 2 for t in features)  # words + clean: two files


@pytest.mark.slow  # one small venv, three suite runs, a dozen candidates: ~1 minute
def test_factory_never_writes_a_task_the_leak_probe_flags(tmp_path: Path) -> None:
    """The sdist ships an archive holding a copy of ``count`` and ``longest`` (as some ship
    fixture archives or vendored wheels): deletions from them are recoverable from it, so the
    factory's leak probe rejects those candidates before writing them; deletions from
    ``words`` are made."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("backup/core.py", CORE[CORE.index("def count"):])
    lib = make_sdist(tmp_path, "minilib", {
        "minilib/__init__.py": "", "minilib/core.py": CORE, "minilib/util.py": UTIL,
        "tests/test_core.py": TESTS.format(counter=str(tmp_path / "flaky-count"))})
    # add the archive to the sdist (text files only go through make_sdist)
    root = tmp_path / "src" / "minilib-0.1"
    (root / "minilib" / "data").mkdir()
    (root / "minilib" / "data" / "backup.zip").write_bytes(buf.getvalue())
    with tarfile.open(lib, "w:gz") as t:
        t.add(root, arcname=root.name)
    cfg = validate({
        "factory": {"max_per_library": 20, "workers": 1, "test_timeout": 120,
                    "backend": "local"},  # by name: test_flaky counts its runs in a host file
        "difficulty": {"position": 3.0, "width": 4.0},
        "libraries": [{"spec": str(lib)}],
    }, FactoryConfig, "test")
    out = tmp_path / "tasks"
    s = TaskFactory(cfg, out).make().summary()
    rejected = s["per_library"][str(lib)]["rejected"]
    assert rejected.get("the leak probe found the deleted code", 0) >= 1, rejected
    tasks = [p for p in find_tasks([out]) if (p / "task.toml").exists()]
    assert tasks, rejected
    for p in tasks:
        t = Task.load(p)
        assert t.meta.feature.symbol not in ("count", "longest"), t.meta.feature
        assert check_task(p, "local").ok


@pytest.mark.slow  # one small venv, three suite runs, a dozen candidates and their grades: ~1-2 minutes
def test_factory_never_writes_a_task_the_grader_voids(tmp_path: Path) -> None:
    """``test_clean`` records each run in ``tests/last_run.txt`` (as snapshot suites rewrite their
    files). The factory's own test runs accept deletions that select it, but the grader watches the
    test files and voids any run that changes one: no agent could earn those tasks' reward, so the
    factory's last check (the grader on the staged task) rejects them, the journal says why, and
    only tasks whose tests leave the files alone are written."""
    import json

    tests_util = ("import time\nfrom pathlib import Path\nfrom minilib.util import clean, shout\n\n\n"
                  "def test_clean():\n    assert clean(\"Hi!\") == \"hi\"\n"
                  "    (Path(__file__).parent / \"last_run.txt\").write_text(str(time.time()))\n\n\n"
                  "def test_shout():\n    assert shout(\"a\") == \"A!\"\n")
    core_tests = TESTS.format(counter="unused")
    core_tests = core_tests[:core_tests.index("def test_clean")]  # test_core.py: words, count, longest
    lib = make_sdist(tmp_path, "minilib", {
        "minilib/__init__.py": "", "minilib/core.py": CORE, "minilib/util.py": UTIL,
        "tests/test_core.py": core_tests, "tests/test_util.py": tests_util, "tests/last_run.txt": "never\n"})
    cfg = validate({
        "factory": {"max_per_library": 20, "workers": 1, "test_timeout": 120, "backend": "local"},
        "difficulty": {"position": 1.0, "width": 4.0},
        "libraries": [{"spec": str(lib)}],
    }, FactoryConfig, "test")
    out = tmp_path / "tasks"
    s = TaskFactory(cfg, out, check=staged_check("local")).make().summary()
    rejected = s["per_library"][str(lib)]["rejected"]
    assert rejected.get("the grader rejects it (start or gold)", 0) >= 1, rejected
    journal = [json.loads(ln) for f in (out / "_journal").glob("*.jsonl") for ln in f.read_text().splitlines()]
    details = [j["detail"] for j in journal if j.get("outcome") == "the grader rejects it (start or gold)"]
    assert details and all("test files changed on disk during the run" in d for d in details), details
    tasks = [p for p in find_tasks([out]) if (p / "task.toml").exists()]
    assert tasks, rejected  # deletions whose tests stay in test_core.py are made
    for p in tasks:
        t = Task.load(p)
        assert all(not x.startswith("tests/test_util.py") for x in t.meta.tests.targets), t.meta.tests.targets
        assert check_task(p, "local").ok
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging dir left behind
