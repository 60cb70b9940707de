"""The test reward, graded where the agent never ran: a fresh sandbox, the agent's code changes, the hidden tests.

    with open_sandbox(task.sandbox_spec()) as sb:         # the episode
        ...agent...
        carry = collect(task.workspace, sb, workspace_changes(task.workspace, sb))
    result = grade(task, carry, open_sandbox)            # after the episode's sandbox is gone

``grade`` opens a *new* sandbox of the task's base image (with ``open_sandbox``, the same
factory the episode used: a backend, a pool's lease or a cluster's), writes the carried
files into it (``carry.py`` decides which), removes the carried deletions, lays every hidden
test file last (over whatever is there) plus a canary test that must fail, runs the task's
pytest command under the launcher (``tasks/testrun.py``, the factory's runner too), and reads the outcomes from the nonce
report. Reward 1.0 only when every FAIL_TO_PASS and PASS_TO_PASS test passes, the report is
trustworthy, the canary failed and no test file changed on disk during the run; ``details`` keeps the per-test outcomes, what was
carried and refused, and ``tampered`` when the run gave itself away (a passing canary, two
reports, none). The agent's processes, its /tmp, HOME, environment variables, ``.git``,
``conftest.py``, ``sitecustomize.py`` and every other file outside the code under test
never meet the tests.

The same function validates tasks (``grading/check.py``: an empty carry must fail, the gold
patch's carry must pass), so the oracle is graded exactly as an agent is.

Test: ``pytest tests/unit/grading/test_grade.py``; the adversarial suite: ``pytest tests/adversarial``.
"""

from __future__ import annotations

import ast
import functools
import posixpath
import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager

from opencomposer import pyparse
from opencomposer.grading.carry import TEST_FILE, Carry, collect
from opencomposer.harness.patch import PatchError, parse_patch
from opencomposer.harness.patch import apply_patch as patch_files
from opencomposer.protocols import RewardResult, Sandbox, SandboxSpec
from opencomposer.rewards.changes import workspace_changes
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks.format import Task
from opencomposer.tasks.testrun import GradedRun, PytestRun, Reach

OpenSandbox = Callable[[SandboxSpec], AbstractContextManager[Sandbox]]
GOOD = ("PASSED", "XFAIL")


def opener(backend: str) -> OpenSandbox:
    """The plain factory: a new sandbox of ``backend`` for each spec."""
    return lambda spec: make_sandbox(spec, backend)


def apply_patch(sandbox: Sandbox, patch: str, shown: str) -> None:
    """Apply a unified diff (paths relative to the workspace) in ``sandbox``; ``shown`` names it in errors.

    The diff is applied by ``harness/patch.py`` (as the oracle applies it) through the sandbox's
    file API, so an image without ``patch`` or ``git`` can be checked too.
    """
    try:
        patches = parse_patch(patch)
        changed = patch_files(_read_files(sandbox, {fp.path for fp in patches}), patches)
    except PatchError as e:
        raise RuntimeError(f"{shown}: does not apply: {e}") from None
    for path, text in changed.items():
        if text is None:
            r = sandbox.exec(["rm", "-f", "--", path], timeout=60)
            if r.exit_code != 0:
                raise RuntimeError(f"{shown}: cannot remove {path}: {r.output.strip()[:500]}")
        else:
            sandbox.write_file(path, text.encode("utf-8", "surrogateescape"))


def _read_files(sandbox: Sandbox, paths: set[str]) -> dict[str, str]:
    """The text of those of ``paths`` that exist in ``sandbox``; bytes that are not UTF-8 round-trip."""
    files = {}
    for path in sorted(paths):
        try:
            files[path] = sandbox.read_file(path).decode("utf-8", "surrogateescape")
        except OSError:
            continue  # absent: a patch that changes it fails, one that creates it may
    return files


def patch_carry(task: Task, patch: str, open_sandbox: OpenSandbox, shown: str = "patch") -> Carry:
    """What the grader carries of ``patch`` applied by an agent: the gold patch graded as an agent's work."""
    with open_sandbox(task.sandbox_spec()) as sb:
        apply_patch(sb, patch, shown)
        return collect(task.workspace, sb, workspace_changes(task.workspace, sb))


