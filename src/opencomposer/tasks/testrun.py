"""Run a library's pytest suite inside a sandbox and read per-test outcomes.

The command is ``python -m pytest`` with our fixed options (``PYTEST_ARGS``): no cache
provider (so no ``.pytest_cache`` is left to leak), the project's ``addopts`` cleared
(coverage or benchmark flags need plugins we may not have), and ``-rA`` so that the
short summary lists every test's node id with its outcome. ``parse_outcomes`` reads
that summary.

Test: ``pytest tests/unit/tasks/test_testrun.py``.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from opencomposer.protocols import Sandbox

PYTEST_ARGS = ["-p", "no:cacheprovider", "-o", "addopts=", "-rA", "--tb=no", "-q",
               "--color=no", "-W", "ignore::DeprecationWarning"]
DEFAULT_COMMAND = "python -m pytest " + " ".join(shlex.quote(a) for a in PYTEST_ARGS)

_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) \S")


@dataclass
class TestReport:
    __test__ = False
    outcomes: dict[str, str] = field(default_factory=dict)  # node id -> PASSED/FAILED/ERROR/...
    exit_code: int = 0
    timed_out: bool = False
    output_tail: str = ""
    seconds: float = 0.0

    def passed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o in ("PASSED", "XFAIL")}

    def status(self, node_id: str) -> str:
        return self.outcomes.get(node_id, "MISSING")


def parse_outcomes(output: str) -> dict[str, str]:
    """Node id -> outcome from pytest's ``-rA`` short test summary."""
    out: dict[str, str] = {}
    for line in output.splitlines():
        m = _LINE.match(line.rstrip())
        if not m:
            continue
        kind, rest = m.group(1), line.rstrip()[len(m.group(1)) + 1:]
        # FAILED/ERROR lines end in " - reason"; an ERROR for a whole module has no "::"
        node = rest if kind in ("PASSED", "XPASS") else rest.split(" - ", 1)[0]
        out.setdefault(node.strip(), kind)
    return out


def run_tests(sandbox: Sandbox, targets: list[str], command: str = DEFAULT_COMMAND,
              timeout: float = 300.0) -> TestReport:
    """Run ``command`` + ``targets`` (files or node ids) in the sandbox's workspace."""
    cmd = command + " " + " ".join(shlex.quote(t) for t in targets)
    r = sandbox.exec(["sh", "-c", cmd], timeout=timeout, max_output=4_000_000)
    return TestReport(parse_outcomes(r.output), r.exit_code, r.timed_out, r.output[-4000:], r.seconds)
