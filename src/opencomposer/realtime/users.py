"""Simulated users: people with tasks who drive the served agent and react to what it does.

    pop = UserPopulation(load_suite("smoke").tasks, n_users=6, seed=0)
    report = pop.run("http://127.0.0.1:8000/v1", model="tiny-random", sessions=12, backend="auto",
                     agent_cfg=AgentConfig(max_turns=3))

Each session: a user (persona: terse, vague or precise; patience) picks a task, writes a
prompt from its instruction in their style (terse users cut it to a few words, vague ones
name only the file or the symbol), and runs the deployed harness against the server
(``OpenAIPolicy`` with ``user = session id``, so every turn is logged under the session and
routed to one A/B arm; feedback names the session by the signed id that the server's chat
responses carry in ``X-Signed-Session-Id``, ``inference/server/auth.py``). When the episode ends
the user judges the result the way a developer would, by running the hidden tests:

* the agent changed files: ``edit_kept`` if the tests pass, else ``edit_reverted``, with
  the diff of the workspace;
* then maybe a follow-up: after a failure, a dissatisfied message with probability
  ``1 - patience`` (else a neutral one, e.g. a clarification); after a success, a neutral
  next request with probability 0.3.

So the feedback is a function of the agent's behaviour, with user noise on top. The
follow-up templates here are written separately from the classifier's training set
(``data/followups.jsonl``), so the classifier is not scored on its own examples.

Test: ``pytest tests/integration/test_realtime_cycle.py``.
"""

from __future__ import annotations

import random
import re
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import httpx

from opencomposer.config import AgentConfig
from opencomposer.inference.server.auth import SIGNED_HEADER
from opencomposer.realtime.deploy import ServerClient

DISSATISFIED = [
    "that did not fix it, {symbol} still fails",
    "no. the tests for {symbol} are still red",
    "you didn't actually implement {symbol}",
    "this is broken, please look at {file} again",
    "still not working",
    "why is {symbol} still wrong?",
    "that's not right at all, try again",
    "the change to {file} breaks things",
    "I ran the tests and they fail. again.",
    "not what I asked. {symbol} is still missing",
    "ugh, same failure as before",
    "this doesn't do anything useful",
]
NEUTRAL_AFTER_FAIL = [
    "let me clarify: {symbol} lives in {file}",
    "to be precise, I need {symbol} to work like the docstring says",
    "hint: the tests are in tests/",
    "can you run the tests first before changing {file}?",
]
NEUTRAL_AFTER_PASS = [
    "thanks, now please add a docstring to {symbol}",
    "great, can you also add a test for {symbol}",
    "good, next let's look at the rest of {file}",
    "nice. how would I call {symbol} from the command line?",
]


@dataclass
class Persona:
    style: str  # "terse" | "vague" | "precise"
    patience: float  # probability of a neutral (not dissatisfied) reply after a failure

    def prompt(self, task: Any, rng: random.Random) -> str:
        f = task.meta.feature
        symbol, file = str(f.symbol or "it"), str(f.file or "the code")
        if self.style == "terse":
            first = re.split(r"(?<=[.:;])\s", task.instruction.strip(), maxsplit=1)[0]
            words = first.split()
            return " ".join(words[: rng.randint(4, 8)]).rstrip(".:,;") or first
        if self.style == "vague":
            return rng.choice([f"{symbol} is broken", f"fix {file}", f"make the {symbol} tests pass",
                               f"something's missing in {file}, can you sort it out"])
        return task.instruction


@dataclass
class SessionOutcome:
    session_id: str
    task_id: str
    persona: str
    passed: bool
    changed_files: int
    events: list[str]
    turns: int
    seconds: float
    error: str = ""


