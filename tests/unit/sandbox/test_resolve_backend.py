"""``resolve_backend``: ``auto`` is the strongest isolating backend here; ``local`` only by name.

The two probes (``namespace.unavailable_reason``, ``gvisor.unavailable_reason``) are the
outside boundary: what this machine's kernel and binaries allow. Tests that need another
machine replace them; everything else runs the real thing.

Run: ``pytest tests/unit/sandbox/test_resolve_backend.py -q``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from testkit.sandbox_testutil import NS_REASON

from opencomposer.sandbox import (
    SandboxSpec,
    SandboxUnavailable,
    gvisor,
    make_sandbox,
    namespace,
    resolve_backend,
)


@pytest.fixture
def no_isolation(monkeypatch):
    """A machine where neither isolating backend runs."""
    monkeypatch.setattr(namespace, "unavailable_reason", lambda bwrap=None: "no user namespaces (kernel.unprivileged_userns_clone=0)")
    monkeypatch.setattr(gvisor, "unavailable_reason", lambda runsc=None: "runsc (gVisor) not found")


@pytest.mark.namespace
@pytest.mark.skipif(NS_REASON is not None, reason=str(NS_REASON))
def test_auto_picks_namespace_here_and_builds_it(tmp_path):
    assert resolve_backend() == resolve_backend("auto") == "namespace"
    (tmp_path / "f.txt").write_text("x")
    with make_sandbox(SandboxSpec(base_dir=tmp_path)) as sb:  # make_sandbox's default is auto too
        assert sb.backend == "namespace" and sb.exec("cat f.txt").output == "x"


def test_auto_falls_back_to_gvisor(monkeypatch):
    monkeypatch.setattr(namespace, "unavailable_reason", lambda bwrap=None: "no user namespaces")
    monkeypatch.setattr(gvisor, "unavailable_reason", lambda runsc=None: None)
    assert resolve_backend("auto") == "gvisor"


def test_auto_without_an_isolating_backend_says_why_and_how_to_choose_local(no_isolation, tmp_path):
    with pytest.raises(SandboxUnavailable) as e:
        resolve_backend("auto", "--sandbox local")
    msg = str(e.value)
    assert "no isolating backend" in msg
    assert "namespace: no user namespaces (kernel.unprivileged_userns_clone=0)" in msg
    assert "gvisor: runsc (gVisor) not found" in msg
    assert "choose it by name: --sandbox local" in msg
    with pytest.raises(SandboxUnavailable, match="no isolating backend"):  # nothing falls back to local silently
        make_sandbox(SandboxSpec(base_dir=tmp_path))


def test_named_backends_are_taken_as_given_and_unknown_ones_refused(no_isolation):
    assert resolve_backend("local") == "local"
    assert resolve_backend("namespace") == "namespace"  # building it is what fails, with the backend's reason
    with pytest.raises(ValueError, match="unknown sandbox backend 'firecracker'; known: docker, gvisor, local"):
        resolve_backend("firecracker")


def test_local_by_name_warns_once_per_process_on_stderr():
    code = ("from opencomposer.sandbox import resolve_backend\n"
            "print(resolve_backend('local'), resolve_backend('local'))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stdout.split() == ["local", "local"]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "'local' is not isolated" in lines[0] and "host user" in lines[0] and "host's files" in lines[0]
