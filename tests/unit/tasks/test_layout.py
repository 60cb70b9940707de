"""Project layout: packages, test files and test requirements of a source tree."""

from pathlib import Path

from opencomposer.tasks.layout import inspect_project


def test_src_layout_with_extras(tmp_path: Path):
    (tmp_path / "src" / "lib").mkdir(parents=True)
    (tmp_path / "src" / "lib" / "__init__.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_lib.py").write_text("")
    (tmp_path / "tests" / "helper.py").write_text("")
    (tmp_path / "PKG-INFO").write_text(
        "Metadata-Version: 2.1\nName: lib\nRequires-Dist: attrs>=20\n"
        "Requires-Dist: freezegun; extra == 'tests'\nRequires-Dist: sphinx; extra == 'docs'\n"
        "Requires-Dist: oldthing; python_version < '3.0'\n")
    lay = inspect_project(tmp_path)
    assert lay.packages == ["lib"] and lay.pythonpath == ["src"] and lay.package_dirs == ["src/lib"]
    assert lay.test_files == ["tests/test_lib.py"]
    assert lay.requirements == ["attrs>=20", "freezegun", "pytest"]


def test_flat_layout_and_dependency_groups(tmp_path: Path):
    (tmp_path / "mod.py").write_text("")
    (tmp_path / "setup.py").write_text("")
    (tmp_path / "test_mod.py").write_text("")
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname="mod"\ndependencies=["six"]\n[dependency-groups]\ntest=["pytest>=8", {include-group="x"}]\n')
    lay = inspect_project(tmp_path)
    assert lay.packages == ["mod"] and lay.pythonpath == ["."] and lay.test_files == ["test_mod.py"]
    assert lay.requirements == ["six", "pytest>=8"]
