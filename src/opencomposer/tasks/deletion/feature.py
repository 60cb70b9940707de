"""Features that span several functions, possibly in several files: a function and the
library functions it calls, all of their bodies deleted at once.

``find_features`` pairs each function candidate (the *anchor*) with up to ``max_members - 1``
other function candidates it calls: ``helper()`` when exactly one module-level candidate has
that name (in any file), ``self.helper()`` for a method of the anchor's own class. ``delete_feature`` stubs every
body (level ``body`` per member, bottom-up within a file so line numbers stay valid) and
returns one ``FeatureDeletion`` whose gold patch restores every file::

    feats = find_features(find_candidates(repo, ["toolz"]))
    d = delete_feature(repo, feats[0])          # d.files, d.patch, d.removed

Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_levels.py``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from opencomposer.tasks.deletion.candidates import Candidate
from opencomposer.tasks.deletion.edit import delete
from opencomposer.tasks.deletion.lines import DeletionError, read_source
from opencomposer.tasks.deletion.patch import make_patch


@dataclass(frozen=True)
class Feature:
    anchor: Candidate
    members: tuple[Candidate, ...]  # the anchor first, then the functions it calls

    @property
    def files(self) -> list[str]:
        return sorted({m.file for m in self.members})


@dataclass(frozen=True)
class FeatureDeletion:
    feature: Feature
    sources: tuple[tuple[str, str, str], ...]  # (file, before, after) per edited file
    removed: str
    level: str = "feature"

    @property
    def candidate(self) -> Candidate:
        return self.feature.anchor

    @property
    def members(self) -> tuple[Candidate, ...]:
        return self.feature.members

    @property
    def files(self) -> dict[str, tuple[str, str]]:
        return {f: (b, a) for f, b, a in self.sources}

    @property
    def before(self) -> str:
        """The anchor's original file (for its definition text)."""
        return self.files[self.candidate.file][0]

    @property
    def after(self) -> str:
        return self.files[self.candidate.file][1]

    @property
    def patch(self) -> str:
        return "".join(make_patch(b, a, f) for f, b, a in self.sources)


def find_features(cands: list[Candidate], max_members: int = 3) -> list[Feature]:
    """One feature per function candidate that calls >= 1 other candidate; file order.

    ``f(...)`` matches a module-level function named ``f`` if the library has exactly one;
    ``self.m(...)`` matches the method ``m`` of the caller's own class."""
    funcs = [c for c in cands if c.kind == "function"]
    module_level = [c for c in funcs if "." not in c.qualname]
    count = Counter(c.name for c in module_level)
    by_name = {c.name: c for c in module_level if count[c.name] == 1}
    by_method = {(c.file, c.qualname): c for c in funcs if "." in c.qualname}
    out = []
    for c in funcs:
        cls = c.qualname.rpartition(".")[0]
        callees = [by_name[n] if n[0] != "." else by_method.get((c.file, f"{cls}{n}"))
                   for n in c.calls if n in by_name or (cls and n[0] == ".")]
        callees = [m for m in callees if m is not None and m is not c]
        # helpers in other files first: those make the feature span files
        callees.sort(key=lambda m: (m.file == c.file, m.file, m.lineno))
        if callees:
            out.append(Feature(c, (c, *callees[: max_members - 1])))
    return out


def delete_feature(repo: Path, feature: Feature) -> FeatureDeletion:
    """Stub the body of every member; DeletionError if any member cannot be edited."""
    repo = Path(repo)
    sources, removed = [], []
    for f in feature.files:
        before = read_source(repo / f)
        text = before
        for m in sorted((m for m in feature.members if m.file == f), key=lambda m: -m.lineno):
            d = delete(text, m, "body")
            text = d.after
            removed.append(d.removed)
        if text == before:
            raise DeletionError(f"{f}: feature {feature.anchor.qualname}: nothing deleted")
        sources.append((f, before, text))
    return FeatureDeletion(feature, tuple(sources), "".join(removed))
