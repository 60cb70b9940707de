"""Who holds the interpreter: a summary of a py-spy profile taken with ``--gil --threads --format raw``
(``PROFILE=I benchmarks/learn_device.sh run`` writes one per arm as ``pyspy.txt.gz``).

Each line of the raw format is ``thread (TID): NAME;frame;frame... COUNT``; under ``--gil`` a sample
is taken only of the thread holding the GIL, so ``samples / (rate x seconds)`` is the share of the
run's wall time in which some thread held it, and each thread group's share says who. Threads are
grouped by name with digits removed (``Thread-12 (run)`` -> ``Thread-N (run)``); for each group the
functions of ``opencomposer`` (or any frame matching ``--focus``) that held the GIL most, counted
once per sample at their innermost matching frame.

    python benchmarks/pyspy_summary.py runs/learn-gpu/s33/arm1/pyspy.txt.gz --seconds 520 --rate 50
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys


def read(path: str) -> list[tuple[str, list[str], int]]:
    """(thread group, frames outermost first, count) of every line of a raw py-spy profile."""
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                raise SystemExit(f"{path}:{n}: expected 'thread (TID): NAME;frames COUNT', got {line[:120]!r}")
            head, *frames = stack.split(";")
            name = head.split(": ", 1)[1] if ": " in head else head
            rows.append((re.sub(r"\d+", "N", name), frames, int(count)))
    return rows


def frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (path/to/file.py)``: lines of one function merged."""
    return re.sub(r":\d+\)$", ")", frame)


def summarise(rows: list[tuple[str, list[str], int]], focus: str, top: int) -> dict:
    total = sum(c for _, _, c in rows)
    groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    sizes: collections.Counter = collections.Counter()
    pat = re.compile(focus)
    for name, frames, count in rows:
        sizes[name] += count
        inner = next((f for f in reversed(frames) if pat.search(f)), frames[-1] if frames else "(no frame)")
        groups[name][frame_name(inner)] += count
    return {"samples": total,
            "groups": {name: {"share": round(n / total, 4) if total else 0.0,
                              "top": [[f, round(c / total, 4)] for f, c in groups[name].most_common(top)]}
                       for name, n in sizes.most_common()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="py-spy raw output (.txt or .txt.gz), recorded with --gil --threads")
    ap.add_argument("--seconds", type=float, default=0.0, help="the profiled run's wall time: gives the GIL's busy share")
    ap.add_argument("--rate", type=float, default=50.0, help="py-spy's --rate (samples a second)")
    ap.add_argument("--focus", default=r"opencomposer/", help="regex of frames to attribute samples to")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args(argv)
    s = summarise(read(a.profile), a.focus, a.top)
    if a.seconds > 0:
        s["gil_busy_share"] = round(s["samples"] / (a.rate * a.seconds), 4)
    for name, g in s["groups"].items():
        print(f"{g['share']:7.1%}  {name}", file=sys.stderr)
        for f, share in g["top"]:
            print(f"          {share:6.1%}  {f}", file=sys.stderr)
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