def lay_hidden_tests(task: Task, sandbox: Sandbox) -> list[str]:
    """Write every file of ``TASK/tests/files/`` over the workspace; returns their paths."""
    written = []
    for f in sorted(task.hidden_tests.rglob("*")):
        if f.is_file():
            rel = f.relative_to(task.hidden_tests).as_posix()
            sandbox.write_file(rel, f.read_bytes())
            written.append(rel)
    return written


WORDS = ("again", "more", "extra", "values", "cases", "edge", "simple", "basic", "other", "mixed", "twice", "small")


@functools.lru_cache(maxsize=32)
def _tree(src: str) -> ast.Module | None:
    """``src`` parsed once (None when it does not parse): the canary, the expected failures and the new
    name all read the same hidden test file, in every grade of its task, in threads beside the engine's.
    Read only."""
    try:
        return pyparse.parse(src)
    except SyntaxError:
        return None


@functools.lru_cache(maxsize=128)
def _function_parts(src: str, name: str) -> tuple[tuple[str, ...], tuple[str, ...], str, str] | None:
    """(decorator lines, source lines, arguments, the call passing them on) of the module-level test
    function ``name`` of ``src``, or None. Cached, as its parse is (``_tree``)."""
    tree = _tree(src)
    for node in tree.body if tree else ():
        if isinstance(node, ast.FunctionDef) and node.name == name:
            a = node.args
            if a.vararg or a.kwarg or a.posonlyargs:
                return None
            lines = src.splitlines()
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            call = ", ".join([x.arg for x in a.args] + [f"{x.arg}={x.arg}" for x in a.kwonlyargs])
            return (tuple(lines[start - 1:node.lineno - 1]), tuple(lines[node.lineno - 1:node.end_lineno]),
                    ast.unparse(a), call)
    return None


def _clone_source(src: str, name: str, new: str, failing: str) -> str | None:
    """A copy of the module-level test function ``name`` of ``src`` as ``new``: the body runs as it
    is (a ``return`` in it included), then ``failing``. Its decorators and fixtures stay on ``new``;
    the copied body becomes a helper ``_new``. None when ``src`` has no such plain function.

    The decorators see a function of the original's name, which is then bound to ``new`` (pytest names a
    test by the module attribute) and the original put back: a decorator that reads the function's name
    (tinycss2's ``@json_test()`` loads ``<name>.json``) would otherwise fail the whole file's collection
    and so every gold and honest solution of the task (51 tasks of the RL pool, session 34)."""
    parts = _function_parts(src, name)
    if parts is None:
        return None
    decorators, lines, args, call = parts
    body = [lines[0].replace(f"def {name}(", f"def _{new}(", 1), *lines[1:]]
    keep = f"_{new}_original"
    outer = [f"{keep} = {name}", *decorators, f"def {name}({args}):", f"    _{new}({call})", f"    {failing}", "",
             "", f"{new} = {name}", f"{name} = {keep}", f"del {keep}"]
    return "\n".join(body + ["", ""] + outer)


@functools.lru_cache(maxsize=128)
def _module_xfail(src: str) -> bool:
    """Whether ``src`` marks every test of the module xfail (``pytestmark = ...xfail...``)."""
    tree = _tree(src)
    for n in tree.body if tree else ():
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets) and n.value is not None \
                and "xfail" in ast.unparse(n.value):
            return True
    return False


def _may_be_xfail(src: str, name: str) -> bool:
    """Whether a copy of test function ``name`` could be marked xfail: an ``xfail`` in its decorators, or
    a ``parametrize`` in a file that names ``xfail`` anywhere (``pytest.param(..., marks=...xfail)``
    may mark some of its cases). A failing canary reported XFAIL is read as a forgery, so such a test is
    never the canary's model (ftfy's ``@pytest.mark.xfail(strict=True) test_failing_json_example`` was:
    the gold patch earned 0)."""
    parts = _function_parts(src, name)
    decorators = "\n".join(parts[0]) if parts else ""
    return "xfail" in decorators or ("parametrize" in decorators and "xfail" in src)


