"""Targeted textual feedback: detectors find failure points; distilling the hinted teacher
into the student lowers the invalid call and raises a valid one, on the embedded model."""

from __future__ import annotations

import pytest
import torch

from opencomposer.models.codec import format_assistant
from opencomposer.harness.prompt import agent_tools, system_prompt
from opencomposer.harness.tools import TOOLS, offered
from opencomposer.harness.trajectory import Step, ToolEvent, Trajectory
from opencomposer.models.chat import encode_prompt, render_prompt
from opencomposer.models.registry import load_model
from opencomposer.protocols import Message, ToolCall
from opencomposer.rl.config import FeedbackConfig
from opencomposer.rl.feedback import detect, distill_pairs
from opencomposer.train.config import TrainConfig
from opencomposer.train.trainer import Trainer

TASK = "Implement `toolz.functoolz.memoize`."
UNKNOWN = "Error: unknown tool 'open_file'. Available tools: read_file, list_dir, search, edit_file, write_file, run, submit."


def call_text(name: str) -> str:
    return format_assistant("", [ToolCall(name, {"path": "setup.py"}, "c0")])


def one_turn(tok, text: str, observation: str, invalid: bool, no_call: bool = False, lint: dict | None = None) -> Trajectory:
    ids = encode_prompt(tok, text + "<|im_end|>")
    events = [] if no_call else [ToolEvent("c0", "open_file", {"path": "setup.py"}, observation, False, invalid)]
    msgs = [Message("system", system_prompt()), Message("user", TASK),
            Message("assistant", "" if not no_call else text,
                    tool_calls=[] if no_call else [ToolCall("open_file", {"path": "setup.py"}, "c0")])]
    msgs += [Message("tool", observation, tool_call_id="c0", name="open_file")] if not no_call else [Message("user", "nudge")]
    step = Step(turn=0, text=text, tool_events=events, no_call=no_call, token_ids=ids, logprobs=[-1.0] * len(ids))
    return Trajectory(messages=msgs, steps=[step], task_id="t", meta={"lint": lint or {}})


@pytest.fixture(scope="module")
def tiny_tok():
    return load_model("tiny-random")[1]


def test_detectors_find_each_failure_point(tiny_tok):
    cfg = FeedbackConfig(enabled=True, long_message_tokens=5)
    [p] = detect(one_turn(tiny_tok, call_text("open_file"), UNKNOWN, invalid=True), cfg)
    assert p.kind == "invalid_call" and "does not exist" in p.hint and all(t in p.hint for t in offered())
    assert "open_file" not in p.hint  # never quote the bad call: the teacher would copy it
    [p] = detect(one_turn(tiny_tok, "I think I should look at the code first, then decide.", "", False, no_call=True), cfg)
    assert p.kind == "no_call"
    long_ok = one_turn(tiny_tok, "word " * 40, "", False, no_call=True)
    assert detect(long_ok, cfg.model_copy(update={"detectors": ["long_message"]}))[0].kind == "long_message"
    edit = one_turn(tiny_tok, call_text("edit_file"), "Edited.", invalid=False, lint={"new_findings": 2, "codes": {"F401": 2}})
    edit.steps[0].tool_events[0] = ToolEvent("c0", "edit_file", {}, "Edited.", True, False)
    [p] = detect(edit, cfg)
    assert p.kind == "lint" and "F401" in p.hint
    assert detect(one_turn(tiny_tok, call_text("open_file"), UNKNOWN, invalid=True),
                  cfg.model_copy(update={"detectors": ["no_call"]})) == []


def test_a_repeated_look_up_is_a_failure_point_when_asked_for(tiny_tok):
    lint = ToolEvent("c0", "lint", {"path": "a.py"}, "a.py: no problems found.", True, False)
    turn = one_turn(tiny_tok, call_text("lint"), "a.py: no problems found.", invalid=False)
    turn.steps[0].tool_events = [lint, ToolEvent("c1", "search", {"pattern": "x"}, "", True, False),
                                 ToolEvent("c2", "lint", {"path": "a.py"}, "a.py: no problems found.", True, False)]
    assert detect(turn, FeedbackConfig(enabled=True)) == []  # not among the default detectors
    [p] = detect(turn, FeedbackConfig(enabled=True, detectors=["repeated_call"]))
    assert p.kind == "repeated_call" and p.step == 0 and p.call == 2 and "nothing has changed" in p.hint
    turn.steps[0].tool_events.insert(1, ToolEvent("c3", "run", {"command": "touch a.py"}, "", True, False))
    assert detect(turn, FeedbackConfig(enabled=True, detectors=["repeated_call"])) == []  # a command came between


