"""`opencomposer <verb>`: parse arguments, build configs, call the component. No logic here.

    opencomposer tasks make --source pypi:toolz==1.2.0 --out tasks/ --max 20
    opencomposer tasks check tasks/ --sandbox namespace
    opencomposer tasks list tasks/
    opencomposer agent --task tasks/<id> --policy oracle --sandbox namespace
    opencomposer eval --suite smoke --model smollm2-135m --k 4; eval compare A B; eval report A B --out DIR

Commands that check or measure print their result as one JSON line, last. Known
failures (bad config, bad task, bad source) exit with code 2 and a one-line reason.

One module per verb group (``tasks``, ``run``: agent/train/sft/serve, ``realtime``, ``bench``,
``eval``); ``common`` holds the root app and the helpers they share.

Test: ``pytest tests/integration/test_cli_errors.py``.
"""

from __future__ import annotations

import os
import signal
import sys

from opencomposer.cli import run  # noqa: F401  (registers agent/train/sft/serve on the root app)
from opencomposer.cli.bench import bench_app
from opencomposer.cli.common import app
from opencomposer.cli.eval import eval_app
from opencomposer.cli.realtime import realtime_app
from opencomposer.cli.tasks import tasks_app

app.add_typer(tasks_app, name="tasks")
app.add_typer(bench_app, name="bench")
app.add_typer(realtime_app, name="realtime")
app.add_typer(eval_app, name="eval")


def _on_sigterm(signum: int, frame) -> None:
    """SIGTERM (``kill``, a scheduler's stop): this process's sandboxes go first, with every command
    running in them (``cleanup.reap_own``), then the process ends at once, as after SIGKILL: runs
    resume from their last atomic write (checkpoints, journals, results)."""
    from opencomposer.sandbox import cleanup

    try:
        gone = cleanup.reap_own()
        sys.stderr.write(f"opencomposer: SIGTERM: {gone['sandboxes']} sandbox(es) and {gone['processes']} "
                         "process(es) in them stopped\n")
    finally:
        sys.stderr.flush()
        os._exit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)  # `serve` replaces it with uvicorn's graceful shutdown
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)

