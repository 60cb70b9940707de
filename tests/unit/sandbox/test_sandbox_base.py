"""The shared pieces on their own: output cap, path confinement, environment, registry.

Run: ``pytest tests/unit/sandbox/test_sandbox_base.py -q``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from opencomposer.protocols import PathEscape, SandboxSpec
from opencomposer.sandbox import backend_class, make_sandbox
from opencomposer.sandbox.base import OutputCap, confine, run_process, scrubbed_env


def test_output_cap_keeps_head_and_tail():
    cap = OutputCap(10)
    for chunk in (b"0123456", b"789", b"abcdefghij"):
        cap.feed(chunk)
    assert cap.truncated and cap.total == 20
    text = cap.text()
    assert text.startswith("01234\n[... 10 bytes omitted ...]\nfghij\n")
    assert text.endswith("[output truncated: 20 bytes total, showing first 5 and last 5]")


def test_output_cap_under_limit_is_verbatim():
    cap = OutputCap(10)
    cap.feed(b"0123456789")
    assert not cap.truncated and cap.text() == "0123456789"


@pytest.mark.parametrize(
    "path,rel",
    [("a/b", "a/b"), ("", "."), (".", "."), ("a/../b", "b"), ("/ws/a", "a"), ("/ws", "."), ("./a//b/", "a/b")],
)
def test_confine_accepts(path, rel):
    assert confine(path, "/ws") == rel


@pytest.mark.parametrize("path", ["..", "../ws2/x", "/ws2", "/etc/passwd", "a/../../x", "//etc", "a\0b"])
def test_confine_refuses(path):
    with pytest.raises(PathEscape, match="outside the workspace|NUL"):
        confine(path, "/ws")


def test_scrubbed_env_is_built_from_scratch(tmp_path):
    spec = SandboxSpec(base_dir=tmp_path, env_dir=Path("/envs/x"), pythonpath=["src", "."], extra_env={"A": "1"})
    env = scrubbed_env(spec, "/workspace", "/home/sb", {"A": "2"})
    assert env["PATH"] == "/envs/x/bin:/usr/local/bin:/usr/bin:/bin"
    assert env["PYTHONPATH"] == "/workspace/src:/workspace/."
    assert env["A"] == "2" and env["HOME"] == "/home/sb"
    assert set(env) == {"PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "TERM", "VIRTUAL_ENV", "PYTHONPATH", "A"}


def test_run_process_missing_binary_is_a_result_not_a_crash():
    r = run_process(["/no/such/binary"], env={"PATH": "/usr/bin:/bin"})
    assert r.exit_code == 127 and "/no/such/binary" in r.output


def test_unknown_backend_lists_known(tmp_path):
    with pytest.raises(ValueError, match="known: docker, gvisor, local, namespace, remote"):
        make_sandbox(SandboxSpec(base_dir=tmp_path), backend="no-such-backend")
    assert backend_class("local").__name__ == "LocalSandbox"


def test_missing_base_dir_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        make_sandbox(SandboxSpec(base_dir=tmp_path / "nope"))
