"""Sdist fetching and unpacking: local files, bad specs, unsafe archives."""

import io
import tarfile
from pathlib import Path

import pytest

from opencomposer.tasks.pypi import SourceError, fetch_sdist, parse_spec, unpack_sdist


def test_parse_spec():
    assert parse_spec("toolz==1.2.0") == ("toolz", "1.2.0")
    assert parse_spec("more-itertools") == ("more-itertools", None)
    with pytest.raises(SourceError, match="expected NAME or NAME==VERSION"):
        parse_spec("toolz>=1; rm -rf /")


def test_local_sdist_unpacks(tmp_path: Path):
    root = tmp_path / "p-1.0"
    (root / "p").mkdir(parents=True)
    (root / "p" / "__init__.py").write_text("X = 1\n")
    arc = tmp_path / "p-1.0.tar.gz"
    with tarfile.open(arc, "w:gz") as t:
        t.add(root, arcname="p-1.0")
    ref = fetch_sdist(str(arc))
    assert (ref.name, ref.version) == ("p", "1.0")
    dest = unpack_sdist(ref.path, tmp_path / "out" / "p")
    assert (dest / "p" / "__init__.py").read_text() == "X = 1\n"


def test_unsafe_archive_is_refused(tmp_path: Path):
    arc = tmp_path / "evil-1.0.tar.gz"
    with tarfile.open(arc, "w:gz") as t:
        data = b"owned"
        info = tarfile.TarInfo("../../escape.txt")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    (tmp_path / "out").mkdir()
    with pytest.raises(SourceError, match="not a readable sdist"):
        unpack_sdist(arc, tmp_path / "out" / "evil")
    assert not (tmp_path / "escape.txt").exists()