def test_student_and_teacher_differ_only_by_the_hint(tiny_tok):
    traj = one_turn(tiny_tok, call_text("open_file"), UNKNOWN, invalid=True)
    points = detect(traj, FeedbackConfig(enabled=True))
    [(student, teacher)] = distill_pairs(traj, points, tiny_tok, agent_tools())
    n = len(traj.steps[0].token_ids)
    assert 0 < student.loss_tokens == teacher.loss_tokens <= n
    assert student.loss_mask[-n:] == teacher.loss_mask[-n:]
    assert student.input_ids[-n:] == teacher.input_ids[-n:] == traj.steps[0].token_ids
    prompt = encode_prompt(tiny_tok, render_prompt(tiny_tok, traj.messages[:2], agent_tools()))
    assert student.input_ids[:-n] == prompt
    hinted = tiny_tok.decode(teacher.input_ids[:-n])
    assert points[0].hint in hinted and points[0].hint not in tiny_tok.decode(student.input_ids)
    # the hint rides on the last observation: no new turn (a new user turn made the hinted
    # teacher restart the task in the ablation)
    student_text = tiny_tok.decode(student.input_ids[:-n])
    assert hinted.count("<|im_start|>") == student_text.count("<|im_start|>")
    assert hinted.replace("\n\n" + points[0].hint, "", 1) == student_text


def test_the_kl_covers_the_failed_call_only(tiny_tok):
    """A turn of prose, a good call and a broken one: only the broken block's tokens are
    distilled (distilling the whole turn taught the policy to write tool names in its prose)."""
    good = format_assistant("", [ToolCall("list_dir", {"path": "."}, "c0")])
    text = "Let me look around first.\n" + good + "\n" + call_text("open_file")
    traj = one_turn(tiny_tok, text, UNKNOWN, invalid=True)
    traj.steps[0].tool_events = [ToolEvent("c0", "list_dir", {"path": "."}, "solution.py", True, False),
                                 ToolEvent("c1", "open_file", {"path": "setup.py"}, UNKNOWN, False, True)]
    [point] = detect(traj, FeedbackConfig(enabled=True))
    assert point.call == 1
    [(student, _)] = distill_pairs(traj, [point], tiny_tok, agent_tools())
    n = len(traj.steps[0].token_ids)
    masked = [t for t, m in zip(student.input_ids[-n:], student.loss_mask[-n:]) if m]
    decoded = tiny_tok.decode(masked)
    assert decoded.strip().startswith("<tool_call>") and "open_file" in decoded, decoded
    assert "list_dir" not in decoded and "look around" not in decoded, decoded
    # a turn without a call is distilled whole
    prose = one_turn(tiny_tok, "I think I should look at the code first.", "", False, no_call=True)
    [p] = detect(prose, FeedbackConfig(enabled=True))
    [(s2, _)] = distill_pairs(prose, [p], tiny_tok, agent_tools())
    assert p.call is None and s2.loss_tokens == len(prose.steps[0].token_ids)
    assert "read_file" not in p.hint  # nothing copyable where the whole turn is distilled


def divergence(a: list[int], b: list[int]) -> tuple[int, int, int]:
    """Where two token lists part (shared prefix length) and where each rejoins the shared suffix."""
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    j = 0
    while j < min(len(a), len(b)) - i and a[-1 - j] == b[-1 - j]:
        j += 1
    return i, len(a) - j, len(b) - j


