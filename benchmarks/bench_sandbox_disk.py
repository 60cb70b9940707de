"""How far past ``disk_mb`` a namespace sandbox's workspace gets, hard (tmpfs) vs watched.

Two bursts in one sandbox with ``disk_mb`` = ``--disk-mb``: many serial 8 MiB files, then 16
parallel writers of 60 MiB each (every file under the per-file cap, so only the
workspace-wide limit can stop them). ``tmpfs``: the host can mount (root), the changes live
on a tmpfs of ``disk_mb``; ``watched``: the mount is refused as on a non-root host, and the
workspace's growth is polled instead. Overshoot = workspace bytes after the burst - limit.

Run: ``python benchmarks/bench_sandbox_disk.py [--disk-mb 64] [--root /dev/shm]``; last line JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from opencomposer.protocols import SandboxLimits, SandboxSpec
from opencomposer.sandbox import cleanup
from opencomposer.sandbox.limits import tree_bytes
from opencomposer.sandbox.namespace import NamespaceSandbox

BURSTS = {
    "serial_8MiB_files": "for i in $(seq 200); do head -c 8388608 /dev/zero > f$i || break; done",
    "parallel_16x60MiB": "for i in $(seq 16); do head -c 62914560 /dev/zero > p$i & done; wait",
}


def measure(mode: str, disk_mb: int, root: str | None) -> dict:
    real_mount = cleanup.mount_disk
    if mode == "watched":
        cleanup.mount_disk = lambda root, nbytes: None  # as on a host that may not mount
    try:
        with tempfile.TemporaryDirectory() as base, \
                NamespaceSandbox(SandboxSpec(base_dir=Path(base), limits=SandboxLimits(disk_mb=disk_mb)), root=root) as sb:
            if mode == "tmpfs" and not sb.disk_hard:
                return {"unavailable": "this host cannot mount a tmpfs (not root)"}
            out = {}
            for name, cmd in BURSTS.items():
                t = time.monotonic()
                r = sb.exec(cmd, timeout=120)
                used = tree_bytes(sb._upper) >> 20
                out[name] = {"used_mib": used, "overshoot_mib": max(0, used - disk_mb),
                             "seconds": round(time.monotonic() - t, 2), "observation": r.output.strip().splitlines()[-1][:120]}
                sb.exec("rm -f f* p*")
            return out
    finally:
        cleanup.mount_disk = real_mount


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--disk-mb", type=int, default=64)
    ap.add_argument("--root", default=None, help="where sandbox dirs go (default: the temp dir)")
    args = ap.parse_args()
    res = {"bench": "sandbox_disk", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "loadavg": Path("/proc/loadavg").read_text().split()[:3], "disk_mb": args.disk_mb, "root": args.root}
    for mode in ("tmpfs", "watched"):
        res[mode] = measure(mode, args.disk_mb, args.root)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
