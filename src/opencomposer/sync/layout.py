"""How weight versions are laid out in a store: one folder per (version, timeline, kind),
one manifest and one blob per training rank.

    0000000012-3f9a1c2b7d40-delta/rank00000-of-00002.bin    rank 0's payloads, concatenated
    0000000012-3f9a1c2b7d40-delta/rank00000-of-00002.json   what they are (written last)
    0000000012-3f9a1c2b7d40-delta/rank00001-of-00002.bin
    0000000012-3f9a1c2b7d40-delta/rank00001-of-00002.json

A version is complete when every rank's manifest is there (a manifest is written after
its blob, so a manifest means a whole version part). ``full`` versions hold every tensor;
``delta`` versions hold each tensor against the version before it in the same timeline.
A timeline is one unbroken run of a publisher: a resumed trainer that publishes a version
again starts a new timeline (the old one's later versions are abandoned), and a follower
on the old one reloads from the new one's full snapshot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FORMAT = "opencomposer-weights/1"
_KEY = re.compile(r"^(\d{10})-([0-9a-z]{1,32})-(full|delta)/rank(\d{5})-of-(\d{5})\.(json|bin)$")


@dataclass(frozen=True, order=True)
class Entry:
    """One version of one timeline, as listed."""

    version: int
    timeline: str
    kind: str
    world: int

    @property
    def folder(self) -> str:
        return f"{self.version:010d}-{self.timeline}-{self.kind}"

    def manifest(self, rank: int) -> str:
        return f"{self.folder}/rank{rank:05d}-of-{self.world:05d}.json"

    def blob(self, rank: int) -> str:
        return f"{self.folder}/rank{rank:05d}-of-{self.world:05d}.bin"


def scan(keys: list[str]) -> tuple[list[Entry], list[Entry]]:
    """(complete entries, incomplete ones) among a store's keys, each sorted by version;
    keys of other shapes are ignored."""
    ranks: dict[Entry, set[int]] = {}
    for key in keys:
        m = _KEY.match(key)
        if m:
            e = Entry(int(m[1]), m[2], m[3], int(m[5]))
            ranks.setdefault(e, set())
            if m[6] == "json":
                ranks[e].add(int(m[4]))
    done = sorted(e for e, r in ranks.items() if r == set(range(e.world)))
    return done, sorted(set(ranks) - set(done))


def keys_of(entry: Entry, keys: list[str]) -> list[str]:
    return [k for k in keys if k.startswith(entry.folder + "/")]
