"""The host files a container-style sandbox (``gvisor``, ``docker``) exposes, read-only.

``namespace`` decides what of the host a task may see (``/usr``, a few files of
``/etc``, ``spec.env_dir`` and the Python it points to, other site-packages hidden) as
bubblewrap arguments; ``host_mounts`` translates exactly that list into OCI-style
mounts, so the backends cannot drift apart on it.

Test: ``pytest tests/unit/sandbox/test_gvisor.py tests/unit/sandbox/test_docker.py -q``.
"""

from __future__ import annotations

import os

from opencomposer.protocols import SandboxSpec


def host_mounts(spec: SandboxSpec) -> tuple[list[tuple[str, str]], list[dict]]:
    """(symlinks, OCI mounts) exposing the same host files as the ``namespace`` backend.

    The list is ``namespace``'s bwrap arguments, translated, so the two backends cannot
    drift apart on what of the host a task may see.
    """
    from opencomposer.sandbox.bwrap import env_binds, system_args

    args = system_args(spec.network) + ["--tmpfs", "/tmp"] + env_binds(spec.env_dir)
    links: list[tuple[str, str]] = []
    mounts: list[dict] = []
    i = 0
    while i < len(args):
        op = args[i]
        if op == "--symlink":
            links.append((args[i + 1], args[i + 2]))
            i += 3
        elif op in ("--ro-bind", "--ro-bind-try"):
            src, dst = args[i + 1], args[i + 2]
            i += 3
            if not os.path.exists(src):
                if op == "--ro-bind":
                    raise FileNotFoundError(f"host path {src!r} to bind into the gVisor sandbox does not exist")
                continue
            mounts.append({"destination": dst, "type": "bind", "source": os.path.realpath(src), "options": ["rbind", "ro"]})
        elif op == "--tmpfs":
            mounts.append({"destination": args[i + 1], "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]})
            i += 2
        else:
            raise ValueError(f"gvisor backend cannot translate bwrap argument {op!r} (from sandbox/bwrap.py)")
    return links, mounts