def lay_canary(task: Task, sandbox: Sandbox) -> tuple[str, str]:
    """A test that must fail, made to look like the task's own: a copy of one FAIL_TO_PASS test
    (decorators and fixtures kept) under a plausible new name in the same hidden test file, with a
    false assertion last. Returns (the target to add, "" when its file is already a target; its
    node id). A runner rewired to pass what fails, or to pass whatever looks like the task's
    tests, passes it too. A test that may be marked xfail is not copied (a plain failing function takes
    its place), and a file whose every test is marked xfail holds no canary."""
    t = task.meta.tests
    value = secrets.randbelow(10**6)
    failing = f"assert {value} == {value + 1}"
    for nid in t.fail_to_pass + t.files:
        path, _, rest = nid.partition("::")
        hidden = task.hidden_tests / path
        if not path.endswith(".py") or not hidden.is_file():
            continue
        src = hidden.read_bytes().decode("utf-8", errors="replace")
        if _module_xfail(src):  # every test of the file is expected to fail: the canary's failure would be too
            continue
        names = _names(src)
        base = rest.split("[")[0] if rest and "::" not in rest else f"test_{task.meta.feature.symbol.split('.')[-1].lower()}"
        new = next((f"{base}_{w}" for w in secrets.SystemRandom().sample(WORDS, len(WORDS)) if f"{base}_{w}" not in names),
                   f"{base}_{secrets.token_hex(3)}")
        clone = _clone_source(src, base, new, failing) if rest and not _may_be_xfail(src, base) else None
        if clone is None:
            clone = f"def {new}():\n    {failing}"
        sandbox.write_file(path, (src.rstrip("\n") + "\n\n\n" + clone + "\n").encode())
        target = "" if path in t.targets else f"{path}::{new}"
        return target, f"{path}::{new}"
    name = secrets.token_hex(6)  # no hidden test file to hide it in: a file of its own
    path = posixpath.join(posixpath.dirname(t.files[0]), f"test_{name}.py")
    sandbox.write_file(path, f"def test_{name}():\n    {failing}\n".encode())
    return path, f"{path}::test_{name}"


@functools.lru_cache(maxsize=128)
def _expected_failures(src: str) -> tuple[str, ...]:
    """``Class::method`` of every test method of ``src`` decorated with unittest's ``expectedFailure``: what the
    source says, never what a run reports (``runner.PytestRun.expected_failures``)."""
    tree = _tree(src)
    if tree is None:
        return ()
    named = lambda d: (d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else "")
    return tuple(f"{c.name}::{f.name}" for c in tree.body if isinstance(c, ast.ClassDef) for f in c.body
                 if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and any(named(d) == "expectedFailure" for d in f.decorator_list))


def _per_task(task: Task, key: str, make: Callable[[], list[str]]) -> list[str]:
    """``make()`` once per loaded task (an RL step's k episodes of a task share its ``Task`` and grade in threads;
    the task's files never change under it), a copy each call."""
    got = task.__dict__.get(key)
    if got is None:
        got = task.__dict__[key] = make()
    return list(got)


def expected_failures(task: Task, laid: list[str]) -> list[str]:
    """The node ids of the hidden test files' ``@expectedFailure`` tests (boolean.py marks known bugs so)."""
    def make() -> list[str]:
        return [f"{path}::{x}" for path in laid if path.endswith(".py")
                for x in _expected_failures((task.hidden_tests / path).read_bytes().decode("utf-8", errors="replace"))]
    return _per_task(task, "_expected_failures", make)


@functools.lru_cache(maxsize=128)
def _names(src: str) -> frozenset[str]:
    """Every name bound or used in ``src`` (empty when it does not parse): the canary's must be new.
    Cached as ``_function_parts`` is."""
    tree = _tree(src)
    if tree is None:
        return frozenset()
    return frozenset(n.id if isinstance(n, ast.Name) else getattr(n, "name", "") for n in ast.walk(tree))


def base_test_files(task: Task) -> list[str]:
    """The workspace's own test files and helpers (``tests/``, ``test_*.py``, ``conftest.py``...): the
    hidden tests import them, so the launcher watches them too. Listed once per loaded task (a walk of
    the whole workspace)."""
    ws = task.workspace
    return _per_task(task, "_base_test_files", lambda: [
        p.relative_to(ws).as_posix() for p in ws.rglob("*")
        if p.is_file() and not p.is_symlink() and ".git" not in p.relative_to(ws).parts
        and TEST_FILE.search(p.relative_to(ws).as_posix())])


def apply_carry(carry: Carry, sandbox: Sandbox) -> None:
    for path, data in carry.files.items():
        sandbox.write_file(path, data)
    if carry.deleted:
        r = sandbox.exec(["rm", "-f", "--", *carry.deleted], timeout=60)
        if r.exit_code != 0:
            raise RuntimeError(f"grader: could not remove {carry.deleted[:3]}: {r.output[-300:]}")


