#!/usr/bin/env bash
# The working tree that travels with every device call, without the task packs kept in git (data/tasks/, 44 MB of
# a 53 MB tree): while "on", data/tasks/ is out of git's index and ignored (.git/info/exclude), so a call carries it
# only when `carry` names it (once a machine: ignored files already there stay between calls) and every other call
# has ~55 MiB of room instead of ~12 MiB (session 47: the long run's 27 stash calls became 7).
#   benchmarks/tree_slim.sh on       # before a device session; refused while data/tasks/ has uncommitted changes
#   benchmarks/tree_slim.sh off      # after it (and before any commit: a pre-commit hook refuses a commit meanwhile)
#   benchmarks/tree_slim.sh status
# Only the index and .git/ change: the files stay where they are, and `off` gives back exactly the committed index
# entries. Each command prints one JSON line last.
set -euo pipefail
cd "$(dirname "$0")/.."
EXCLUDE=.git/info/exclude
LINE=/data/tasks/
HOOK=.git/hooks/pre-commit
MARK="# tree_slim.sh"

report() {
  local state=off
  grep -qxF "$LINE" $EXCLUDE 2>/dev/null && state=on
  echo "{\"slim\": \"$state\", \"room_mib\": $(benchmarks/carry_room.sh 2>/dev/null || echo 0), \"tree_bytes\": $(( (64 << 20) - $(benchmarks/carry_room.sh --bytes) ))}"
}

case "${1:-}" in
  on)
    if ! git diff --quiet HEAD -- data/tasks || [ -n "$(git ls-files --others --exclude-standard data/tasks)" ]; then
      echo "tree_slim: data/tasks/ has changes not committed: commit them first (nothing was changed)" >&2; exit 2
    fi
    grep -qxF "$LINE" $EXCLUDE 2>/dev/null || echo "$LINE" >> $EXCLUDE
    git rm -r -q --cached data/tasks
    mkdir -p .git/hooks
    if [ ! -e $HOOK ]; then
      printf '#!/bin/sh\n%s: no commit while data/tasks/ is out of the index\n' "$MARK" > $HOOK
      printf 'if grep -qxF %s %s; then echo "benchmarks/tree_slim.sh is on: run benchmarks/tree_slim.sh off before committing" >&2; exit 1; fi\n' \
        "$LINE" "$EXCLUDE" >> $HOOK
      chmod +x $HOOK
    fi
    report ;;
  off)
    git reset -q -- data/tasks
    if grep -qxF "$LINE" $EXCLUDE 2>/dev/null; then
      grep -vxF "$LINE" $EXCLUDE > $EXCLUDE.tmp || true
      mv $EXCLUDE.tmp $EXCLUDE
    fi
    if ! git diff --cached --quiet -- data/tasks; then
      echo "tree_slim: data/tasks/ in the index still differs from HEAD" >&2; exit 1
    fi
    report ;;
  status) report ;;
  *) echo "usage: $0 on|off|status" >&2; exit 2 ;;
esac
