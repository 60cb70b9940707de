"""The text corpus that MTP heads (``train/mtp.py``) and continued pretraining (``train/pretrain.py``)
read: files -> documents -> packed windows, a held-out split by document, a weighted mix.

    sources = [parse_source("src/"), parse_source("more.jsonl:2")]      # path[:weight]
    corpus = pack_corpus(sources, tokenizer, seq_len=256, held_out=0.05, what="pretrain data")
    mix = Mix([p.train for p in corpus], [p.source.weight for p in corpus], batch_size=8, seed=0)
    mix.batch_for_step(12)        # the 8 windows of step 12: a pure function of (seed, 12)

Data: source files or directories of them (every text file with a code or text suffix, up
to ``MAX_FILE_BYTES``), ``.jsonl`` files of ``{"text": ...}`` (one document a line), and agent
transcripts (``.json``: each assistant turn rendered as the deployed agent sees it, as
``sft.py`` does). A document is a file, a ``.jsonl`` line or a transcript (all its turns).

Held-out split: a document is held out when a hash of (seed, its path) falls below the
held-out fraction, decided per document so that a document's windows are all on one side,
and so that adding files never moves another document across (at least one document of a
source with two or more is held out, and never all of them). Each side is packed on its own:
documents joined by the end-of-text token and cut into fixed windows (no padding; the tail
dropped), so no window straddles the split.

Mix: a pass lists every source's training windows ``weight`` times (2 = twice, 0.5 = a
different half each pass), shuffled per pass from the seed. Step ``s`` takes the global
positions ``s * batch_size ...`` of the endless run of passes.

Test: ``pytest tests/unit/train/test_pretrain.py tests/unit/train/test_mtp.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opencomposer.harness.trajectory import TRAJECTORY_FORMAT, Trajectory
from opencomposer.train.sft import build_sft_samples

TEXT_SUFFIXES = {".py", ".pyi", ".md", ".txt", ".rst", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".json",
                 ".js", ".ts", ".tsx", ".rs", ".go", ".c", ".h", ".cc", ".cpp", ".java", ".sh", ".sql", ".html",
                 ".css"}
MAX_FILE_BYTES = 1 << 20
EXPECTED = "expected source files, directories of them, .jsonl files of {\"text\": ...} or agent transcripts"


@dataclass(frozen=True)
class Source:
    """A file or directory of the corpus and its weight in the mix."""

    path: Path
    weight: float = 1.0

    @property
    def name(self) -> str:
        return str(self.path)


@dataclass
class Document:
    source: int  # index of its Source
    key: str  # what the held-out split hashes: the file (and line) it came from
    ids: list[int]


@dataclass
class PackedSource:
    """One source's documents after the split, packed into ``[n, seq_len]`` windows."""

    source: Source
    train: torch.Tensor
    held_out: torch.Tensor
    documents: int
    held_out_documents: int
    tokens: int
    held_out_tokens: int

    def counts(self) -> dict[str, Any]:
        return {"weight": self.source.weight, "documents": self.documents, "tokens": self.tokens,
                "windows": len(self.train), "held_out_documents": self.held_out_documents,
                "held_out_tokens": self.held_out_tokens, "held_out_windows": len(self.held_out)}


def parse_source(spec: str | Path, what: str = "data") -> Source:
    """``path`` or ``path:weight`` (a path that exists as written keeps its colon)."""
    if isinstance(spec, Path) or Path(spec).exists():
        return Source(Path(spec))
    head, sep, tail = spec.rpartition(":")
    try:
        weight = float(tail) if sep and head else None
    except ValueError:
        weight = None
    if weight is None:
        return Source(Path(spec))
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"{what} {spec!r}: weight {tail!r} must be a positive number (path:weight)")
    return Source(Path(head), weight)


def read_corpus(paths: Sequence[str | Path], tokenizer: Any, what: str = "MTP data") -> list[list[int]]:
    """Token ids of every document found under ``paths`` (see the module docstring)."""
    return [d.ids for d in read_documents([Source(Path(p)) for p in paths], tokenizer, what)]


