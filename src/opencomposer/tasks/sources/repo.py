"""Source trees from a local directory or a git repository at a commit.

    dir:PATH                 the directory as it is (copied; VCS data and caches dropped)
    git:PATH_OR_URL@COMMIT   the tree of COMMIT (any commit-ish), via ``git archive``;
                             a URL is cloned once into the cache first

``materialize(source)`` gives ``(name, version, root)``: a private copy of the tree that
the task maker may edit. ``export_commit`` is also how SWE-bench rows get their tree.

Test: ``pytest tests/unit/tasks/sources/test_repo.py``.
"""

from __future__ import annotations

import hashlib
import io
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from opencomposer.paths import cache_dir
from opencomposer.tasks.pypi import SourceError


def _git(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=timeout, check=False)


def resolve_commit(repo: Path, commit: str) -> str:
    """The full commit id of ``commit`` in ``repo``; SourceError if there is none."""
    r = _git("-C", str(repo), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if r.returncode:
        raise SourceError(f"{repo}: no commit {commit!r} in this git repository")
    return r.stdout.decode().strip()


def export_commit(repo: Path, commit: str, dest: Path) -> Path:
    """Write the tree of ``commit`` of the git repository ``repo`` to ``dest`` (must not exist)."""
    if not (Path(repo) / ".git").exists() and _git("-C", str(repo), "rev-parse", "--git-dir").returncode:
        raise SourceError(f"{repo}: not a git repository")
    full = resolve_commit(repo, commit)
    r = _git("-C", str(repo), "archive", "--format=tar", full)
    if r.returncode:
        raise SourceError(f"{repo}: git archive {full} failed: {r.stderr.decode().strip()}")
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as t:
        t.extractall(dest, filter="tar")
    return dest


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-").lower() or "source"


def materialize(source: str) -> tuple[str, str, Path]:
    """``dir:PATH`` or ``git:PATH_OR_URL@COMMIT`` -> (name, version, private tree copy)."""
    kind, _, spec = source.partition(":")
    if kind == "dir":
        src = Path(spec).expanduser()
        if not spec or not src.is_dir():
            raise SourceError(f"--source {source!r}: {src} is not a directory")
        name = _slug(src.resolve().name)
        digest = hashlib.sha1(str(src.resolve()).encode()).hexdigest()[:10]
        dest = cache_dir("sources") / f"dir-{name}-{digest}"
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        return name, "local", dest
    if kind == "git":
        where, sep, commit = spec.rpartition("@")
        if not sep or not where or not commit:
            raise SourceError(f"--source {source!r}: expected git:PATH_OR_URL@COMMIT")
        repo = Path(where).expanduser()
        if not repo.is_dir():  # a URL: clone once into the cache
            repo = cache_dir("clones") / _slug(where)
            if not (repo / ".git").exists():
                r = _git("clone", "--quiet", where, str(repo))
                if r.returncode:
                    raise SourceError(f"--source {source!r}: git clone failed: {r.stderr.decode().strip()}")
        full = resolve_commit(repo, commit)
        name = _slug(Path(where.rstrip("/")).name.removesuffix(".git"))
        dest = cache_dir("sources") / f"git-{name}-{full[:12]}"
        if not dest.exists():
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            export_commit(repo, full, tmp)
            tmp.rename(dest)
        return name, full[:12], dest
    raise SourceError(f"--source {source!r}: expected dir:PATH or git:PATH_OR_URL@COMMIT")
