"""The grade of an episode: a fresh sandbox, only the carried changes, hidden tests laid last, a canary."""

from __future__ import annotations

import pytest

from opencomposer.grading import Carry, grade
from opencomposer.grading.grade import opener, patch_carry
from opencomposer.sandbox.namespace import unavailable_reason

BACKENDS = ["local", pytest.param("namespace", marks=[pytest.mark.namespace, pytest.mark.skipif(
    bool(unavailable_reason()), reason=str(unavailable_reason()))])]
CLAMP = b"\n\ndef clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n"


def ops(task) -> bytes:
    return (task.workspace / "minicalc/ops.py").read_bytes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gold_passes_and_nothing_fails(minicalc_task, backend):
    task, open_sandbox = minicalc_task, opener(backend)
    start = grade(task, Carry(), open_sandbox)
    assert start.reward == 0.0 and start.details["canary"] == "FAILED" and start.details["tampered"] == ""
    gold = grade(task, patch_carry(task, task.gold_patch, open_sandbox), open_sandbox)
    assert gold.reward == 1.0, gold.details
    assert gold.details["canary"] == "FAILED" and gold.details["report"] == "ok"


def test_carried_code_is_what_is_graded(minicalc_task):
    task = minicalc_task
    init = b"from .ops import add, clamp, mul\n"
    ok = grade(task, Carry(files={"minicalc/ops.py": ops(task) + CLAMP, "minicalc/__init__.py": init}), opener("local"))
    assert ok.reward == 1.0, ok.details
    wrong = CLAMP.replace(b"max(lo, min(x, hi))", b"x")
    bad = grade(task, Carry(files={"minicalc/ops.py": ops(task) + wrong, "minicalc/__init__.py": init}), opener("local"))
    assert bad.reward == 0.0 and bad.details["fail_to_pass"] == {"tests/test_ops.py::test_clamp": "FAILED"}


@pytest.mark.parametrize("fail_fast", [False, True])
def test_a_runner_rewired_to_pass_everything_is_caught_by_the_canary(minicalc_task, fail_fast):
    """Code under test that patches pytest's reports at import: every test 'passes', the canary too (with
    ``fail_fast`` too: nothing fails, so nothing stops the run before the canary)."""
    task = minicalc_task
    rewire = (b"import _pytest.reports\n"
              b"_orig = _pytest.reports.TestReport.__init__\n"
              b"def _init(self, *a, **k):\n"
              b"    _orig(self, *a, **k)\n"
              b"    self.outcome = 'passed'\n"
              b"_pytest.reports.TestReport.__init__ = _init\n")
    init = b"from .ops import add, mul\nfrom . import _hook\n"
    res = grade(task, Carry(files={"minicalc/_hook.py": rewire, "minicalc/__init__.py": init}), opener("local"),
                fail_fast=fail_fast)
    assert res.details["fail_to_pass"] == {"tests/test_ops.py::test_clamp": "PASSED"}  # the forgery works...
    assert "canary" in res.details["tampered"] and res.details["canary"] == "PASSED"  # ...and gives itself away
    assert res.reward == 0.0


def test_fail_fast_gives_the_same_reward_and_stops_at_the_first_must_pass_failure(minicalc_task):
    """The default of episodes ([agent] grade_fail_fast): the gold still earns 1 with every test run and the
    canary failing; the unchanged workspace earns 0 as the full run does, stopped at its failing test."""
    task, op = minicalc_task, opener("local")
    gold = patch_carry(task, task.gold_patch, op)
    full, fast = grade(task, gold, op), grade(task, gold, op, fail_fast=True)
    assert full.reward == fast.reward == 1.0 and fast.details["stopped_at"] == ""
    assert fast.details["fail_to_pass"] == full.details["fail_to_pass"] and fast.details["canary"] == "FAILED"
    full, fast = grade(task, Carry(), op), grade(task, Carry(), op, fail_fast=True)
    assert full.reward == fast.reward == 0.0 and full.details["stopped_at"] == ""
    assert fast.details["stopped_at"] in task.meta.tests.fail_to_pass + task.meta.tests.pass_to_pass
    assert fast.details["fail_to_pass"][fast.details["stopped_at"]] in ("FAILED", "ERROR")


def test_deleted_files_are_deleted(minicalc_task):
    res = grade(minicalc_task, Carry(deleted=["minicalc/ops.py"]), opener("local"))
    assert res.reward == 0.0 and res.details["p2p_passed"] == 0