def read_documents(sources: Sequence[Source], tokenizer: Any, what: str = "data") -> list[Document]:
    """Every document (of two tokens or more) under ``sources``, files in sorted order."""
    docs: list[Document] = []
    with _whole_files(tokenizer):
        for i, s in enumerate(sources):
            _read(s.path, i, tokenizer, docs, what)
    return docs


@contextlib.contextmanager
def _whole_files(tokenizer: Any) -> Iterator[None]:
    # whole files are tokenised (cut into windows later): no "longer than the model" warnings
    limit, tokenizer.model_max_length = tokenizer.model_max_length, 1 << 62
    try:
        yield
    finally:
        tokenizer.model_max_length = limit


def _read(p: Path, source: int, tokenizer: Any, docs: list[Document], what: str) -> None:
    if not p.exists():
        raise FileNotFoundError(f"{what}: {p} does not exist ({EXPECTED})")
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    for f in files:
        key = str(f.relative_to(p)) if p.is_dir() else f.name
        for part, ids in _documents(f, tokenizer, explicit=not p.is_dir()):
            if len(ids) > 1:
                docs.append(Document(source, key + part, ids))


def _documents(f: Path, tokenizer: Any, explicit: bool) -> list[tuple[str, list[int]]]:
    """``(key suffix, ids)`` per document of file ``f``: a line of a .jsonl has its own suffix,
    a transcript's turns share one (they are one conversation, so one side of the split)."""
    if f.suffix == ".jsonl":
        out = []
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{f}:{n}: expected a JSON object with a \"text\" string ({e})") from e
            out.append((f":{n}", tokenizer.encode(str(text))))
        return out
    if f.suffix == ".json" and (obj := _transcript(f)) is not None:
        samples, _ = build_sft_samples([Trajectory.from_dict(obj)], tokenizer, 1 << 30)
        return [("", list(s.input_ids)) for s in samples]
    if f.suffix not in TEXT_SUFFIXES and not explicit:
        return []
    if f.stat().st_size > MAX_FILE_BYTES:
        return []
    return [("", tokenizer.encode(f.read_text(errors="replace")))]


def _transcript(f: Path) -> dict | None:
    """``f``'s JSON if it is an agent transcript (read once), else None."""
    try:
        obj = json.loads(f.read_text(errors="replace"))
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) and obj.get("format") == TRAJECTORY_FORMAT else None


