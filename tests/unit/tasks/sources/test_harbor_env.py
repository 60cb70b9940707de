"""Which Harbor environments run here: plain python images become a workspace + pip
requirements; anything that needs a Docker build is skipped with the line that needs it."""

from __future__ import annotations

import pytest

from opencomposer.tasks.sources import ItemError, ItemSkipped
from opencomposer.tasks.sources.harbor import (
    build_workspace,
    plan_environment,
    read_dockerfile,
)


def env_dir(tmp_path, dockerfile: str, files: dict[str, str] | None = None):
    d = tmp_path / "environment"
    d.mkdir()
    (d / "Dockerfile").write_text(dockerfile)
    for rel, text in (files or {}).items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


def test_plain_python_image_is_planned(tmp_path):
    d = env_dir(tmp_path, "# a comment\nFROM python:3.11-slim\nCOPY reqs.txt /tmp/reqs.txt\n"
                "RUN pip install --no-cache-dir -r /tmp/reqs.txt \\\n    pytest==8.3.0\nWORKDIR /app\n"
                "COPY src/ /app/\nCOPY data.txt data/\nENV PYTHONPATH=/app\n",
                {"reqs.txt": "attrs==24.2.0  # pinned\n", "src/m.py": "X = 1\n", "data.txt": "d\n"})
    assert read_dockerfile(d / "Dockerfile")[2] == (4, "RUN", "pip install --no-cache-dir -r /tmp/reqs.txt pytest==8.3.0")
    workdir, copies, reqs, envs = plan_environment(d)
    assert workdir == "/app" and reqs == ["attrs==24.2.0", "pytest==8.3.0"] and envs == {"PYTHONPATH": "/app"}
    assert copies == {"src/": "/app/", "data.txt": "/app/data/"}  # reqs.txt went to pip, not the workspace
    build_workspace(d, workdir, copies, tmp_path / "ws")
    assert (tmp_path / "ws/m.py").read_text() == "X = 1\n" and (tmp_path / "ws/data/data.txt").is_file()


@pytest.mark.parametrize("dockerfile, line, what", [
    ("FROM ubuntu:24.04\nRUN true\n", 1, "FROM ubuntu:24.04"),
    ("FROM python:3.12\nRUN apt-get update && apt-get install -y jq\n", 2, "RUN apt-get update"),
    ("FROM python:3.12\nRUN pip install x && rm -rf /root\n", 2, "RUN pip install x &&"),
    ("FROM python:3.12\nVOLUME /data\n", 2, "VOLUME /data"),
])
def test_docker_only_lines_skip_with_reason(tmp_path, dockerfile, line, what):
    d = env_dir(tmp_path, dockerfile)
    with pytest.raises(ItemSkipped, match=rf"Dockerfile:{line}: `{what}.*needs a Docker build, which this machine lacks"):
        plan_environment(d)


def test_compose_and_missing_dockerfile(tmp_path):
    d = env_dir(tmp_path, "FROM python:3.12\n", {"docker-compose.yaml": "services: {}\n"})
    with pytest.raises(ItemSkipped, match="docker-compose.yaml: a multi-container environment needs Docker"):
        plan_environment(d)
    (d / "docker-compose.yaml").unlink()
    (d / "Dockerfile").unlink()
    with pytest.raises(ItemError, match="environment/Dockerfile: missing"):
        plan_environment(d)


def test_copy_outside_workdir_is_skipped(tmp_path):
    d = env_dir(tmp_path, "FROM python:3.12\nWORKDIR /app\nCOPY cfg.ini /etc/cfg.ini\n", {"cfg.ini": "x\n"})
    with pytest.raises(ItemSkipped, match="COPY cfg.ini /etc/cfg.ini: files outside the workdir /app"):
        build_workspace(d, *plan_environment(d)[:2], tmp_path / "ws")
