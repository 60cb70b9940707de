"""How likely the model finds the gold edit turn in each tool-call syntax (json vs xml), before any training.

    .venv/bin/opencomposer tasks import humaneval --out /tmp/he_train --ids 0,2,4,6,8
    .venv/bin/python benchmarks/probe_tool_syntax.py /tmp/he_train --tasks 5

For each task: the oracle's episode up to its ``edit_file`` turn (``policies/oracle.py``, compact), then
log P(that assistant turn | the prompt so far) under the model, with the whole conversation rendered in
each syntax (``models/codec.py``: json = Hermes, code as an escaped JSON string; xml = code as plain
text). Higher (less negative) is more likely. One JSON row per task, then a summary JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from opencomposer.episode.run import run_task
from opencomposer.harness.prompt import agent_tools
from opencomposer.models import codec
from opencomposer.models.chat import encode_prompt, render_prompt, set_tool_syntax, tool_syntax
from opencomposer.models.registry import load_model
from opencomposer.policies import make_policy
from opencomposer.tasks.format import Task, task_dirs


@torch.no_grad()
def turn_logprob(model, tok, prompt: str, target: str) -> tuple[float, int]:
    p, t = encode_prompt(tok, prompt), tok(target, add_special_tokens=False)["input_ids"]
    logits = model(torch.tensor([p + t])).logits[0, len(p) - 1:-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t)[:, None])
    return float(lp.sum()), len(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tasks", type=Path, help="a directory of tasks with single-file edits (e.g. imported HumanEval)")
    ap.add_argument("--tasks", dest="n", type=int, default=5, help="how many (sorted by name)")
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args()
    model, tok = load_model(a.model)
    tools, rows = agent_tools(), []
    for d in task_dirs(a.tasks)[: a.n]:
        task = Task.load(d)
        msgs = run_task(task, make_policy("oracle", task=task, compact=True), "local").trajectory.messages
        i = next(i for i, m in enumerate(msgs) if m.role == "assistant" and any(c.name in ("edit_file", "replace_lines") for c in m.tool_calls))
        row = {"task": task.id}
        for syntax in codec.SYNTAXES:
            set_tool_syntax(tok, syntax)
            target = codec.format_assistant(msgs[i].content, msgs[i].tool_calls, tool_syntax(tok))
            row[syntax], row[f"{syntax}_tokens"] = turn_logprob(model, tok, render_prompt(tok, msgs[:i], tools), target)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"probe": "tool_syntax", "model": a.model, "tasks": len(rows),
                      **{f"{s}_mean_logprob": round(statistics.fmean(r[s] for r in rows), 2) for s in codec.SYNTAXES},
                      "xml_more_likely": sum(r["xml"] > r["json"] for r in rows)}))


if __name__ == "__main__":
    main()
