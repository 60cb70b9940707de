"""Fetch a library's source distribution from PyPI (or a local sdist file) and unpack it.

``fetch_sdist("more-itertools==10.5.0")`` resolves the release through PyPI's JSON API,
downloads the ``.tar.gz``/``.zip`` sdist into the cache (sha256-checked, written
atomically) and returns its path; ``unpack_sdist`` extracts it safely (no absolute
paths, no ``..``, no links out) and returns the project root.

The index is ``$OPENCOMPOSER_PYPI_URL`` (default https://pypi.org/pypi); relative file
URLs, as some mirrors return, are resolved against the JSON URL.

Test: ``pytest tests/unit/tasks/test_pypi.py`` (uses a local sdist; ``-m slow`` hits PyPI).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from opencomposer.paths import cache_dir, remove_stale_temps, temp_dir, temp_name


class SourceError(ValueError):
    """A source that cannot be turned into tasks; the message says which and why."""


@dataclass
class SdistRef:
    name: str
    version: str
    path: Path


_SPEC = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([A-Za-z0-9._+!-]+))?\s*$")


def parse_spec(spec: str) -> tuple[str, str | None]:
    """'NAME==VERSION' or 'NAME' -> (name, version or None)."""
    m = _SPEC.match(spec)
    if not m:
        raise SourceError(f"pypi source {spec!r}: expected NAME or NAME==VERSION, e.g. 'toolz==1.0.0'")
    return m.group(1), m.group(2)


def _index() -> str:
    return os.environ.get("OPENCOMPOSER_PYPI_URL", "https://pypi.org/pypi").rstrip("/")


def _get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise SourceError(f"{url}: not found on the package index (check the name and version)") from None
        raise SourceError(f"{url}: package index answered HTTP {e.code}") from None
    except (urllib.error.URLError, TimeoutError) as e:
        raise SourceError(f"{url}: package index unreachable: {e}") from None


def fetch_sdist(spec: str) -> SdistRef:
    """Download (or reuse from cache) the sdist of ``spec``; a local file path is used as is."""
    if spec.endswith((".tar.gz", ".zip")) and Path(spec).is_file():
        stem = Path(spec).name.removesuffix(".tar.gz").removesuffix(".zip")
        name, _, version = stem.rpartition("-")
        return SdistRef(name or stem, version or "0", Path(spec).resolve())
    name, version = parse_spec(spec)
    url = f"{_index()}/{name}/json"
    meta = _get_json(url)
    files = meta.get("urls", [])
    if version and version != meta["info"]["version"]:
        # the project JSON lists every release; some mirrors serve no per-version JSON
        releases = meta.get("releases", {})
        if version not in releases:
            known = ", ".join(list(releases)[-8:])
            raise SourceError(f"pypi:{name}=={version}: no such release (recent: {known})")
        files = releases[version]
    version = version or meta["info"]["version"]
    sdists = [u for u in files if u.get("packagetype") == "sdist"]
    if not sdists:
        raise SourceError(f"pypi:{name}=={version}: the release has no source distribution (only wheels)")
    info = sdists[0]
    dest = cache_dir("sdists") / info["filename"]
    if not dest.exists():
        file_url = urllib.parse.urljoin(url, info["url"])
        remove_stale_temps(dest.parent)  # partial downloads of writers that died
        tmp = temp_name(dest)  # this process's own: two fetching the same sdist never share a partial file
        try:
            with urllib.request.urlopen(file_url, timeout=300) as r, open(tmp, "wb") as f:
                shutil.copyfileobj(r, f)
        except (urllib.error.URLError, TimeoutError) as e:
            tmp.unlink(missing_ok=True)
            raise SourceError(f"{file_url}: download failed: {e}") from None
        want = info.get("digests", {}).get("sha256")
        got = hashlib.sha256(tmp.read_bytes()).hexdigest()
        if want and got != want:
            tmp.unlink()
            raise SourceError(f"{file_url}: sha256 mismatch (expected {want}, got {got})")
        tmp.replace(dest)
    return SdistRef(meta["info"]["name"], version, dest)


def unpack_sdist(archive: Path, dest: Path) -> Path:
    """Extract ``archive`` under ``dest`` (replaced if present) and return the project root."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest.parent)
    tmp = temp_dir(dest)
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as z:
                for n in z.namelist():
                    if n.startswith("/") or ".." in Path(n).parts:
                        raise SourceError(f"{archive}: unsafe member path {n!r}")
                z.extractall(tmp)
        else:
            try:
                with tarfile.open(archive) as t:
                    t.extractall(tmp, filter="data")
            except (tarfile.TarError, OSError) as e:
                raise SourceError(f"{archive}: not a readable sdist: {e}") from None
        entries = [p for p in tmp.iterdir()]
        root = entries[0] if len(entries) == 1 and entries[0].is_dir() else tmp
        root.rename(dest) if root != tmp else tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
