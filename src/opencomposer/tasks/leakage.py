"""Leakage: make sure no copy of the deleted code survives where the agent can look.

The agent reads the workspace (and the shared environment), so the original must not hide
there: in git history, bytecode, caches, build trees or archives. Three steps:

- ``scrub_workspace(ws)`` removes every such channel; ``fresh_git(ws)`` then makes a clean
  single-commit repo (fixed author and date: the same files give the same commit).
- ``distinctive_lines(removed)`` picks the deleted lines worth searching for, and
  ``gold_windows(patch)`` each run of deleted lines with the unchanged lines around it (a
  one-line deletion has no distinctive line, but a copy of the original holds it in its place).
- ``probe(roots, lines, windows)`` searches plain files, ``.pyc`` bytecode, archives
  (.whl/.zip/.tar.*) and git objects for them, and reports what it checked and every hit.

Bytecode holds no source text, so for ``.pyc`` files of this interpreter's version each line
is compiled on its own and its names and constants, in order, are looked for among the
instructions of each source line of the ``.pyc`` (the bytecode fingerprint).

Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_leakage.py``.
"""

from __future__ import annotations

import ast
import dis
import importlib.util
import io
import marshal
import os
import re
import shutil
import subprocess
import tarfile
import textwrap
import zipfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType

from opencomposer import pyparse
from opencomposer.tasks.format import Task

CACHE_DIRS = frozenset(
    ".git .hg .svn __pycache__ .pytest_cache .mypy_cache .ruff_cache .tox .nox .eggs "
    ".hypothesis htmlcov".split()
)
TOP_DIRS = frozenset({"build", "dist"})  # only at the top: a package may have a `build` module
JUNK_SUFFIXES = (".pyc", ".pyo", ".orig", ".rej")
ARCHIVES = (".whl", ".zip", ".egg", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
MAX_BYTES = 64 << 20  # bigger files are counted, not read: no source file is this big
# Machine code, weights, images, fonts: no source text in them, and most of an env's bytes.
BINARY_SUFFIXES = tuple(
    ".so .dylib .dll .pyd .a .o .lib .exe .bin .safetensors .pt .ckpt .npy .npz .png .jpg "
    ".jpeg .gif .ico .woff .woff2 .ttf .otf .pdf .mo".split()
)
TRIVIAL = re.compile(
    r"(return|yield|raise|pass|break|continue)( [\w.]+)?|(else|try|finally|while True)\s*:")
SOURCE_SUFFIXES = (".py", ".pyi", ".pyx", ".pxd")
GIT_ENV = {
    "GIT_AUTHOR_NAME": "opencomposer", "GIT_AUTHOR_EMAIL": "tasks@opencomposer.invalid",
    "GIT_COMMITTER_NAME": "opencomposer", "GIT_COMMITTER_EMAIL": "tasks@opencomposer.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
}


@dataclass(frozen=True)
class Hit:
    path: str  # a file; "archive!member" inside archives; "<repo>/.git@<sha>" for git objects
    line: int | None  # 1-based line in that file (for .pyc: the line in the compiled source)
    kind: str  # source | compiled | archive | git
    text: str  # the distinctive line found


@dataclass
class ProbeResult:
    checked: Counter = field(default_factory=Counter)  # channel -> files or objects searched
    hits: list[Hit] = field(default_factory=list)

    n_lines: int = 0  # distinctive lines searched for
    window_hits: list[Hit] = field(default_factory=list)  # a deletion found with its context: a copy

    @property
    def clean(self) -> bool:
        return not self.hits

    def suspects(self, min_lines: int = 2) -> dict[str, set[str]]:
        """Places holding several distinct deleted lines: copies, not a common idiom that
        happens to recur (``for line in text.split("\\n"):`` is in many packages)."""
        found: dict[str, set[str]] = {}
        for h in self.hits:
            found.setdefault(h.path, set()).add(h.text)
        need = min(min_lines, self.n_lines) or 1
        return {p: t for p, t in found.items() if len(t) >= need}

    def summary(self) -> str:
        seen = ", ".join(f"{n} {k}" for k, n in sorted(self.checked.items()))
        head = f"{len(self.hits)} hits" if self.hits else "clean"
        return "\n".join([f"{head}; searched {seen}"] +
                         [f"  {h.kind}: {h.path}:{h.line}: {h.text}" for h in self.hits[:20]])


def distinctive_lines(
    removed_text: str, min_len: int = 12, max_lines: int = 20,
    remaining: Path | Iterable[str] | None = None,
) -> list[str]:
    """Stripped lines of the deleted code worth searching for, in their original order.

    Skips short and trivial lines, docstring lines (body-level tasks keep the docstring) and
    lines found in ``remaining`` (a workspace dir whose text files are read, or source texts):
    those are in the workspace anyway, so finding them proves nothing. Code beats comments
    and longer beats shorter when more than ``max_lines`` qualify.
    """
    common = _stripped_lines(remaining)
    doc = _docstring_lines(removed_text)
    picked: dict[str, int] = {}
    for i, raw in enumerate(re.split(r"\r\n|\r|\n", removed_text), 1):
        s = raw.strip()
        if len(s) < min_len or i in doc or s in common or s in picked or TRIVIAL.fullmatch(s):
            continue
        if s == "raise NotImplementedError":
            continue  # the stub itself
        picked[s] = i
    best = sorted(picked, key=lambda s: (s.startswith("#"), -len(s)))[:max_lines]
    return sorted(best, key=picked.__getitem__)


def scrub_workspace(ws: Path) -> list[str]:
    """Remove VCS data, caches, bytecode, build trees and patch leftovers; return what went."""
    ws, removed = Path(ws), []
    for dirpath, dirnames, filenames in os.walk(ws):
        here = Path(dirpath)
        for name in list(dirnames):
            top = here == ws and name in TOP_DIRS
            if name in CACHE_DIRS or name.endswith(".egg-info") or top:
                dirnames.remove(name)
                _remove(here / name)
                removed.append((here / name).relative_to(ws).as_posix() + "/")
        for name in filenames:
            if name.endswith(JUNK_SUFFIXES) or name.startswith(".coverage") or name == ".git":
                _remove(here / name)
                removed.append((here / name).relative_to(ws).as_posix())
    return sorted(removed)


def fresh_git(ws: Path) -> str:
    """``git init`` + one commit of everything (fixed author and date); returns the commit id."""
    ws = Path(ws)
    if (ws / ".git").exists():
        raise FileExistsError(f"{ws / '.git'}: exists; scrub_workspace(ws) first")
    env = {**os.environ, **GIT_ENV}

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(ws), *args], env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"git {' '.join(args)} in {ws} failed: {r.stderr.strip()}")
        return r.stdout.strip()

    git("init", "-q", "-b", "main", "--template=")
    git("add", "-A")
    git("commit", "-q", "--no-verify", "--no-gpg-sign", "--allow-empty", "-m", "Initial commit")
    return git("rev-parse", "HEAD")


