"""Per-source Python environments: one venv per library release, shared read-only by its tasks.

``build_env(layout, name, dest)`` creates a virtualenv with the library's runtime and
test requirements (never the library itself: the original package must be importable
only from a task's workspace), checks that claim, and writes ``env.json`` describing
what was installed. Built in a temporary directory and renamed into place, so a
killed build leaves nothing half-made (its temp dir is removed by the next build beside
it); an existing complete env is reused.

The environments root (``OUT/_envs``, ``format.envs_root``) is the only place outside a task
dir that its ``environment.env`` may point to. ``adopt_env(out, env)`` links an env made
elsewhere (``--env``, this interpreter's) into it, so tasks can name it.

Test: ``pytest tests/integration/test_tasks_pipeline.py`` (builds a real env) and
``tests/unit/tasks/sources/test_confine.py`` (adopt_env).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from opencomposer.paths import remove_stale_temps, replace_dir, temp_dir, temp_name
from opencomposer.tasks.format import ENVS
from opencomposer.tasks.layout import ProjectLayout


class EnvError(RuntimeError):
    """The environment for a source could not be built; the message carries pip's reason."""


# what would make a new env's pip or Python see packages outside the env: this process's own path
# (a PYTHONPATH of carried packages on the GPU machine made pip take pytest as installed and leave
# it out of the env), the user site
OUTSIDE_PATHS = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE")


def env_alone() -> dict[str, str]:
    """This process's environment without ``OUTSIDE_PATHS`` and with the user site off; pip's own
    settings (index, find-links) are left as the user set them."""
    return {**{k: v for k, v in os.environ.items() if k not in OUTSIDE_PATHS}, "PYTHONNOUSERSITE": "1"}


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env_alone())


# Installer tools vendor copies of popular libraries (setuptools ships more_itertools,
# pip ships many): left in the env they would hand the agent the deleted code.
TOOLS = ("pip", "setuptools", "wheel")


def strip_tools(env: Path, reqs: list[str]) -> list[str]:
    """Remove pip/setuptools/wheel from ``env`` unless the tests require them; returns what went."""
    wanted = {canonicalize_name(Requirement(r).name) for r in reqs}
    site = next((env / "lib").glob("python3*/site-packages"), None)
    removed = []
    if site is None:
        return removed
    for tool in TOOLS:
        if tool in wanted:
            continue
        hits = [p for p in site.iterdir()
                if p.name == tool or p.name == f"_{tool}" or p.name.startswith((f"{tool}-", f"{tool}."))
                or (tool == "setuptools" and p.name in ("pkg_resources", "_distutils_hack", "distutils-precedence.pth"))]
        for p in hits:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        for script in (env / "bin").glob(f"{tool}*"):
            script.unlink()
        if hits:
            removed.append(tool)
    return removed


def build_env(layout: ProjectLayout, dist_name: str, dest: Path, python: str = sys.executable,
              timeout: float = 900.0, keep_tools: bool = False) -> Path:
    """Create (or reuse) the env at ``dest``; returns ``dest``. ``keep_tools`` leaves pip in
    (for the install agent's working env, stripped before it is shared)."""
    if (dest / "env.json").exists():
        return dest
    own = canonicalize_name(dist_name)
    reqs = [r for r in layout.requirements if canonicalize_name(Requirement(r).name) != own]
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest.parent)
    tmp = temp_dir(dest)
    t0 = time.time()
    try:
        # venv paths are absolute; build at the final path's sibling, then rename and
        # only ever run ``python -m ...`` (console-script shebangs would point at tmp).
        r = _run([python, "-m", "venv", str(tmp)], 300)
        if r.returncode:
            raise EnvError(f"{dest}: venv creation failed: {r.stderr.strip()[-2000:]}")
        pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "--no-cache-dir", "-q",
               "--disable-pip-version-check"]
        r = _run(pip + reqs, timeout)
        if r.returncode:
            # Optional test plugins often fail to build; retry with the essentials only.
            essential = [x for x in reqs if "extra" not in x]
            r2 = _run(pip + ["pytest"] + [x for x in essential if not x.startswith("pytest")], timeout)
            if r2.returncode:
                raise EnvError(
                    f"{dest}: installing the test requirements {reqs} failed:\n{r.stderr.strip()[-3000:]}"
                )
        freeze = _run([str(tmp / "bin" / "python"), "-m", "pip", "freeze", "--all"], 120).stdout.split()
        stripped = [] if keep_tools else strip_tools(tmp, reqs)
        for pkg in layout.packages:
            probe = _run([str(tmp / "bin" / "python"), "-c", f"import {pkg}"], 120)
            if probe.returncode == 0:
                raise EnvError(
                    f"{dest}: the library's package {pkg!r} is importable from the environment itself "
                    "(a dependency pulled it in); tasks would leak the deleted code"
                )
        manifest = {"requirements": reqs, "installed": freeze, "stripped": stripped, "python": python,
                    "seconds": round(time.time() - t0, 1)}
        (tmp / "env.json").write_text(json.dumps(manifest, indent=1))
        replace_dir(tmp, dest)
        # the venv's own python symlinks stay valid; fix pyvenv.cfg-independent paths
        return dest
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def adopt_env(out: Path, env: Path) -> Path:
    """``env`` as a path inside ``OUT/_envs``: itself when it lies there already, else a link
    ``OUT/_envs/ext-<name>-<hash>`` to it (made atomically, reused when it exists)."""
    envs = Path(out) / ENVS
    real = Path(os.path.realpath(env))
    if not real.is_dir():
        raise EnvError(f"--env {env}: not a directory (expected a Python environment)")
    envs_real = os.path.realpath(envs)
    if str(real) == envs_real or str(real).startswith(envs_real.rstrip("/") + "/"):
        return envs / os.path.relpath(real, envs_real)
    link = envs / f"ext-{real.name[:40]}-{hashlib.sha1(str(real).encode()).hexdigest()[:8]}"
    if os.path.realpath(link) != str(real):
        envs.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(link)
        os.symlink(real, tmp)
        os.replace(tmp, link)
    return link