def grade(task: Task, carry: Carry, open_sandbox: OpenSandbox, *, canary: bool = True,
          timeout: float | None = None, fail_fast: bool = False) -> RewardResult:
    """Reward of ``carry`` on ``task``, graded in a fresh sandbox from ``open_sandbox``; the hidden
    tests run for at most the task's ``[tests] timeout``, or ``timeout`` seconds when that is lower
    (a run cut short has no report: no reward). ``fail_fast``: the run stops at the first FAIL_TO_PASS
    or PASS_TO_PASS test that does not pass, in pytest's own order (the reward is 0 whatever the rest
    do, so it is the same reward; the details then hold only the tests run, and ``stopped_at``)."""
    t = task.meta.tests
    with open_sandbox(task.sandbox_spec()) as sb:
        apply_carry(carry, sb)
        laid = lay_hidden_tests(task, sb)
        canary_target, canary_id = lay_canary(task, sb) if canary else ("", "")
        extra = [canary_target] if canary_target else []
        watched = sorted(set(laid + base_test_files(task) + [canary_id.partition("::")[0]] * bool(canary)))
        run = PytestRun.from_command(t.command, t.targets + extra, watched=watched,
                                     carried=[p for p in carry.files if p.endswith(".py")],
                                     must_pass=[*t.fail_to_pass, *t.pass_to_pass] if fail_fast else [],
                                     expected_failures=expected_failures(task, laid))
        rep = run.execute(sb, timeout=t.timeout if timeout is None else min(t.timeout, timeout))
    return result(task, rep, carry, canary_id)


def canary_outcome(rep: GradedRun, canary_id: str) -> str:
    """The canary's outcome; of a parametrized one, the best of its items (any pass gives it away)."""
    got = [v for k, v in rep.outcomes.items() if k == canary_id or k.startswith(canary_id + "[")]
    for good in ("PASSED", "XPASS", "XFAIL"):
        if good in got:
            return good
    return got[0] if got else "MISSING"


def honest_line(task: Task, carry: Carry, reach: Reach) -> bool:
    """Whether a reach comes from a line the agent did not write: one the base file already has, or
    one the gold patch adds (restoring the deleted code as it was is the task, whatever it does)."""
    if not reach.file or reach.file not in carry.files:
        return False
    lines = carry.files[reach.file].decode("utf-8", errors="replace").splitlines()
    if not 0 < reach.line <= len(lines):
        return False
    text = lines[reach.line - 1].strip()
    base = task.workspace / reach.file
    if base.is_file() and text in {x.strip() for x in base.read_text(errors="replace").splitlines()}:
        return True
    return text in {x[1:].strip() for x in task.gold_patch.splitlines() if x.startswith("+")}


def result(task: Task, rep: GradedRun, carry: Carry, canary_id: str) -> RewardResult:
    t = task.meta.tests
    f2p = {n: rep.status(n) for n in t.fail_to_pass}
    p2p = {n: rep.status(n) for n in t.pass_to_pass}
    ok = lambda d: sum(v in GOOD for v in d.values())
    tampered = [rep.problem] if "forged" in rep.problem else []
    if rep.changed:
        tampered.append(f"test files changed on disk during the run: {rep.changed[:3]}")
    canary_status = canary_outcome(rep, canary_id) if canary_id else "OFF"
    if canary_status in GOOD or canary_status == "XPASS":
        tampered.append(f"the canary test {canary_id} (it must fail) was reported {canary_status}")
    reach = [str(r) for r in rep.reach if not honest_line(task, carry, r)]
    if reach:
        tampered.append(f"{len(reach)} reach(es) for the runner: {'; '.join(reach[:3])}")
    passed = (ok(f2p) == len(f2p) and ok(p2p) == len(p2p) and not rep.timed_out
              and not rep.problem and not tampered)
    return RewardResult(
        reward=1.0 if passed else 0.0,
        passed=passed,
        details={
            "fail_to_pass": f2p, "pass_to_pass": p2p, "f2p_passed": ok(f2p), "p2p_passed": ok(p2p),
            "timed_out": rep.timed_out, "exit_code": rep.exit_code, "seconds": round(rep.seconds, 2),
            "report": rep.problem or "ok", "canary": canary_status, "tampered": "; ".join(tampered),
            "stopped_at": rep.stopped_at,
            "reach": [str(r) for r in rep.reach][:10],
            "carried": carry.to_dict(),
            "output_tail": rep.output_tail[-1500:] if not passed else "",
        },
    )