def pack(docs: Iterable[Sequence[int]], sep: int) -> torch.Tensor:
    """``docs`` joined into one stream, each followed by ``sep``."""
    parts = [torch.tensor([*d, sep], dtype=torch.long) for d in docs]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def cut(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[n, seq_len]`` consecutive windows of ``stream`` (the tail shorter than a window dropped)."""
    n = len(stream) // seq_len
    return stream[:n * seq_len].view(n, seq_len)


def windows(docs: list[list[int]], seq_len: int, sep: int) -> list[list[int]]:
    """``docs`` joined by ``sep`` and cut into windows of ``seq_len`` tokens (the tail dropped)."""
    return cut(pack(docs, sep), seq_len).tolist()


def _unit(*parts: object) -> float:
    """A number in [0, 1) fixed by ``parts``: the same on every machine and Python run."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_documents(docs: list[Document], held_out: float, seed: int = 0) -> tuple[list[Document], list[Document]]:
    """``(train, held_out)`` by document (see the module docstring)."""
    train: list[Document] = []
    held: list[Document] = []
    for source in sorted({d.source for d in docs}):
        mine = sorted((d for d in docs if d.source == source), key=lambda d: _unit(seed, d.key))
        n = sum(_unit(seed, d.key) < held_out for d in mine)  # the lowest hashes are the held-out ones
        if len(mine) >= 2 and held_out > 0:
            n = min(max(n, 1), len(mine) - 1)
        held += mine[:n]
        train += mine[n:]
    return train, held


def pack_corpus(sources: Sequence[Source], tokenizer: Any, seq_len: int, held_out: float, seed: int = 0,
                what: str = "data") -> list[PackedSource]:
    """Read, split and pack every source; raises ``ValueError`` naming the data when there is too
    little of it for one training window and one held-out window."""
    names = [s.name for s in sources]
    docs = read_documents(sources, tokenizer, what)
    if not docs:
        raise ValueError(f"{what} {names}: no documents found ({EXPECTED}; inside a directory only files "
                         f"ending in {', '.join(sorted(TEXT_SUFFIXES))})")
    if len(docs) < 2 and held_out > 0:
        raise ValueError(f"{what} {names}: 1 document ({docs[0].key}); the held-out split is by document and "
                         "needs at least 2. Add data")
    train, held = split_documents(docs, held_out, seed)
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    out = []
    for i, s in enumerate(sources):
        tr = [d.ids for d in train if d.source == i]
        he = [d.ids for d in held if d.source == i]
        out.append(PackedSource(s, cut(pack(tr, sep), seq_len), cut(pack(he, sep), seq_len), len(tr), len(he),
                                sum(map(len, tr)), sum(map(len, he))))
    n_train, n_held = sum(len(p.train) for p in out), sum(len(p.held_out) for p in out)
    if n_train < 1:
        raise ValueError(f"{what} {names}: the {len(train)} training documents ({sum(p.tokens for p in out)} "
                         f"tokens) make 0 windows of seq_len={seq_len}. Add data or lower --seq-len")
    if held_out > 0 and n_held < 1:
        raise ValueError(f"{what} {names}: the {len(held)} held-out documents ({sum(p.held_out_tokens for p in out)} "
                         f"tokens, held_out={held_out}) make 0 windows of seq_len={seq_len}. Add data, lower "
                         "--seq-len or raise held_out")
    return out


class Mix:
    """Training windows of several sources in a weighted order; the batch of step ``s`` depends
    on (seed, s) only, so a resumed run (or any rank of a distributed one) draws the same."""

    def __init__(self, parts: Sequence[torch.Tensor], weights: Sequence[float], batch_size: int, seed: int = 0):
        if len(parts) != len(weights):
            raise ValueError(f"{len(parts)} sources but {len(weights)} weights")
        self.parts, self.batch_size, self.seed = list(parts), batch_size, seed
        # windows each source gives a pass: at least one for any source with windows
        self.counts = [max(1, round(w * len(p))) if len(p) else 0 for p, w in zip(parts, weights)]
        self.pass_len = sum(self.counts)
        if self.pass_len < 1:
            raise ValueError("no training windows in any source")
        self._orders: dict[int, torch.Tensor] = {}

    def shares(self) -> list[float]:
        """Each source's share of the training windows drawn."""
        return [c / self.pass_len for c in self.counts]

    def order(self, n: int) -> torch.Tensor:
        """``[pass_len, 2]`` (source, window) pairs of pass ``n``."""
        if n not in self._orders:
            rows = []
            for k, (p, count) in enumerate(zip(self.parts, self.counts)):
                if not count:
                    continue
                g = torch.Generator().manual_seed(int(_unit(self.seed, n, k) * 2**62))
                whole = [torch.arange(len(p))] * (count // len(p))  # weight >= 1: every window, that many times
                idx = torch.cat(whole + [torch.randperm(len(p), generator=g)[:count % len(p)]])
                rows.append(torch.stack([torch.full_like(idx, k), idx], 1))
            g = torch.Generator().manual_seed(int(_unit(self.seed, n, "pass") * 2**62))
            pairs = torch.cat(rows)
            self._orders = {n: pairs[torch.randperm(len(pairs), generator=g)]}  # passes are visited in order
        return self._orders[n]

    def batch_for_step(self, step: int) -> list[list[int]]:
        """The global batch of optimizer step ``step`` (0-based): ``batch_size`` windows."""
        out = []
        for g in range(step * self.batch_size, (step + 1) * self.batch_size):
            k, i = self.order(g // self.pass_len)[g % self.pass_len].tolist()
            out.append(self.parts[k][i].tolist())
        return out