def probe(root_paths: list[Path], lines: list[str], windows: list[tuple[str, ...]] = ()) -> ProbeResult:
    """Search every file under the roots (and git objects of repos there) for ``lines`` and for
    ``windows`` (sequences of stripped lines, found as consecutive lines at any indentation)."""
    result = _Searcher(lines, windows)
    for root in map(Path, root_paths):
        if root.is_file():
            result.blob(str(root), root.read_bytes())
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            if ".git" in dirnames or ".git" in filenames:
                result.git(Path(dirpath))
            dirnames[:] = [d for d in dirnames if d != ".git"]
            for name in filenames:
                p = Path(dirpath, name)
                if name == ".git" or p.is_symlink() or not p.is_file():
                    continue
                if name.lower().endswith(BINARY_SUFFIXES) or p.stat().st_size > MAX_BYTES:
                    result.out.checked["not_read"] += 1
                    continue
                result.blob(str(p), p.read_bytes())
    return result.out


class _Searcher:
    """One probe: the compiled patterns, and the result it fills in."""

    def __init__(self, lines: list[str], windows: list[tuple[str, ...]] = ()) -> None:
        self.windows = [(max(w, key=len).encode(), " / ".join(x for x in w if x),
                         re.compile(rb"(?m)^" + rb"\r?\n".join(rb"[ \t]*" + re.escape(x.encode()) + rb"[ \t]*"
                                                              for x in w) + rb"\r?$"))
                        for w in windows if any(w)]
        self.lines = [s.strip() for s in lines if s.strip()]
        self.out = ProbeResult(n_lines=len(self.lines))
        self.needles = [s.encode() for s in self.lines]
        alternatives = b"|".join(re.escape(n) for n in self.needles) or b"(?!)"
        # whole lines, any indentation, also as diff lines (+/-) in git objects
        self.pattern = re.compile(rb"(?m)^[ \t+\-]*(" + alternatives + rb")[ \t]*\r?$")
        self.prints = {s: fp for s in self.lines if (fp := _fingerprint(s))}

    def blob(self, name: str, data: bytes, kind: str = "source", depth: int = 0) -> None:
        lower = name.lower()
        if lower.endswith(ARCHIVES) and depth < 2:
            self.out.checked["archives"] += 1
            for member, content in _members(name, data, self.out.checked):
                self.blob(f"{name}!{member}", content, "archive", depth + 1)
            return
        if lower.endswith((".pyc", ".pyo")):
            self.out.checked["compiled"] += 1
            self._bytecode(name, data, kind if kind != "source" else "compiled")
        elif kind == "archive":
            self.out.checked["archive_members"] += 1
        else:
            self.out.checked["source" if lower.endswith(SOURCE_SUFFIXES) else "other_files"] += 1
        self.text(name, data, kind)

    def text(self, name: str, data: bytes, kind: str) -> None:
        for needle, said, pattern in self.windows:
            if needle in data and (m := pattern.search(data)):
                self.out.window_hits.append(Hit(name, data.count(b"\n", 0, m.start()) + 1, kind, said))
        if not any(n in data for n in self.needles):  # fast path: bytes.__contains__ is memmem
            return
        for m in self.pattern.finditer(data):
            line = data.count(b"\n", 0, m.start()) + 1
            self.out.hits.append(Hit(name, line, kind, m.group(1).decode(errors="replace")))

    def _bytecode(self, name: str, data: bytes, kind: str) -> None:
        if data[:4] != importlib.util.MAGIC_NUMBER:
            self.out.checked["compiled_other_python"] += 1  # only the raw text search applies
            return
        wanted = {s: fp for s, fp in self.prints.items()
                  if all(x.encode() in data for x in fp if isinstance(x, str))}
        # A compiled copy of the deleted code holds the names of all its lines; a file sharing
        # a few common names is not worth disassembling (dis is slow; envs hold 10k+ .pyc).
        if not wanted or 2 * len(wanted) < len(self.prints):
            return
        try:
            code = marshal.loads(data[16:])
        except (ValueError, EOFError, TypeError):
            self.out.checked["compiled_unreadable"] += 1
            return
        for co in _code_objects(code):
            for lineno, seq in _per_line(co).items():
                for s, fp in wanted.items():
                    if _contains(seq, fp):
                        self.out.hits.append(Hit(name, lineno, kind, s))

    def git(self, worktree: Path) -> None:
        """Every object in the repo's database, reachable or not (stashes, reflogs, dangling)."""
        cmd = ["git", "-c", "safe.directory=*", "-C", str(worktree), "cat-file",
               "--batch-all-objects", "--batch"]
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError:  # no git binary: say so rather than pass silently
            self.out.checked["git_unreadable"] += 1
            return
        assert proc.stdout is not None
        while header := proc.stdout.readline():
            sha, kind, size = header.decode().split()
            content = proc.stdout.read(int(size))
            proc.stdout.read(1)  # the newline after each object
            self.out.checked["git_objects"] += 1
            if kind in ("blob", "commit", "tag"):
                self.text(f"{worktree}/.git@{sha}", content, "git")
        if proc.wait() != 0:
            self.out.checked["git_unreadable"] += 1


