#!/usr/bin/env bash
# make demo: the whole learning job on the embedded SmolLM2-135M, on a 2-core CPU.
#   a real library (toolz from PyPI) -> validated feature-deletion tasks
#   -> SFT on oracle traces -> GRPO steps -> held-out pass@1 of the trained and the
#   base model -> report (Markdown + PNG).
# The run resumes if interrupted: run `make demo` again.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${DEMO_CONFIG:-configs/train/demo.toml}
BACKEND=$(.venv/bin/python -c "from opencomposer.sandbox.namespace import unavailable_reason as u; r = u(); print('local' if r else 'namespace')")
[ "$BACKEND" = local ] && echo "note: namespace sandboxes unavailable here; using the local backend"
OUT=$(.venv/bin/python -c "import tomllib,sys; print(tomllib.load(open('$CONFIG','rb'))['run']['out_dir'])")
mkdir -p "$(dirname "$OUT")"
RESUME=""
[ -d "$OUT/checkpoints" ] || [ -f "$OUT/evals.json" ] && RESUME="--resume"
start=$(date +%s)
.venv/bin/opencomposer train --config "$CONFIG" --sandbox "$BACKEND" $RESUME | tee "$OUT.result.json" | tail -1 >/dev/null
echo "demo finished in $(( $(date +%s) - start ))s"
echo "demo report: $(.venv/bin/python -c "import json; print(json.load(open('$OUT.result.json'))['report'])")"