def name_distribution(model, prompt: list[int], prefix: list[int]) -> torch.Tensor:
    """log p(next token | prompt + prefix): the model's choice of the tool name's first token."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([prompt + prefix])).logits[0, -1].float(), -1)


@pytest.mark.slow
def test_distillation_moves_the_invalid_call_toward_a_valid_one():
    """At the failure point (where the call names its tool), the probability of naming a tool
    that does not exist falls and that of the valid call (read_file) rises.

    "Naming a tool that does not exist" = 1 - the mass on the first tokens of the real tool
    names. (The sampled bad name itself, 'open', was already rare, p ~ 2e-4, and stays rare:
    the hinted teacher rates file-ish names like it slightly higher than the student does.)
    """
    model, tok = load_model("smollm2-135m")
    trainer = Trainer(model, tok, TrainConfig(lr=5e-5))
    traj = one_turn(tok, call_text("open_file"), UNKNOWN, invalid=True)
    pairs = distill_pairs(traj, detect(traj, FeedbackConfig(enabled=True)), tok, agent_tools())
    prompt = pairs[0][0].input_ids[: -pairs[0][0].loss_tokens]
    invalid = encode_prompt(tok, call_text("open_file") + "<|im_end|>")
    calls = {t["function"]["name"]: encode_prompt(tok, call_text(t["function"]["name"])) for t in agent_tools()}
    start, _, _ = divergence(invalid, calls["read_file"])
    assert start > 0 and all(c[:start] == invalid[:start] for c in calls.values())  # same prefix up to the name
    valid_first = sorted({c[start] for c in calls.values()})

    def measure() -> tuple[float, float]:
        logp = name_distribution(trainer.model, prompt, invalid[:start])
        p_valid = float(logp[valid_first].exp().sum())
        return 1.0 - p_valid, float(logp[calls["read_file"][start]].exp())

    before = measure()
    kls = []
    # 6 updates: p(read_file) oscillates over the first ones while the KL falls steadily (this
    # VM, 2 threads: 0.29, 0.10, 0.06, 0.19, 0.57, 0.89 after updates 1-6), so after 4 the
    # check read whichever phase a CPU's arithmetic landed on (it failed here at 0.19)
    for _ in range(6):
        m = trainer.distill_backward(pairs, coef=1.0, normalizer=float(pairs[0][0].loss_tokens))
        trainer.optimizer_step()
        kls.append(m["distill_kl"])
    after = measure()
    assert after[0] < before[0] - 0.2, (before, after)  # an invalid tool name became much less likely
    assert after[1] > before[1] + 0.2, (before, after)  # the valid call much more likely
    assert kls[-1] < kls[0]


BROKEN_EDIT = '<tool_call>\n{"name": "edit_file", "arguments": {"path": "solution.py", "old": "    \\"\\"\\"\\n", "new": "    return x'
MALFORMED = "Error: could not read your tool call: malformed JSON in <tool_call>: Unterminated string starting at: line 2"


@pytest.mark.slow
def test_a_broken_edit_is_not_distilled_into_a_different_tool():
    """The ablation's failure (benchmarks/ablation_behaviour.py): an edit_file call cut off
    mid-JSON got a hint whose example called read_file; the hinted teacher preferred reading,
    and distillation taught the policy to stop editing. The hint must keep the tool the turn
    chose: after distillation, edit_file has not lost ground to read_file at the tool name
    (log p(edit_file) - log p(read_file) does not fall; with the old hint it fell)."""
    model, tok = load_model("smollm2-135m")
    trainer = Trainer(model, tok, TrainConfig(lr=5e-5))
    traj = one_turn(tok, BROKEN_EDIT, MALFORMED, invalid=True)
    traj.steps[0].tool_events[0] = ToolEvent("c0", "", {}, MALFORMED, False, True)
    [point] = detect(traj, FeedbackConfig(enabled=True))
    assert "edit_file" in point.hint and not any(t in point.hint for t in TOOLS if t != "edit_file")
    pairs = distill_pairs(traj, [point], tok, agent_tools())
    prompt = pairs[0][0].input_ids[: -pairs[0][0].loss_tokens]
    edit, read = encode_prompt(tok, call_text("edit_file")), encode_prompt(tok, call_text("read_file"))
    start, _, _ = divergence(edit, read)

    def edit_over_read() -> float:
        logp = name_distribution(trainer.model, prompt, edit[:start])
        return float(logp[edit[start]] - logp[read[start]])

    before = edit_over_read()
    for _ in range(4):
        trainer.distill_backward(pairs, coef=1.0, normalizer=float(pairs[0][0].loss_tokens))
        trainer.optimizer_step()
    assert edit_over_read() >= before, (before, edit_over_read())
