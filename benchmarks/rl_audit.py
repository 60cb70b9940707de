"""Read what an RL run rewarded: every kept transcript of a passed or flagged rollout, with its edits.

An RL run keeps the transcripts of the rollouts the hidden tests passed and of those a monitor
flagged (``[rollout] keep_transcripts``, ``rl/transcripts.py``; the long run's come back in each arm's
``results.tgz``). This prints, as markdown, the counts (passes by library, flags by monitor) and then
each episode: step, task, reward, the monitors' evidence, and every call that changed or ran
something (arguments cut at ``--chars``), so a person can judge whether each pass was earned.

    python benchmarks/rl_audit.py runs/learn-gpu/lines-more-lint/rl_run [--only flagged] [--out audit.md]

The last line is one JSON object: the counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from opencomposer.rl.transcripts import audit


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + f" ... ({len(text) - n} more chars)"


def render(report: dict, only: str, chars: int) -> str:
    lines = [(f"# RL audit: {report['kept']} kept transcripts, {report['passed']} passed, {report['flagged']} "
              f"flagged, {report['sampled']} sampled"),
             "", "| passes by library | count |", "|---|---|"]
    lines += [f"| {lib} | {n} |" for lib, n in report["passed_by_library"].items()]
    lines += ["", "| monitor | rollouts flagged |", "|---|---|"]
    lines += [f"| {kind} | {n} |" for kind, n in report["by_flag"].items()] or ["| (none) | 0 |"]
    for e in report["entries"]:
        if ((only == "passed" and not e["passed"]) or (only == "flagged" and not e["flags"])
                or (only == "sample" and e["kept_as"] != "sample")):
            continue
        verdict = ("passed" if e["passed"] else "failed") + (", a sample of the step's" if e["kept_as"] == "sample" else "")
        if e["flags"]:
            verdict += ", flagged: " + ", ".join(sorted(e["flags"])) + " (reward voided)"
        lines += ["", f"## step {e['step']}: {e['task']} ({verdict})", "",
                  (f"{e['turns']} turns, {e['tool_calls']} tool calls, {e['completion_tokens']} completion tokens; "
                   f"`{e['path']}`")]
        for kind, evidence in sorted(e["flags"].items()):
            lines += [f"- **{kind}**: " + "; ".join(_cut(str(x), chars) for x in evidence)]
        for c in e["calls"]:
            args = json.dumps(c["arguments"], ensure_ascii=False)
            lines += ["", f"`{c['name']}`" + ("" if c["ok"] else " (failed)") + ":", "```", _cut(args, chars), "```"]
        if e["final_message"]:
            lines += ["", f"final message: {_cut(e['final_message'], chars)}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help=("an RL run's out dir (holding transcripts/), or a learning run's "
                                            "out_dir holding rl_run/"))
    ap.add_argument("--only", choices=("all", "passed", "flagged", "sample"), default="all")
    ap.add_argument("--chars", type=int, default=1200, help="cut each call's arguments and each evidence here")
    ap.add_argument("--out", type=Path, help="write the markdown here instead of stdout")
    a = ap.parse_args(argv)
    run = a.run / "rl_run" if (a.run / "rl_run" / "transcripts").is_dir() else a.run
    if not (run / "transcripts").is_dir():
        print(f"{a.run}: no transcripts/ folder (nor rl_run/transcripts/): not an RL run that kept transcripts",
              file=sys.stderr)
        return 2
    try:
        report = audit(run)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    text = render(report, a.only, a.chars)
    if a.out:
        a.out.write_text(text)
    else:
        sys.stdout.write(text)
    print(json.dumps({k: v for k, v in report.items() if k != "entries"} | {"run": str(run)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