def _members(name: str, data: bytes, checked: Counter) -> Iterator[tuple[str, bytes]]:
    try:
        if name.lower().endswith((".whl", ".zip", ".egg")):
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for info in z.infolist():
                    if not info.is_dir() and info.file_size <= MAX_BYTES:
                        yield info.filename, z.read(info)
        else:
            with tarfile.open(fileobj=io.BytesIO(data)) as t:
                for info in t:
                    if info.isfile() and info.size <= MAX_BYTES and (f := t.extractfile(info)):
                        yield info.name, f.read()
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError):
        checked["archives_unreadable"] += 1


def _fingerprint(line: str) -> tuple | None:
    """Names and constants the line compiles to, in order; None if it does not compile alone."""
    line = re.sub(r"^elif\b", "if", line)
    inner = "        pass\n" if line.endswith(":") else ""
    for head in ("def", "async def"):
        try:
            code = compile(f"{head} _probe():\n    {line}\n{inner}    pass\n", "<probe>", "exec")
        except SyntaxError:
            continue
        fn = next(c for c in code.co_consts if isinstance(c, CodeType))
        fp = tuple(_per_line(fn).get(2, ()))
        return fp if len(fp) >= 3 else None  # shorter prints match too much unrelated code
    return None


_ARG_OPS = frozenset(dis.hasname + dis.haslocal + dis.hasconst + dis.hasfree)


def _per_line(co: CodeType) -> dict[int, tuple]:
    out: dict[int, list] = {}
    for ins in dis.get_instructions(co):
        if ins.opcode in _ARG_OPS and ins.positions and ins.positions.lineno:
            v = ins.argval
            norm = v if isinstance(v, str) else (
                ("code", v.co_name) if isinstance(v, CodeType) else ("const", repr(v)))
            out.setdefault(ins.positions.lineno, []).append(norm)
    return {k: tuple(v) for k, v in out.items()}


def _code_objects(co: CodeType) -> Iterator[CodeType]:
    yield co
    for c in co.co_consts:
        if isinstance(c, CodeType):
            yield from _code_objects(c)


def _contains(seq: tuple, sub: tuple) -> bool:
    n = len(sub)
    return any(seq[i : i + n] == sub for i in range(len(seq) - n + 1))


