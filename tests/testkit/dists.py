"""Real distributions written by hand for tests: a pure-Python wheel (installs offline: no build backend, no
index) and a library's sdist (what the task factory makes tasks from)."""

from __future__ import annotations

import tarfile
import textwrap
import zipfile
from pathlib import Path


def make_wheel(dest: Path, name: str = "tinydep", version: str = "0.1") -> Path:
    """A real pure-python wheel, written by hand (no build backend, no network)."""
    dest.mkdir(parents=True, exist_ok=True)
    whl = dest / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": "VALUE = 42\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(whl, "w") as z:
        for rel, text in files.items():
            z.writestr(rel, text)
        z.writestr(f"{info}/RECORD", "".join(f"{rel},,\n" for rel in files) + f"{info}/RECORD,,\n")
    return whl


def make_sdist(tmp: Path, name: str, files: dict[str, str]) -> Path:
    """``tmp/NAME-0.1.tar.gz`` holding PKG-INFO and ``files`` (root-relative path -> text, dedented)."""
    root = tmp / "src" / f"{name}-0.1"
    for rel, text in {"PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    archive = tmp / f"{name}-0.1.tar.gz"
    with tarfile.open(archive, "w:gz") as t:
        t.add(root, arcname=root.name)
    return archive
