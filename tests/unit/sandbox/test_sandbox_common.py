"""Behaviour every backend must share, run against real sandboxes of each backend.

Run: ``pytest tests/unit/sandbox/test_sandbox_common.py -q``.
"""

from __future__ import annotations

import os
import time
import tracemalloc
from pathlib import Path

import pytest

from testkit.sandbox_testutil import tree_digest, wait_gone, wait_present
from opencomposer.protocols import PathEscape, Sandbox, SandboxSpec
from opencomposer.sandbox import make_sandbox


def test_satisfies_protocol(sandbox):
    assert isinstance(sandbox, Sandbox)
    assert sandbox.read_file("README.md") == b"# demo\n"


def test_exec_output_exit_code_and_argv(sandbox):
    r = sandbox.exec("echo out; echo err >&2; exit 3")
    assert r.exit_code == 3 and "out\n" in r.output and "err\n" in r.output
    assert not r.timed_out and not r.truncated and r.seconds > 0
    assert sandbox.exec(["echo", "a  b"]).output == "a  b\n"
    assert sandbox.exec(["no-such-binary-xyz"]).exit_code != 0


def test_stdin_small_and_large(sandbox):
    assert sandbox.exec("cat", stdin=b"hello").output == "hello"
    big = b"x" * 5_000_000  # larger than any pipe buffer: must not deadlock
    assert sandbox.exec("wc -c", stdin=big).output.strip() == str(len(big))


def test_cwd_and_pythonpath(sandbox):
    assert sandbox.exec("pwd", cwd="pkg").output.strip() == f"{sandbox.workdir}/pkg"
    assert sandbox.exec("python3 -c 'import mod; print(mod.add(2, 3))'").output.strip() == "5"
    with pytest.raises(PathEscape):
        sandbox.exec("pwd", cwd="../..")


def test_env_is_scrubbed(backend, base_repo, tmp_path, monkeypatch):
    monkeypatch.setenv("OC_HOST_SECRET", "leaked")
    spec = SandboxSpec(base_dir=base_repo, extra_env={"FROM_SPEC": "1"})
    with make_sandbox(spec, backend=backend, root=tmp_path) as sb:
        env = dict(line.split("=", 1) for line in sb.exec("env", env={"PER_CALL": "2"}).output.splitlines())
    assert "OC_HOST_SECRET" not in env and env["FROM_SPEC"] == "1" and env["PER_CALL"] == "2"
    assert env["LANG"] == "C.UTF-8" and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["PATH"].endswith("/usr/local/bin:/usr/bin:/bin") and env["HOME"] != os.environ.get("HOME")


def test_env_dir_python_runs(backend, base_repo, venv_dir, tmp_path):
    with make_sandbox(SandboxSpec(base_dir=base_repo, env_dir=venv_dir), backend=backend, root=tmp_path) as sb:
        r = sb.exec("python -c 'import sys; print(sys.prefix)'")
    assert r.exit_code == 0, r.output
    assert r.output.strip() == str(venv_dir)


def test_timeout_kills_command_and_its_children(sandbox):
    token = f"{os.getpid() % 1000 + 91000}"
    t = time.monotonic()
    r = sandbox.exec(f"sleep {token}1 & sleep {token}2", timeout=1)
    assert r.timed_out and r.exit_code != 0 and "timed out" in r.output
    assert time.monotonic() - t < 5
    assert not wait_gone(f"sleep {token}2")


def test_closed_output_does_not_outlive_timeout(sandbox):
    r = sandbox.exec("exec >/dev/null 2>&1; sleep 100", timeout=1)
    assert r.timed_out


def test_background_daemon_dies(sandbox, backend):
    token = f"{os.getpid() % 1000 + 92000}"
    t = time.monotonic()
    r = sandbox.exec(f"setsid sleep {token} >/dev/null 2>&1 < /dev/null & echo started")
    assert r.output.strip() == "started" and time.monotonic() - t < 2
    if backend == "local":  # local keeps background jobs until close, like a shell session
        assert wait_present(f"sleep {token}")
    else:  # the pid namespace dies with the command
        assert not wait_gone(f"sleep {token}")
    sandbox.close()
    assert not wait_gone(f"sleep {token}")


def test_background_job_holding_the_pipe_does_not_block(sandbox):
    t = time.monotonic()
    r = sandbox.exec("sleep 30 & echo done")
    assert r.output.strip() == "done" and time.monotonic() - t < 3


