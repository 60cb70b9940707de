"""dir: and git:PATH@COMMIT sources: the tree of exactly that commit, errors that name the input."""

from __future__ import annotations

import pytest
from source_fixtures import git

from opencomposer.tasks.pypi import SourceError
from opencomposer.tasks.sources.repo import export_commit, materialize


def test_git_source_gives_the_tree_of_the_commit(minicalc_repo, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOMPOSER_CACHE", str(tmp_path / "cache"))
    repo, row = minicalc_repo
    name, version, root = materialize(f"git:{repo}@{row['base_commit'][:10]}")
    assert (name, version) == ("acme__minicalc", row["base_commit"][:12])
    assert "clamp" not in (root / "minicalc/ops.py").read_text()  # the base, not HEAD
    assert not (root / ".git").exists()
    _, head_version, head = materialize(f"git:{repo}@main")
    assert "def clamp" in (head / "minicalc/ops.py").read_text() and head_version != version


def test_dir_source_copies_without_vcs(minicalc_repo, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOMPOSER_CACHE", str(tmp_path / "cache"))
    repo, _ = minicalc_repo
    _, version, root = materialize(f"dir:{repo}")
    assert version == "local" and (root / "minicalc/ops.py").read_text() == (repo / "minicalc/ops.py").read_text()
    assert not (root / ".git").exists()


def test_bad_sources_name_the_problem(minicalc_repo, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOMPOSER_CACHE", str(tmp_path / "cache"))
    repo, _ = minicalc_repo
    with pytest.raises(SourceError, match="no commit 'deadbeef'"):
        materialize(f"git:{repo}@deadbeef")
    with pytest.raises(SourceError, match="expected git:PATH_OR_URL@COMMIT"):
        materialize(f"git:{repo}")
    with pytest.raises(SourceError, match="is not a directory"):
        materialize(f"dir:{tmp_path / 'nope'}")
    with pytest.raises(SourceError, match="not a git repository"):
        export_commit(tmp_path, "HEAD", tmp_path / "out")
    assert git(repo, "status", "--porcelain") == ""  # the clone is left as it was
