"""One real-time cycle, end to end and timed: serve -> simulated users -> logs -> rewards ->
train -> eval gate -> hot-swap, each a real process or step.

    nice -n 10 .venv/bin/python benchmarks/bench_realtime.py --model smollm2-135m --sessions 8 \\
        --config configs/realtime/realtime.toml --out runs/bench-realtime

1. ``opencomposer serve --model M --log-dir OUT/logs`` starts on a free port;
2. ``opencomposer realtime users`` runs ``--sessions`` simulated sessions against it (tasks
   from the ``[gate]`` suite's sibling: ``--user-suite``, default ``smoke``);
3. ``opencomposer realtime --config`` (its server URL, log dir, model and out dir
   replaced by this run's) takes one cycle;
4. a request after the cycle checks the server serves what the cycle deployed.

Prints the users' summary, the cycle's row and the timings; the last line is one JSON
object with per-stage seconds and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from opencomposer.inference.server.process import serve_process


def cli(*args: str, timeout: float = 7200) -> dict:
    r = subprocess.run([sys.executable, "-m", "opencomposer.cli", *args], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        sys.exit(f"opencomposer {' '.join(args[:2])} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--config", default="configs/realtime/realtime.toml")
    ap.add_argument("--out", default="runs/bench-realtime")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--user-suite", default="smoke")
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with serve_process("--model", args.model, "--port", "0", "--default-max-tokens", str(args.max_tokens),
                       "--max-num-seqs", "8", "--log-dir", str(out / "logs"), stop_timeout=60) as ready:
        url = ready["serving"]
        t_serve = time.perf_counter() - t0
        t1 = time.perf_counter()
        users = cli("realtime", "users", "--base-url", url, "--model", args.model, "--suite", args.user_suite,
                    "--sessions", str(args.sessions), "--max-turns", str(args.max_turns),
                    "--max-tokens", str(args.max_tokens))
        t_users = time.perf_counter() - t1
        text = Path(args.config).read_text()
        for key, value in (("url", url.removesuffix("/v1")), ("dir", str(out / "logs")), ("name", args.model),
                           ("out_dir", str(out / "rt"))):
            text = re.sub(rf'(?m)^{key} = "[^"]*"', f'{key} = "{value}"', text, count=1)
        cfg = out / "realtime.toml"
        cfg.write_text(text)
        t2 = time.perf_counter()
        row = cli("realtime", "--config", str(cfg), "--once")
        t_cycle = time.perf_counter() - t2
        arms = httpx.get(url.removesuffix("/v1") + "/admin/arms", timeout=60).json()["arms"]
    result = {"model": args.model, "sessions": args.sessions, "outcome": row["outcome"],
              "seconds": {"serve_start": round(t_serve, 1), "users": round(t_users, 1), "cycle": round(t_cycle, 1),
                          **{f"cycle_{k}": v for k, v in row["seconds"].items()}},
              "window": row["window"], "rewards": row["rewards"], "samples": row["samples"],
              "train": {k: v for k, v in row.get("train", {}).items() if k != "steps"},
              "gate": row.get("gate"), "served_after": arms.get("a"),
              "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(users), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