def test_gigabyte_of_output_is_capped_in_small_memory(sandbox):
    tracemalloc.start()
    try:
        t = time.monotonic()
        r = sandbox.exec("yes | head -c 1000000000", max_output=10_000, timeout=60)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.exit_code == 0 and r.truncated and not r.timed_out
    assert time.monotonic() - t < 20
    assert peak < 16 * 2**20, f"peak Python memory {peak} bytes"
    assert r.output.endswith("[output truncated: 1000000000 bytes total, showing first 5000 and last 5000]")
    assert r.output.startswith("y\ny\n") and len(r.output) < 10_200


def test_output_exactly_at_limit_is_not_truncated(sandbox):
    r = sandbox.exec("printf '%0100d' 0", max_output=100)
    assert r.output == "0" * 100 and not r.truncated


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "pkg/../../x", "/"])
def test_paths_outside_workspace_are_refused(sandbox, path):
    with pytest.raises(PathEscape):
        sandbox.read_file(path)
    with pytest.raises(PathEscape):
        sandbox.write_file(path, b"nope")


def test_absolute_path_inside_workspace_is_fine(sandbox):
    assert sandbox.read_file(f"{sandbox.workdir}/README.md") == b"# demo\n"
    assert sandbox.read_file("pkg/../README.md") == b"# demo\n"


def test_symlink_escapes_are_refused(sandbox):
    assert sandbox.exec("ln -s /etc etc_link && ln -s /etc/passwd pw && ln -s README.md inner").exit_code == 0
    for path in ("etc_link/passwd", "pw"):
        with pytest.raises(PathEscape):
            sandbox.read_file(path)
    with pytest.raises(PathEscape):
        sandbox.write_file("etc_link/oc_evil", b"x")
    assert not Path("/etc/oc_evil").exists()
    assert sandbox.read_file("inner") == b"# demo\n"  # a link that stays inside is fine


def test_missing_and_directory_reads(sandbox):
    with pytest.raises(FileNotFoundError):
        sandbox.read_file("nope.txt")
    with pytest.raises(IsADirectoryError):
        sandbox.read_file("pkg")


def test_writes_never_touch_base_dir(sandbox, base_repo):
    before = tree_digest(base_repo)
    sandbox.write_file("new/deep/file.txt", b"new")
    sandbox.write_file("README.md", b"changed")
    assert sandbox.exec("rm -rf data && echo more >> pkg/mod.py && chmod 600 pkg/__init__.py").exit_code == 0
    assert sandbox.read_file("new/deep/file.txt") == b"new"
    assert sandbox.read_file("README.md") == b"changed"
    assert tree_digest(base_repo) == before


def test_snapshot_restore_round_trip(sandbox):
    sandbox.write_file("a.txt", b"1")
    sid = sandbox.snapshot()
    sandbox.write_file("b.txt", b"after")
    sandbox.write_file("a.txt", b"2")
    assert sandbox.exec("rm README.md && rm -rf pkg && mkdir pkg && touch pkg/only").exit_code == 0
    sid2 = sandbox.snapshot()
    sandbox.restore(sid)
    assert sandbox.read_file("a.txt") == b"1"
    assert sandbox.read_file("README.md") == b"# demo\n"
    with pytest.raises(FileNotFoundError):
        sandbox.read_file("b.txt")
    sandbox.restore(sid2)  # a recreated dir stays opaque: base files must not shine through
    assert sandbox.exec("ls pkg").output.split() == ["only"]
    assert sandbox.exec("test -e README.md").exit_code == 1
    sandbox.reset()
    assert sandbox.exec("ls").output.split() == ["README.md", "data", "pkg"]
    with pytest.raises(KeyError):
        sandbox.restore("no-such-snapshot")


def test_fork_is_independent(sandbox):
    sandbox.write_file("parent.txt", b"p")
    child = sandbox.fork()
    try:
        assert child.read_file("parent.txt") == b"p"
        child.write_file("child.txt", b"c")
        with pytest.raises(FileNotFoundError):
            sandbox.read_file("child.txt")
        child.reset()  # back to the fork point, not to the base image
        assert child.read_file("parent.txt") == b"p"
        with pytest.raises(FileNotFoundError):
            child.read_file("child.txt")
    finally:
        child.close()


def test_close_removes_files_and_is_idempotent(backend, base_repo, tmp_path):
    with make_sandbox(SandboxSpec(base_dir=base_repo), backend=backend, root=tmp_path) as sb:
        sb.write_file("x", b"x")
        made = set(tmp_path.iterdir()) - {base_repo}
        assert made
    assert not any(p.exists() for p in made)
    sb.close()
    with pytest.raises(RuntimeError):
        sb.exec("true")
