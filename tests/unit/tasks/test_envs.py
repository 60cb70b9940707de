"""``envs.build_env`` makes the environment from what pip installs into it, whatever this process's own
path shows: on the GPU machine the factory runs with PYTHONPATH holding carried packages, and a pip that saw them
there took them as installed and left them out of the env (whose tests then could not import them)."""

from __future__ import annotations

import json
import subprocess
import sys

from testkit.dists import make_wheel

from opencomposer.tasks.envs import build_env
from opencomposer.tasks.layout import ProjectLayout
from opencomposer.tasks.packenv import installed


def test_a_requirement_on_this_process_path_is_still_installed_into_the_env(tmp_path, monkeypatch):
    wheels = make_wheel(tmp_path / "wheelhouse").parent
    shadow = tmp_path / "shadow"  # the same distribution, visible through PYTHONPATH only
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", f"--find-links={wheels}",
                    "--target", str(shadow), "tinydep"], check=True)
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip's own settings still count: the wheel comes from here
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    root = tmp_path / "lib"
    root.mkdir()
    layout = ProjectLayout(root, ["lib"], ["lib"], ["."], [], ["tinydep"])
    env = build_env(layout, "lib", tmp_path / "_envs" / "lib-0.1")
    assert "tinydep==0.1" in installed(env)
    r = subprocess.run([str(env / "bin" / "python"), "-c", "import tinydep; print(tinydep.__file__)"],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and str(env) in r.stdout, r.stderr
    assert json.loads((env / "env.json").read_text())["requirements"] == ["tinydep"]