def test_test_files_rewritten_on_disk_during_the_run_are_caught(minicalc_task):
    """Code under test that, when imported, rewrites the hidden test files (and the canary) into passes."""
    task = minicalc_task
    rewrite = (b"import pathlib, re\n"
               b"for p in pathlib.Path('tests').glob('test_*.py'):\n"
               b"    p.write_text(re.sub(r'(def test_\\w+\\(\\):)(\\n    .*)+', r'\\1\\n    pass', p.read_text()))\n")
    init = b"from .ops import add, mul\nfrom . import _hook\n"
    res = grade(task, Carry(files={"minicalc/_hook.py": rewrite, "minicalc/__init__.py": init}), opener("local"))
    assert res.reward == 0.0
    assert "test files changed on disk" in res.details["tampered"], res.details


def test_a_canary_of_a_test_whose_decorator_reads_its_name_is_collected():
    """tinycss2's ``@json_test()`` parametrizes a test from ``<its name without test_>.json``: a canary defined under
    a new name asked for a file that does not exist, the whole test file failed to collect, and the gold earned 0."""
    from opencomposer.grading.grade import _clone_source

    src = ("import pytest\n\nDATA = {'one_rule.json': [1, 2]}\n\n\ndef json_test():\n    def decorator(function):\n"
           "        cases = DATA[function.__name__.split('_', 1)[-1] + '.json']\n\n"
           "        @pytest.mark.parametrize('x', cases)\n        def test(x):\n            assert function(x)\n"
           "        return test\n    return decorator\n\n\n@json_test()\ndef test_one_rule(x):\n    return x > 0\n")
    clone = _clone_source(src, "test_one_rule", "test_one_rule_more", "assert 5 == 6")
    space: dict = {}
    exec(compile(src + "\n\n" + clone, "t.py", "exec"), space)  # before the fix: KeyError 'one_rule_more.json'
    space["test_one_rule"](1)  # the original is the original again
    with pytest.raises(AssertionError):
        space["test_one_rule_more"](1)
    assert [m.args for m in space["test_one_rule_more"].pytestmark] == [("x", [1, 2])]


def test_a_test_helper_rewritten_during_the_run_is_caught(minicalc_task):
    """Not a hidden test file but one the tests load (the base's ``tests/conftest.py``)."""
    task = minicalc_task
    hook = b"import pathlib\npathlib.Path('tests/conftest.py').write_text('collect_ignore = [\"x\"]\\n')\n"
    init = b"from .ops import add, mul\nfrom . import _hook\n"
    res = grade(task, Carry(files={"minicalc/_hook.py": hook, "minicalc/__init__.py": init}), opener("local"))
    assert res.reward == 0.0 and "tests/conftest.py" in res.details["tampered"], res.details


def test_the_canary_copy_fails_even_when_its_original_returns_early():
    """boltons' tests end in a bare ``return``: a false assertion appended after it never ran, and the
    oracle's canary passed (3 of 198 tasks in benchmarks/bench_grader.py, before the fix)."""
    from opencomposer.grading.grade import _clone_source

    src = ("import pytest\n\n\n@pytest.mark.parametrize('n', [1, 2])\ndef test_orig(n, tmp=None):\n"
           "    if n:\n        return\n    assert False\n")
    clone = _clone_source(src, "test_orig", "test_orig_again", "assert 1 == 2")
    space: dict = {}
    exec(compile(src + "\n\n" + clone, "t.py", "exec"), space)
    space["test_orig"](1)  # the original passes
    with pytest.raises(AssertionError):
        space["test_orig_again"](1)
    assert "@pytest.mark.parametrize('n', [1, 2])\ndef test_orig(n, tmp=None):" in clone
    assert space["test_orig_again"] is not space["test_orig"] and "_test_orig_again_original" not in space
    assert _clone_source("async def test_a():\n    pass\n", "test_a", "test_b", "assert 0") is None  # plain canary then


def test_a_hanging_test_run_is_cut_at_the_grade_timeout(minicalc_task):
    """An edit whose code never returns: the grade ends at ``timeout`` (not the task's 300 s), unrewarded."""
    import time
    task = minicalc_task
    hang = b"\n\ndef clamp(x, lo, hi):\n    while True:\n        pass\n"
    init = b"from .ops import add, clamp, mul\n"
    t0 = time.monotonic()
    res = grade(task, Carry(files={"minicalc/ops.py": ops(task) + hang, "minicalc/__init__.py": init}),
                opener("local"), timeout=3)
    took = time.monotonic() - t0
    assert task.meta.tests.timeout > 60 and took < 30, took
    assert res.reward == 0.0 and not res.passed
    assert "timed out" in res.details["report"], res.details


