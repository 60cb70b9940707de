"""fork_many on real sandboxes: N independent children, parent untouched, no leak on failure.

Run: ``pytest tests/unit/sandbox/test_branch.py -q``.
"""

from __future__ import annotations

import pytest

from opencomposer.sandbox.branch import fork_many


def test_n_children_from_current_files_are_independent(sandbox):
    sandbox.write_file("step.txt", b"mid-episode")
    kids = fork_many(sandbox, 4)
    try:
        assert len({id(k) for k in kids}) == 4 and all(k.backend == sandbox.backend for k in kids)
        for i, k in enumerate(kids):
            k.write_file("step.txt", f"branch {i}".encode())
        assert [k.exec("cat step.txt").output for k in kids] == [f"branch {i}" for i in range(4)]
        kids[0].reset()  # back to the fork point, not to the base image
        assert kids[0].read_file("step.txt") == b"mid-episode"
        assert sandbox.read_file("step.txt") == b"mid-episode"
    finally:
        for k in kids:
            k.close()


def test_children_from_an_earlier_snapshot_leave_the_parent_as_it_was(sandbox):
    sid = sandbox.snapshot()
    sandbox.write_file("later.txt", b"after the snapshot")
    kids = fork_many(sandbox, 3, snapshot_id=sid)
    try:
        for k in kids:
            with pytest.raises(FileNotFoundError):
                k.read_file("later.txt")
        assert sandbox.read_file("later.txt") == b"after the snapshot"  # parent restored
    finally:
        for k in kids:
            k.close()
    assert fork_many(sandbox, 0) == []
    with pytest.raises(ValueError, match="n must be >= 0"):
        fork_many(sandbox, -1)


def test_fork_errors_surface(sandbox):
    kids = fork_many(sandbox, 2)
    closed = kids[0]
    for k in kids:
        k.close()
    with pytest.raises(RuntimeError, match="closed"):
        fork_many(closed, 3)  # a closed sandbox cannot fork: the error comes out
    with pytest.raises(KeyError):
        fork_many(sandbox, 2, snapshot_id="s999")
