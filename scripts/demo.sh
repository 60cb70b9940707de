#!/usr/bin/env bash
# make demo: a real library -> validated tasks -> agents solving them in sandboxes.
# (Until the learning loop lands, the demo shows the task factory, the oracle and the
# embedded model acting through the same harness that RL will use.)
set -euo pipefail
cd "$(dirname "$0")/.."
OC=.venv/bin/opencomposer
OUT=${DEMO_OUT:-runs/demo}
SOURCE=${DEMO_SOURCE:-pypi:toolz==1.2.0}
BACKEND=$(.venv/bin/python -c "from opencomposer.sandbox.namespace import unavailable_reason as u; print('local' if u() else 'namespace')")
mkdir -p "$OUT"
echo "== 1. tasks from $SOURCE (sandbox: $BACKEND)"
$OC tasks make --source "$SOURCE" --out "$OUT/tasks" --max 5 --seed 0 --sandbox "$BACKEND" | tail -1 > "$OUT/make.json"
echo "== 2. check them"
$OC tasks check "$OUT/tasks" --sandbox "$BACKEND" | tail -1 > "$OUT/check.json"
cat "$OUT/check.json"
echo "== 3. the oracle solves each through the harness"
: > "$OUT/oracle.jsonl"
for t in "$OUT"/tasks/*/; do
  [ -f "$t/task.toml" ] || continue
  $OC agent --task "$t" --policy oracle --sandbox "$BACKEND" --no-verbose \
     --transcript "$OUT/transcripts/$(basename "$t")-oracle.json" | tail -1 >> "$OUT/oracle.jsonl"
done
echo "== 4. the embedded model (SmolLM2-135M-Instruct) tries the first task"
first=$(ls -d "$OUT"/tasks/*/ | head -1)
$OC agent --task "$first" --policy model --model smollm2-135m --sandbox "$BACKEND" \
   --config configs/agent-demo.toml --transcript "$OUT/transcripts/model.json" | tail -1 > "$OUT/model.json"
.venv/bin/python - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
make, check = json.loads((out / "make.json").read_text()), json.loads((out / "check.json").read_text())
oracle = [json.loads(l) for l in (out / "oracle.jsonl").read_text().splitlines() if l.strip()]
model = json.loads((out / "model.json").read_text())
summary = {"tasks_made": make["made"], "tasks_ok": check["ok"], "leaks": check["leaks"],
           "oracle_solved": sum(r["reward"] == 1.0 for r in oracle), "oracle_runs": len(oracle),
           "model_reward": model.get("reward"), "model_invalid_calls": model.get("invalid_calls"),
           "model_turns": model.get("turns")}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"demo report: {out / 'summary.json'}  (transcripts in {out / 'transcripts'})")
print(json.dumps(summary))
PY
