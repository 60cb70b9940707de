"""Branching: N sandboxes from one state (K rollouts of one task, or a branch mid-episode).

    kids = fork_many(sb, 8)                    # 8 sandboxes with sb's current files
    kids = fork_many(sb, 8, snapshot_id=sid)   # ... with the files of an earlier snapshot

Every backend's ``fork()`` makes one child whose ``reset()`` comes back to the fork
point; ``fork_many`` makes N of them (in threads: the copies are I/O, and on ``remote``
each is a round trip), leaves the parent exactly as it was, and closes the children
already made if one fails, so a failed branch leaks nothing. Cost per child is the
backend's: ``namespace`` copies only the overlay's upper dir (the changes), ``local``,
``gvisor`` and ``docker`` copy the workspace.

Test: ``pytest tests/unit/sandbox/test_branch.py -q``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any


def fork_many(sandbox: Any, n: int, *, snapshot_id: str | None = None, threads: int = 4) -> list[Any]:
    """``n`` new sandboxes from ``sandbox``'s current files (or from ``snapshot_id``)."""
    if n < 0:
        raise ValueError(f"fork_many n must be >= 0, got {n}")
    if not hasattr(sandbox, "fork"):
        raise TypeError(f"{type(sandbox).__name__} has no fork(): cannot branch it")
    if n == 0:
        return []
    here, kids = None, []
    if snapshot_id is not None:
        here = sandbox.snapshot()  # come back to the current files afterwards
        sandbox.restore(snapshot_id)
    try:
        kids.append(sandbox.fork())  # one first: a backend that cannot fork fails before N threads start
        if n > 1:
            with ThreadPoolExecutor(max(1, min(threads, n - 1))) as ex:
                futures = [ex.submit(sandbox.fork) for _ in range(n - 1)]
                errors = []
                for f in futures:
                    try:
                        kids.append(f.result())
                    except Exception as e:  # keep collecting: the others must be closed too
                        errors.append(e)
                if errors:
                    raise errors[0]
        return kids
    except BaseException:
        for k in kids:
            try:
                k.close()
            except Exception:
                pass
        raise
    finally:
        if here is not None:
            sandbox.restore(here)
