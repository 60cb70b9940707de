"""The task factory: many libraries -> validated tasks, with per-library yield and time.

    opencomposer tasks make --config configs/tasks/factory.toml [--max 20] [--out tasks/factory]

``FactoryConfig`` (the root of ``configs/tasks/*.toml``) lists the libraries and how many
tasks to make from each; an optional ``[install_agent]`` (model, base_url) lets an agent
install repositories the discovered recipe cannot (``tasks/install.py``): the caller builds its
policy, ``make_policy("openai", **cfg.install_agent.model_dump())``, and passes it in. Libraries are made one after another (each validates candidates in
``workers`` threads); one that will not install or whose tests cannot run is reported with
its reason and the run goes on. The summary (``FactoryReport.summary()``, also written to
``OUT/factory_summary.json``) gives per-library yield, time and install method, the install
success rate, flaky tests dropped, and tasks per minute.

Resumable: rerunning the same command after a kill skips what was tried (per library and per
candidate, from ``OUT/_journal``; ``make.py``) and reports totals over all sessions
(``seconds`` includes the earlier sessions' time).

For RL, ``TaskFactory`` keeps a ``LevelSchedule``: the trainer calls
``factory.harder(pass_rate)`` with its recent pass rate and then ``factory.make(n)`` for the
next batch, which is drawn at the (possibly) harder levels.

Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_factory.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import Field

from opencomposer.config import Backend, ConfigError, Strict
from opencomposer.paths import atomic_write_text
from opencomposer.protocols import Policy
from opencomposer.tasks.difficulty import LevelSchedule, mean_level
from opencomposer.tasks.envs import EnvError
from opencomposer.tasks.make import MakeReport, make_tasks
from opencomposer.tasks.sources import Check


class Library(Strict):
    spec: str = Field(..., description="PyPI NAME==VERSION (or a local sdist path)")
    max_tasks: int | None = Field(None, ge=1, description="overrides factory.max_per_library")


class FactorySettings(Strict):
    out: str = Field("tasks/factory", description="output directory for task directories")
    max_per_library: int = Field(20, ge=1)
    seed: int = 0
    backend: Backend = Field("auto", description="sandbox of the libraries' test runs (auto: namespace, else gvisor)")
    workers: int = Field(2, ge=1, description="candidates validated in parallel per library")
    test_timeout: float = Field(300.0, gt=0)
    max_candidates: int = Field(400, ge=1, description="deletions tried per library at most")


class InstallAgentSettings(Strict):
    """The install agent for repositories the discovered recipe cannot install: any
    OpenAI-compatible endpoint (the key comes from ``OPENAI_API_KEY``). Its fields are the
    options of ``policies.make_policy("openai", ...)``."""

    model: str = Field(..., min_length=1)
    base_url: str | None = None


class FactoryConfig(Strict):
    """Root config of ``opencomposer tasks make --config``."""

    factory: FactorySettings = FactorySettings()
    difficulty: LevelSchedule = LevelSchedule()
    install_agent: InstallAgentSettings | None = None
    libraries: list[Library] = Field(..., min_length=1)


@dataclass
class LibraryResult:
    spec: str
    made: int = 0
    tried: int = 0
    candidates: int = 0
    seconds: float = 0.0
    tasks_per_minute: float = 0.0
    install: str = ""  # recipe | repair | agent | cached; "failed"; "" if never reached
    flaky: int = 0
    baseline_passed: int = 0
    levels: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    resumed: int = 0  # jobs an earlier (killed or finished) run already tried
    runs: dict[str, int] = field(default_factory=dict)  # test runs: deletion, confirm
    error: str = ""


@dataclass
class FactoryReport:
    libraries: list[LibraryResult] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict:
        made = sum(r.made for r in self.libraries)
        tried = [r for r in self.libraries if r.install]  # sources that reached installation
        levels: dict[str, int] = {}
        for r in self.libraries:
            for lv, k in r.levels.items():
                levels[lv] = levels.get(lv, 0) + k
        return {
            "made": made, "libraries": len(self.libraries),
            "libraries_with_tasks": sum(r.made > 0 for r in self.libraries),
            "install_success_rate": round(sum(r.install != "failed" for r in tried) / max(len(tried), 1), 3),
            "failed": {r.spec: r.error for r in self.libraries if r.error},
            "flaky_tests_dropped": sum(r.flaky for r in self.libraries),
            "levels": levels, "mean_level": round(mean_level(levels), 2),
            # what exhausting every drawn candidate would give at each library's yield so far
            "projected_tasks": round(sum(r.candidates * r.made / r.tried for r in self.libraries if r.tried)),
            "seconds": round(self.seconds, 1),
            "tasks_per_minute": round(made / max(self.seconds, 1e-9) * 60, 2),
            "per_library": {r.spec: {k: v for k, v in asdict(r).items() if k != "spec"} for r in self.libraries},
        }


class TaskFactory:
    """Makes tasks from every configured library at the schedule's current levels."""

    def __init__(self, cfg: FactoryConfig, out: Path | None = None, policy: Policy | None = None,
                 check: Check | None = None):
        if policy is None and cfg.install_agent is not None:  # never drop a configured agent silently
            raise ConfigError("the factory config has [install_agent] but no policy was passed: build it with "
                              "make_policy(\"openai\", **cfg.install_agent.model_dump()) (opencomposer.policies) "
                              "and pass it as TaskFactory(cfg, out, policy)")
        self.cfg = cfg
        self.out = Path(out or cfg.factory.out)
        self.policy = policy  # the install agent, for repositories the recipe cannot install
        self.check = check  # grades each staged task (make.make_tasks): grading.check.check_task, bound
        self.schedule = cfg.difficulty.model_copy()
        self.rounds = 0

    def harder(self, pass_rate: float) -> dict[str, float]:
        """The trainer's hook: report the recent pass rate, get the level weights the next
        ``make`` will use (moved up when ``pass_rate >= raise_at``, down below ``lower_at``)."""
        self.schedule.update(pass_rate)
        return self.schedule.weights()

    def make(self, max_per_library: int | None = None,
             progress: Callable[[str, str, int, int], None] | None = None) -> FactoryReport:
        s = self.cfg.factory
        report = FactoryReport()
        weights = self.schedule.weights()
        for i, lib in enumerate(self.cfg.libraries):
            n = max_per_library or lib.max_tasks or s.max_per_library
            res = LibraryResult(lib.spec)
            t1 = time.time()
            try:
                rep: MakeReport = make_tasks(
                    f"pypi:{lib.spec}", self.out, n, s.seed + self.rounds, s.backend, weights,
                    s.test_timeout, s.workers, policy=self.policy, max_candidates=s.max_candidates, check=self.check,
                    progress=(lambda name, k, total, spec=lib.spec: progress(spec, name, k, total)) if progress else None)
                res.made, res.tried, res.rejected = len(rep.made), rep.tried, rep.rejected
                res.candidates = rep.candidates
                res.install, res.flaky, res.levels = rep.install, rep.flaky, rep.levels
                res.baseline_passed = rep.baseline_passed
                res.resumed, res.runs = rep.resumed, rep.runs
                earlier = rep.seconds.get("earlier_sessions", 0.0)
            except Exception as e:  # noqa: BLE001 - one bad library is reported, the run goes on
                res.error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:400]}"
                res.install = "failed" if isinstance(e, EnvError) else ""
                earlier = 0.0
            res.seconds = round(time.time() - t1 + earlier, 1)
            res.tasks_per_minute = round(res.made / max(res.seconds, 1e-9) * 60, 2)
            report.libraries.append(res)
            report.seconds = sum(r.seconds for r in report.libraries)  # earlier sessions included
            self.out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.out / "factory_summary.json", json.dumps(report.summary(), indent=1))
        self.rounds += 1
        return report