class UserPopulation:
    def __init__(self, tasks: list[Any], n_users: int = 8, seed: int = 0):
        if not tasks:
            raise ValueError("UserPopulation needs at least one task")
        self.tasks, self.rng = tasks, random.Random(seed)
        styles = ["terse", "vague", "precise"]
        self.users = [Persona(styles[i % 3], round(self.rng.uniform(0.2, 0.8), 2)) for i in range(n_users)]

    def plan(self, sessions: int) -> list[tuple[Persona, Any, str, int]]:
        """(persona, task, session id, seed) per session, fixed by the population's seed."""
        return [(self.rng.choice(self.users), self.rng.choice(self.tasks), f"sim-{uuid.UUID(int=self.rng.getrandbits(128)).hex[:12]}",
                 self.rng.getrandbits(31)) for _ in range(sessions)]

    def run(self, base_url: str, model: str, sessions: int, backend: str = "auto",
            agent_cfg: AgentConfig | None = None, concurrency: int = 4, temperature: float = 0.7,
            max_tokens: int | None = None, token: str | None = None) -> dict[str, Any]:
        from opencomposer.sandbox import resolve_backend

        backend = resolve_backend(backend, "--backend local")  # the users' sessions run the served model's commands
        client = ServerClient(base_url, token)  # token: the server's --api-token, which feedback needs
        jobs = self.plan(sessions)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="user") as pool:
            outcomes = list(pool.map(lambda j: run_session(client, base_url, model, *j, backend=backend,
                                                           agent_cfg=agent_cfg or AgentConfig(),
                                                           temperature=temperature, max_tokens=max_tokens),
                                     jobs))
        events = [e for o in outcomes for e in o.events]
        return {"sessions": len(outcomes), "sandbox": backend, "passed": sum(o.passed for o in outcomes),
                "errors": sum(bool(o.error) for o in outcomes),
                "events": {k: events.count(k) for k in sorted(set(events))},
                "seconds": round(time.perf_counter() - t0, 2), "outcomes": [o.__dict__ for o in outcomes]}


def run_session(client: ServerClient, base_url: str, model: str, persona: Persona, task: Any, sid: str, seed: int,
                *, backend: str, agent_cfg: AgentConfig, temperature: float, max_tokens: int | None) -> SessionOutcome:
    from opencomposer.episode.run import run_task
    from opencomposer.policies import make_policy

    rng = random.Random(seed)
    prompt = persona.prompt(task, rng)
    signed: list[str] = []  # the session id as the server signed it: what its feedback must name

    def keep_signed(r: httpx.Response) -> None:
        if SIGNED_HEADER in r.headers:
            signed.append(r.headers[SIGNED_HEADER])

    def feedback(event: dict) -> bool:
        if signed:  # no completion served, no signed id: the server would refuse it
            client.feedback({"session_id": signed[-1], **event})
        return bool(signed)

    http = httpx.Client(event_hooks={"response": [keep_signed]})
    policy = make_policy("openai", model=model, base_url=base_url, temperature=temperature, max_tokens=max_tokens,
                         extra_body={"user": sid}, max_retries=1, http_client=http)
    diffs: list[str] = []
    t0 = time.perf_counter()
    try:
        res = run_task(replace(task, instruction=prompt), policy, backend, agent_cfg,
                       sandboxes=_diff_capturing(backend, diffs))
    except Exception as e:  # the user saw an error: they complain, and the session is logged as such
        sent = feedback({"kind": "follow_up", "text": rng.choice(DISSATISFIED).format(
            symbol=task.meta.feature.symbol, file=task.meta.feature.file)})
        return SessionOutcome(sid, task.id, persona.style, False, 0, ["follow_up"] if sent else [], 0,
                              time.perf_counter() - t0, f"{type(e).__name__}: {e}")
    finally:
        http.close()
    passed = bool(res.reward.passed)
    changed = len(res.trajectory.meta.get("changes", {}).get("files", []))
    events = []
    if changed:
        kind = "edit_kept" if passed else "edit_reverted"
        if feedback({"kind": kind, "diff": diffs[0] if diffs else ""}):
            events.append(kind)
    fmt = {"symbol": task.meta.feature.symbol, "file": task.meta.feature.file}
    text = None
    if not passed:
        pool = DISSATISFIED if rng.random() > persona.patience else NEUTRAL_AFTER_FAIL
        text = rng.choice(pool).format(**fmt)
    elif rng.random() < 0.3:
        text = rng.choice(NEUTRAL_AFTER_PASS).format(**fmt)
    if text and feedback({"kind": "follow_up", "text": text}):
        events.append("follow_up")
    return SessionOutcome(sid, task.id, persona.style, passed, changed, events, res.trajectory.turns,
                          round(time.perf_counter() - t0, 2))


def _diff_capturing(backend: str, diffs: list[str]):
    """A sandbox factory for ``run_task`` that keeps ``git diff`` of the agent's edits
    (taken when the sandbox closes; the hidden tests are untracked, so not in it)."""
    from opencomposer.sandbox import make_sandbox

    @contextmanager
    def open_sandbox(spec: Any) -> Iterator[Any]:
        with make_sandbox(spec, backend) as sb:
            try:
                yield sb
            finally:
                try:
                    r = sb.exec("git -c safe.directory='*' diff", timeout=30)
                    diffs.append(r.output if r.exit_code == 0 else "")
                except Exception:  # no diff is not worth losing the session over
                    diffs.append("")

    return open_sandbox
