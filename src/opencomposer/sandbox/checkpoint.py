"""Memory snapshots: a sandbox's running processes saved and brought back, not only its files.

    svc = sb.start("python serve.py")          # a gvisor sandbox
    snap = sb.checkpoint(svc)                  # -> MemorySnapshot
    child, svc2 = sb.restore_checkpoint(snap)  # the process runs again, in a new sandbox

The ``gvisor`` backend takes them with ``runsc checkpoint``: gVisor saves its own user-space
kernel (all processes, memory, open files, pipes), so no host kernel support is needed. This
module holds the record both ends share.

Test: ``pytest tests/unit/sandbox/test_gvisor.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class MemorySnapshot:
    """A saved process tree (``image_dir``) and the workspace snapshot (``fs_snapshot``)
    of the sandbox it came from, taken while the processes were frozen."""

    backend: str
    image_dir: Path
    fs_snapshot: str
    config: dict[str, Any] = field(default_factory=dict)  # how to recreate the container (gvisor)