def _stripped_lines(remaining: Path | Iterable[str] | None) -> set[str]:
    if remaining is None:
        return set()
    if isinstance(remaining, Path):
        # every text file, not just .py: the probe searches them all, so a deleted line that
        # a script or doc of the workspace also holds is no evidence of a leak
        texts = (_text_or_empty(p) for p in remaining.rglob("*") if ".git" not in p.parts and p.is_file())
    else:
        texts = iter(remaining)
    return {s.strip() for t in texts for s in t.splitlines()}


def _text_or_empty(path: Path, limit: int = 4 << 20) -> str:
    """A file's text; "" for binaries (a NUL in the first 8 KiB) and files over ``limit`` bytes."""
    try:
        if path.stat().st_size > limit:
            return ""
        data = path.read_bytes()
    except OSError:
        return ""
    return "" if b"\0" in data[:8192] else data.decode("utf-8", "replace")


def _docstring_lines(text: str) -> set[int]:
    """Line numbers (1-based, in ``text``) of docstrings in a definition or a bare body."""
    for wrapper in ("", "def _():\n"):
        try:
            tree = pyparse.parse(wrapper + text if wrapper else textwrap.dedent(text))
        except SyntaxError:
            continue
        top = tree.body[0] if wrapper else None  # the wrapper's own body is code, not a docstring
        out: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    node is not top and isinstance(doc := node.body[0], ast.Expr) and \
                    isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                shift = wrapper.count("\n")
                out.update(range(doc.lineno - shift, doc.end_lineno - shift + 1))
        return out
    return set()


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


# --------------------------------------------------------------------------- a task's leak scan


def gold_added_lines(patch: str) -> str:
    """The text the gold patch adds back: the deleted code."""
    return "\n".join(l[1:] for l in patch.splitlines() if l.startswith("+") and not l.startswith("+++"))


def gold_windows(patch: str, context: int = 2) -> list[tuple[str, ...]]:
    """Each run of lines the gold patch adds, with up to ``context`` unchanged lines before and
    after it, stripped, in the original file's order (lines the patch removes are not in the
    original, so they are skipped). A file holding one of these sequences holds the deleted code
    where it belongs: a copy, however short the deletion (``return best``)."""
    out: list[tuple[str, ...]] = []
    hunk: list[tuple[str, str]] = []  # (" " | "+", stripped text) of one hunk, "-" lines dropped

    def flush() -> None:
        i = 0
        while i < len(hunk):
            if hunk[i][0] != "+":
                i += 1
                continue
            j = i
            while j < len(hunk) and hunk[j][0] == "+":
                j += 1
            before = [t for _, t in hunk[max(0, i - context):i]]
            after = [t for k, t in hunk[j:j + context] if k == " "]
            out.append((*before, *(t for _, t in hunk[i:j]), *after))
            i = j
        hunk.clear()

    for line in patch.splitlines():
        if line.startswith("@@"):
            flush()
        elif line.startswith(("+++", "---")):
            continue
        elif line[:1] in (" ", "+"):
            hunk.append((line[:1], line[1:].strip()))
        elif line == "":
            hunk.append((" ", ""))  # an empty context line some tools write without its space
    flush()
    return out


def _probe_roots(task: Task) -> list[Path]:
    """What a sandbox can read that may hold the library: the workspace and the env.

    The base interpreter's own site-packages is hidden inside namespace sandboxes
    (see ``sandbox/namespace.py``); the local backend isolates nothing by design.
    """
    return [task.workspace] + ([task.env_dir] if task.env_dir else [])


def leak_scan(task: Task) -> tuple[dict, dict]:
    """(channels checked with their file counts, suspects: where -> deleted lines found there).

    The factory runs this on every task before it is written (``tasks/emit.py``), and
    ``check_task`` again on the finished directory. In the workspace any deleted line is a
    leak (lines that remain elsewhere in it were dropped by ``distinctive_lines``). Outside it
    (the env, site-packages) a leak is a copy: a file holding >= 3 distinct deleted lines;
    one or two short lines there are shared idioms ("return self[key]"). Anywhere, a file
    holding a deleted run of lines between the lines that surround it (``gold_windows``) holds
    a copy, which is how a one-line deletion (no distinctive line at all) is caught.
    """
    lines = distinctive_lines(gold_added_lines(task.gold_patch), remaining=task.workspace)
    windows = gold_windows(task.gold_patch)
    roots = _probe_roots(task)
    inside = probe(roots[:1], lines, windows)
    outside = probe(roots[1:], lines, windows)
    suspects = {**inside.suspects(min_lines=1),
                **{p: t for p, t in outside.suspects(min_lines=3).items() if len(t) >= 3}}
    for h in inside.window_hits + outside.window_hits:
        suspects.setdefault(h.path, set()).add(h.text)
    return dict(inside.checked + outside.checked), suspects
