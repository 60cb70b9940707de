"""The parts of a pack file: each part a fixed header then a slice of the payload, written
atomically and read back checked (``pack.py`` makes and reads the payload, a zstd tar).

    w = PartsWriter(Path("t.ocpack"), 60 << 20, pack_id); w.write(b); w.finish()   # t.ocpack.part-000, ...
    with PartsReader(find_parts(Path("t.ocpack"))) as r: r.read()                  # every part checked first

Every part starts with ``HEADER`` bytes: ``MAGIC`` and a JSON line naming the pack, the part's
number, whether it is the last, and its payload's size and sha256, so a missing, reordered,
foreign or damaged part is named before anything is read. ``benchmarks/carry_parts.py`` cuts
directories into parts the same way.

Test: ``pytest tests/unit/tasks/test_pack.py -k part``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path

import opencomposer
from opencomposer.config import ConfigError
from opencomposer.paths import temp_name
from opencomposer.tasks.format import TaskFormatError

PACK_FORMAT_VERSION = 1
MAGIC = b"OCPACK\n"
HEADER = 1024  # bytes before each part's payload: MAGIC, a JSON line, space padding
CHUNK = 1 << 20


class PackError(TaskFormatError):
    """A pack that cannot be made or used; the message names the file or part and what was expected."""


def parse_size(text: str) -> int:
    """``60M`` -> bytes (K, M, G are powers of 1024; a plain number is bytes)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"--part-size {text!r}: expected a size such as 60M, 1G or 500000")
    n = int(m[1]) * 1024 ** " KMG".index((m[2] or " ").upper())
    if n <= HEADER:
        raise ConfigError(f"--part-size {text!r}: expected more than {HEADER} bytes (each part's header)")
    return n


def file_sha(path: Path, skip: int = 0) -> tuple[str, int]:
    """sha256 and size of ``path``'s bytes after the first ``skip``."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        f.seek(skip)
        while b := f.read(CHUNK):
            h.update(b)
            n += len(b)
    return h.hexdigest(), n


class PartsWriter(io.RawIOBase):
    """The pack's bytes into ``out`` (or ``out.part-000``, ``-001``... of at most ``part_size`` bytes),
    each part behind its header; written under temp names, renamed by ``finish``."""

    def __init__(self, out: Path, part_size: int | None, pack_id: str):
        self.out, self.part_size, self.pack_id = Path(out), part_size, pack_id
        self.tmps: list[Path] = []
        self.finals: list[Path] = []
        self.f = None

    def writable(self) -> bool:
        return True

    def _open(self) -> None:
        final = self.out if self.part_size is None else part_path(self.out, len(self.finals))
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(final)
        self.tmps.append(tmp)
        self.finals.append(final)
        self.f, self.h, self.n = open(tmp, "wb"), hashlib.sha256(), 0
        self.f.write(b"\0" * HEADER)

    def _close(self, last: bool) -> None:
        head = MAGIC + json.dumps({"pack": self.pack_id, "part": len(self.finals) - 1, "last": last,
                                   "size": self.n, "sha256": self.h.hexdigest(),
                                   "format_version": PACK_FORMAT_VERSION}).encode()
        self.f.seek(0)
        self.f.write(head.ljust(HEADER - 1) + b"\n")
        self.f.close()
        self.f = None

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        while len(mv):
            if self.f is None:
                self._open()
            elif self.part_size is not None and self.n >= self.part_size - HEADER:
                self._close(last=False)
                self._open()
            room = len(mv) if self.part_size is None else self.part_size - HEADER - self.n
            chunk = mv[:room]
            self.f.write(chunk)
            self.h.update(chunk)
            self.n += len(chunk)
            mv = mv[room:]
        return len(b)

    def finish(self) -> list[Path]:
        if self.f is None:
            self._open()
        self._close(last=True)
        for tmp, final in zip(self.tmps, self.finals):
            os.replace(tmp, final)
        i = len(self.finals)  # parts of an earlier, longer pack at this name would read as missing ones
        while self.part_size is not None and part_path(self.out, i).is_file():
            part_path(self.out, i).unlink()
            i += 1
        return list(self.finals)

    def abort(self) -> None:
        if self.f is not None:
            self.f.close()
        for tmp in self.tmps:
            tmp.unlink(missing_ok=True)


def part_path(out: Path, i: int) -> Path:
    return Path(out).with_name(f"{Path(out).name}.part-{i:03d}")


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        raw = f.read(HEADER)
    try:
        if not raw.startswith(MAGIC) or len(raw) < HEADER:
            raise ValueError
        head = json.loads(raw[len(MAGIC):].decode())
        head["size"], head["part"], head["sha256"], head["pack"]
    except (ValueError, KeyError, TypeError):
        raise PackError(f"{path}: not an opencomposer pack part (expected the {MAGIC!r} header of "
                        "`opencomposer tasks pack`)") from None
    if head.get("format_version") != PACK_FORMAT_VERSION:
        raise PackError(f"{path}: pack format version {head.get('format_version')}; this opencomposer "
                        f"({opencomposer.__version__}) reads version {PACK_FORMAT_VERSION}")
    return head


def find_parts(given: Path) -> list[Path]:
    """The parts of the pack named by ``given`` (the file, its base name or any of its parts),
    each checked: header, number, pack, payload size and sha256; in order."""
    given = Path(given)
    m = re.fullmatch(r"(.+)\.part-(\d{3,})", given.name)
    if m is None and given.is_file():
        head = _header(given)
        if head["part"] != 0 or not head["last"]:
            raise PackError(f"{given}: part {head['part']} of a split pack; expected the whole pack, its "
                            f"base name or its .part-000")
        _check_payload(given, head)
        return [given]
    base = given.with_name(m[1]) if m else given
    if not part_path(base, 0).is_file():
        raise PackError(f"{given}: no such pack (expected the file {base} or its parts {part_path(base, 0).name}, ...)")
    parts: list[Path] = []
    pack = None
    while True:
        p = part_path(base, len(parts))
        if not p.is_file():
            raise PackError(f"{p}: missing; part {len(parts) - 1:03d} of pack {pack} says more parts follow "
                            f"(expected {p.name})")
        head = _header(p)
        pack = pack or head["pack"]
        if head["pack"] != pack or head["part"] != len(parts):
            raise PackError(f"{p}: holds part {head['part']} of pack {head['pack']}; expected part "
                            f"{len(parts)} of pack {pack}")
        _check_payload(p, head)
        parts.append(p)
        if head["last"]:
            return parts


def _check_payload(path: Path, head: dict) -> None:
    sha, n = file_sha(path, skip=HEADER)
    if n != head["size"] or sha != head["sha256"]:
        raise PackError(f"{path}: damaged: {n} bytes with sha256 {sha[:16]}..., expected "
                        f"{head['size']} bytes with sha256 {head['sha256'][:16]}... (copy the part again)")


class PartsReader(io.RawIOBase):
    """The payloads of ``parts``, one after another."""

    def __init__(self, parts: list[Path]):
        self.parts, self.f = list(parts), None

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while True:
            if self.f is None:
                if not self.parts:
                    return 0
                self.f = open(self.parts.pop(0), "rb")
                self.f.seek(HEADER)
            n = self.f.readinto(buf)
            if n:
                return n
            self.f.close()
            self.f = None

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
        super().close()