def test_an_episode_is_graded_under_the_agent_configs_grade_timeout(minicalc_task):
    """``[agent] grade_timeout`` reaches the grader through ``run_task``, the path of eval and RL rollouts."""
    import time
    from opencomposer.config import AgentConfig
    from opencomposer.episode.run import run_task
    from opencomposer.policies.scripted import ScriptedPolicy, tool_call
    task = minicalc_task
    hang = (ops(task) + b"\n\ndef clamp(x, lo, hi):\n    while True:\n        pass\n").decode()
    init = "from .ops import add, clamp, mul\n"
    turns = [[tool_call("write_file", path="minicalc/ops.py", content=hang)],
             [tool_call("write_file", path="minicalc/__init__.py", content=init)], [tool_call("submit", message="done")]]
    ep = run_task(task, ScriptedPolicy(turns), "local", AgentConfig(max_turns=4, grade_timeout=3))
    assert ep.reward.reward == 0.0 and ep.seconds["reward"] < 30, ep.seconds
    assert "timed out" in ep.reward.details["report"], ep.reward.details


def test_a_task_whose_gold_run_the_grader_voids_is_refused_by_check_naming_why(minicalc_task, tmp_path, monkeypatch):
    """A hidden test that writes to its own file (tomlkit's suite writes an example file back) makes the
    grader void every run, the gold patch's too: no agent could earn the reward, so check says so.
    (The leak scan, which reads the whole env, is not what this is about: left out.)"""
    import shutil

    from opencomposer.grading import check
    from opencomposer.grading.check import check_task

    monkeypatch.setattr(check, "leak_scan", lambda task: ({}, {}))

    root = tmp_path / "task"
    shutil.copytree(minicalc_task.root, root, symlinks=True)
    (tmp_path / "_envs").symlink_to(minicalc_task.root.parent / "_envs")  # its env, named relative to the task
    hidden = next(p for p in (root / "tests").rglob("test_ops.py"))
    text = hidden.read_text()
    assert "def test_clamp():\n" in text
    hidden.write_text(text.replace("def test_clamp():\n", "def test_clamp():\n    open(__file__, 'a').close()\n"))
    res = check_task(root, "local")
    assert not res.ok
    assert any(p.startswith("the grader voids the gold patch's run (its tests pass): ") and "writes a test file" in p
               for p in res.problems), res.problems


@pytest.mark.parametrize("fail_fast", [True, False])
def test_episodes_grade_under_the_agent_configs_fail_fast(minicalc_task, fail_fast):
    """``[agent] grade_fail_fast`` (on by default) reaches the grader through ``run_task``, eval's and RL's path."""
    from opencomposer.config import AgentConfig
    from opencomposer.episode.run import run_task
    from opencomposer.policies.scripted import ScriptedPolicy, tool_call
    ep = run_task(minicalc_task, ScriptedPolicy([[tool_call("submit", message="done")]]), "local",
                  AgentConfig(max_turns=2, grade_fail_fast=fail_fast))
    assert ep.reward.reward == 0.0 and bool(ep.reward.details["stopped_at"]) == fail_fast
    assert AgentConfig().grade_fail_fast


def test_a_canary_is_never_a_copy_of_a_test_expected_to_fail(minicalc_task, tmp_path):
    """ftfy's FAIL_TO_PASS tests include ``@pytest.mark.xfail(strict=True) test_failing_json_example``: the gold
    makes its assertion fail (XFAIL, a pass). A canary copied from it kept the marker, failed as it must and was
    reported XFAIL, which reads as a forgery: the gold patch earned 0. Now such a test is not the canary's model;
    a plain failing function is, and is reported FAILED."""
    import shutil

    from opencomposer.tasks.format import Task

    root = minicalc_task.root.parent / f"xfail-{tmp_path.name}"  # beside it: the same environment
    shutil.copytree(minicalc_task.root, root, symlinks=True)
    hidden = root / "tests" / "files" / "tests" / "test_ops.py"
    src = hidden.read_text()
    body = src[src.index("def test_clamp"):]
    hidden.write_text("import pytest\n" + src.replace(body, "@pytest.mark.xfail(strict=True)\ndef test_clamp():\n"
                      "    import minicalc.ops as ops\n    assert not hasattr(ops, 'clamp')  # until the fix\n"))
    task, open_sandbox = Task.load(root), opener("local")
    start = grade(task, Carry(), open_sandbox)
    assert start.reward == 0.0 and start.details["fail_to_pass"] == {"tests/test_ops.py::test_clamp": "FAILED"}  # XPASS(strict)
    gold = grade(task, patch_carry(task, task.gold_patch, open_sandbox), open_sandbox)
    assert gold.details["fail_to_pass"] == {"tests/test_ops.py::test_clamp": "XFAIL"}
    assert gold.reward == 1.0 and gold.details["canary"] == "FAILED", gold.details["tampered"]
