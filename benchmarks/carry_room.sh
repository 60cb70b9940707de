#!/usr/bin/env bash
# How many MiB one device call can carry beside the working tree that travels with it (tracked files and untracked,
# not ignored ones: data/tasks/ is tracked), with 2 MiB to spare: the size of each part the device scripts split
# their carried files into (ablation_device.sh's GGUF parts, learn_device.sh's packs and factory parts).
#   benchmarks/carry_room.sh          # e.g. 29 (a 33 MiB tree: 64 - 33 - 2)
#   benchmarks/carry_room.sh --bytes  # the exact room in bytes, nothing to spare (64 MiB less the tree)
#   benchmarks/carry_room.sh --slim   # the room once benchmarks/tree_slim.sh is on (data/tasks/ out of the tree):
#                                     # what learn_device.sh prepare cuts its parts to, for the device sessions
set -euo pipefail
cd "$(dirname "$0")/.."
slim=cat; [ "${1:-}" = --slim ] && { slim="grep -zv ^data/tasks/"; shift; }
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | $slim | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
[ "${1:-}" = --bytes ] && { echo $(( (64 << 20) - tree )); exit 0; }
room=$(( 64 - (tree + 1048575) / 1048576 - 2 ))
[ $room -ge 4 ] || { echo "carry_room: the tree that travels is $(( tree / 1048576 )) MiB: no room left under the device's 64 MiB" >&2; exit 2; }
echo $room
