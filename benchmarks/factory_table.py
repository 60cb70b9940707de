"""The per-library table of a factory run, for benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/factory_table.py out/factory2k

Reads ``OUT/factory_summary.json`` (made, tried, seconds over all sessions, flaky, levels,
rejections), each library's ``_envs/<slug>/env.json`` (how its environment was made: a
resumed session reports ``cached``) and ``OUT/_validation.jsonl`` (benchmarks/validate_factory.py).
Libraries still being made when the summary was last written are read from their journal.
Prints the markdown table, then one JSON line with the totals.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from opencomposer.tasks.deletion import LEVELS


def _journal(path: Path) -> dict:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip().startswith("{")]
    tried = {ln["key"]: ln for ln in lines if "key" in ln}
    sessions: dict[str, float] = {}
    for ln in lines:
        sessions[ln["session"]] = max(sessions.get(ln["session"], 0.0), ln.get("s", 0.0))
    made = [ln for ln in tried.values() if ln.get("task")]
    return {"made": len(made), "tried": len(tried), "seconds": sum(sessions.values()),
            "levels": dict(Counter(ln["level"] for ln in made)),
            "rejected": dict(Counter(ln["outcome"] for ln in tried.values() if not ln.get("task"))),
            "running": lines[-1].get("event") != "stopped" if lines else False}


def main() -> None:
    out = Path(sys.argv[1])
    summary = json.loads((out / "factory_summary.json").read_text())
    val: dict[str, list[dict]] = {}
    vpath = out / "_validation.jsonl"
    for raw in vpath.read_text().splitlines() if vpath.exists() else []:
        r = json.loads(raw)
        val.setdefault(r["task"].split("__", 1)[0], []).append(r)
    rows = {}
    for spec, r in summary["per_library"].items():
        rows[spec] = {**r, "running": False}
    slugs = {}
    for env in sorted((out / "_envs").glob("*/env.json")):
        slugs[env.parent.name] = json.loads(env.read_text()).get("method", "?")
    for j in sorted((out / "_journal").glob("*.jsonl")):  # libraries the summary has not caught up with
        name = j.stem
        spec = next((s for s in rows if s.lower().replace("_", "-").replace("==", "-") == name), None)
        jr = _journal(j)
        if spec is None or jr["running"] or jr["tried"] > rows[spec]["tried"]:
            spec = spec or name
            rows[spec] = {**rows.get(spec, {}), **jr, "install": rows.get(spec, {}).get("install", "")}
    print("| library | made | tried | s | tasks/min | install | flaky | " + "/".join(LEVELS)
          + " | check ok | leaks | oracle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    tot = Counter()
    for spec, r in rows.items():
        slug = spec.lower().replace("_", "-").replace("==", "-")
        install = slugs.get(slug, "failed" if r.get("install") == "failed" else r.get("install") or "-")
        if r.get("error") and not r.get("made"):
            install = f"{install}: {r['error'][:90]}"
        v = val.get(slug, [])
        secs = r.get("seconds", 0.0)
        lv = "/".join(str(r.get("levels", {}).get(x, 0)) for x in LEVELS)
        print(f"| {spec}{' (running)' if r.get('running') else ''} | {r.get('made', 0)} | {r.get('tried', 0)} | "
              f"{secs:.0f} | {r.get('made', 0) / max(secs, 1e-9) * 60:.1f} | {install} | {r.get('flaky', '-')} | {lv} | "
              f"{sum(x['check_ok'] for x in v)}/{len(v)} | {sum(x['leaks'] > 0 for x in v)} | "
              f"{sum(x['oracle'] == 1.0 for x in v)}/{len(v)} |")
        tot["made"] += r.get("made", 0)
        tot["tried"] += r.get("tried", 0)
        tot["seconds"] += secs
        tot["libraries_with_tasks"] += r.get("made", 0) > 0
        tot["checked"] += len(v)
        tot["check_ok"] += sum(x["check_ok"] for x in v)
        tot["leaky"] += sum(x["leaks"] > 0 for x in v)
        tot["oracle_solved"] += sum(x["oracle"] == 1.0 for x in v)
        for k, n in r.get("levels", {}).items():
            tot[f"level_{k}"] += n
        for k, n in r.get("rejected", {}).items():
            tot[f"rejected: {k}"] += n
    tot["tasks_per_minute"] = round(tot["made"] / max(tot["seconds"], 1e-9) * 60, 2)
    print(json.dumps(dict(tot)))


if __name__ == "__main__":
    main()
