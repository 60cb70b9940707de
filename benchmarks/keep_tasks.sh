#!/usr/bin/env bash
# Task sets kept in git: what the factory made in out/NAME, packed without wheels into data/tasks/NAME.ocpack
# (~9 KB a task) with the factory's journal beside it (data/tasks/NAME.journal.tgz), so a fresh clone gets them back
# without the hours of factory time (session 37 began on a clone without out/: 3,051 tasks were lost).
#   benchmarks/keep_tasks.sh keep NAME...      out/NAME -> data/tasks/NAME.ocpack (+ journal); then git add them
#   benchmarks/keep_tasks.sh restore NAME...   data/tasks/NAME.ocpack -> out/NAME, environments rebuilt from the
#                                              index's pinned wheels (--fetch-wheels), journal put back (the factory
#                                              resumes a set it had not finished: `opencomposer tasks make --config ...`)
#   benchmarks/keep_tasks.sh restore           every kept set not in out/ yet
# Prints one JSON line per set.
set -euo pipefail
cd "$(dirname "$0")/.."
OC=${OC:-.venv/bin/opencomposer}
D=data/tasks
what=${1:-}; shift || true
case $what in
  keep)
    [ $# -gt 0 ] || { echo "keep: name at least one set of out/" >&2; exit 2; }
    for n in "$@"; do
      [ -d out/$n ] || { echo "keep: out/$n: no such task set" >&2; exit 2; }
      $OC tasks pack out/$n -o $D/.$n.ocpack.tmp --no-wheels --level 19 > /tmp/keep-$n.json
      mv $D/.$n.ocpack.tmp $D/$n.ocpack
      j=(); for x in _journal factory_summary.json; do [ -e out/$n/$x ] && j+=($x); done
      [ ${#j[@]} -gt 0 ] && tar -czf $D/.$n.journal.tmp -C out/$n "${j[@]}" && mv $D/.$n.journal.tmp $D/$n.journal.tgz
      python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(json.dumps({'kept': sys.argv[2], 'tasks': r['tasks'], 'bytes': r['bytes_out']}))" /tmp/keep-$n.json $n
    done ;;
  restore)
    names=("$@")
    [ ${#names[@]} -gt 0 ] || for f in $D/*.ocpack; do n=$(basename $f .ocpack); [ -d out/$n ] || names+=($n); done
    for n in "${names[@]}"; do
      [ -f $D/$n.ocpack ] || { echo "restore: $D/$n.ocpack: not kept" >&2; exit 2; }
      [ -e out/$n ] && { echo "restore: out/$n exists; move it away first" >&2; exit 2; }
      mkdir -p out
      $OC tasks unpack $D/$n.ocpack -o out/$n --fetch-wheels | tail -1
      [ -f $D/$n.journal.tgz ] && tar -xzf $D/$n.journal.tgz -C out/$n
    done ;;
  *) echo "usage: $0 keep NAME... | restore [NAME...]" >&2; exit 2 ;;
esac
