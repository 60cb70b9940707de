"""How often a model, as a plain completer, writes the deleted line of a line task.

A line task deletes one simple statement from a library's source and asks the agent to put it
back. Before RL can raise how often the agent does, the model must know the line at all: this
measures that knowledge without the agent loop. For each task, the file as the agent finds it is
cut at the gap (the gold patch's added line), the last ``--context-tokens`` tokens before it are
the prompt, and the model writes one line: greedily, and ``--k`` times at ``--temperature``. A
line counts when it equals the gold line with surrounding whitespace stripped (``exact`` also
keeps the indentation). Only the left side of the gap is shown (a causal completer), so the
figure is a floor on what the model knows; the agent also sees the code after the gap.

Tasks: the line tasks of a learn run's split (``--splits runs/.../splits.json --split
validation``; never a held-out split: the script refuses those) found under ``--tasks`` folders.

    python benchmarks/line_completer.py --tasks runs/learn-gpu/tasks/lines runs/learn-gpu/tasks/lines-more \\
        --splits runs/learn-gpu/lines-more/splits.json --split validation --k 8

Prints a line per task (``--verbose``) and one JSON line last: tasks, greedy and pass@k rates
with Wilson 95% intervals, per-library greedy rates, seconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from opencomposer.eval.report import wilson_interval
from opencomposer.models.registry import load_model
from opencomposer.tasks.format import find_tasks as task_dirs_of

HELD_OUT = ("heldout_functions", "heldout_libraries", "humaneval_heldout")
_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,\d+)? @@")


class TaskError(ValueError):
    """A task that is not a one-line insertion this script can measure."""


@dataclass
class Gap:
    task: str
    library: str
    file: str  # the file the line was deleted from, workspace-relative
    before: str  # the file up to the gap, as the agent finds it
    gold: str  # the deleted line, without its newline


def read_gap(task_dir: Path) -> Gap:
    """The gap of a line task: its gold patch must add exactly one line to one file."""
    patch = (task_dir / "solution" / "gold.patch").read_text()
    lines = patch.splitlines()
    files = [ln[6:] for ln in lines if ln.startswith("+++ b/")]
    if len(files) != 1:
        raise TaskError(f"{task_dir}/solution/gold.patch: changes {len(files)} files, expected 1")
    added, at, new_line = [], None, None
    for ln in lines:
        m = _HUNK.match(ln)
        if m:
            new_line = int(m.group(1))
            continue
        if new_line is None or ln.startswith(("+++", "---")):
            continue
        if ln.startswith("+"):
            added.append(ln[1:])
            at = new_line
            new_line += 1
        elif ln.startswith("-"):
            raise TaskError(f"{task_dir}/solution/gold.patch: removes a line, expected one line added")
        else:
            new_line += 1
    if len(added) != 1:
        raise TaskError(f"{task_dir}/solution/gold.patch: adds {len(added)} lines, expected 1")
    source = (task_dir / "workspace" / files[0]).read_text().splitlines(keepends=True)
    library = task_dir.name.split("__", 1)[0]
    return Gap(task_dir.name, library, files[0], "".join(source[: at - 1]), added[0])


def find_tasks(roots: list[Path], ids: list[str]) -> list[Path]:
    """The task dirs named ``ids`` under ``roots`` (the first root holding one wins), in ``ids`` order."""
    where: dict[str, Path] = {}
    for d in task_dirs_of(roots):
        where.setdefault(d.name, d)
    return [where[i] for i in ids if i in where]


@torch.no_grad()
def complete(model, tok, prompt: str, k: int, temperature: float, max_new: int, context: int,
             gen: torch.Generator) -> tuple[str, list[str]]:
    """One greedy line and ``k`` sampled lines after ``prompt`` (its last ``context`` tokens).

    The prompt ends before its last newline (tokenizers join a newline with the indentation
    after it, so a prompt cut after it would be a boundary the model never saw); a line is what
    follows that newline, up to the next."""
    ids = tok(prompt.removesuffix("\n"), return_tensors="pt").input_ids[:, -context:]
    out = model(ids, use_cache=True)

    def line_of(toks: list[int]) -> tuple[str, bool]:
        text = tok.decode(toks)
        body = text.removeprefix("\n")
        return body.split("\n")[0], "\n" in body or tok.eos_token_id in toks

    def run(logits: torch.Tensor, cache, n: int, greedy: bool) -> list[str]:
        toks: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        logits = logits.expand(n, -1)
        for _ in range(max_new):
            if greedy:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits.float() / temperature, -1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            for j, t in enumerate(nxt.tolist()):
                if not done[j]:
                    toks[j].append(t)
                    done[j] = line_of(toks[j])[1]
            if all(done):
                break
            step = model(nxt[:, None], past_key_values=cache, use_cache=True)
            logits, cache = step.logits[:, -1], step.past_key_values
        return [line_of(t)[0] for t in toks]

    greedy = run(out.logits[:, -1], copy.deepcopy(out.past_key_values), 1, True)[0]
    cache = out.past_key_values
    cache.batch_repeat_interleave(k)
    return greedy, run(out.logits[:, -1], cache, k, False)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=Path, nargs="+", required=True, help="folders of tasks")
    ap.add_argument("--splits", type=Path, required=True, help="a learn run's splits.json")
    ap.add_argument("--split", default="validation", help="which split's line tasks (never a held-out one)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-tasks", type=int, default=0, help="0: all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write a JSON line per task here")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    if a.split in HELD_OUT:
        sys.exit(f"--split {a.split}: a held-out split is never measured for choosing anything; "
                 f"use validation, train or rl_only")
    splits = json.loads(a.splits.read_text())
    if a.split not in splits or not isinstance(splits[a.split], list):
        sys.exit(f"{a.splits}: no split {a.split!r} (has {sorted(k for k, v in splits.items() if isinstance(v, list))})")
    ids = [i for i in splits[a.split] if i.endswith("__line")]
    dirs = find_tasks(a.tasks, ids)
    if len(dirs) < len(ids):
        print(f"note: {len(ids) - len(dirs)} of {len(ids)} line tasks of {a.split} are not under --tasks",
              file=sys.stderr)
    if a.max_tasks:
        dirs = dirs[: a.max_tasks]
    if not dirs:
        sys.exit(f"no line task of split {a.split!r} found under {[str(t) for t in a.tasks]}")
    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    model, tok = load_model(a.model)
    t0, rows = time.perf_counter(), []
    sink = a.out.open("w") if a.out else None
    for n, d in enumerate(dirs, 1):
        try:
            gap = read_gap(d)
        except TaskError as e:
            print(f"skip: {e}", file=sys.stderr)
            continue
        greedy, samples = complete(model, tok, gap.before, a.k, a.temperature, a.max_new_tokens,
                                   a.context_tokens, gen)
        want = gap.gold.strip()
        row = {"task": gap.task, "library": gap.library, "gold": gap.gold, "greedy": greedy,
               "greedy_ok": greedy.strip() == want, "greedy_exact": greedy == gap.gold,
               "samples_ok": sum(s.strip() == want for s in samples)}
        rows.append(row)
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()
        if a.verbose:
            print(f"[{n}/{len(dirs)}] {'OK ' if row['greedy_ok'] else '-- '} {row['samples_ok']}/{a.k} "
                  f"{gap.task}: gold {want!r} greedy {greedy.strip()!r}", flush=True)
    if sink:
        sink.close()
    n = len(rows)
    g = sum(r["greedy_ok"] for r in rows)
    any_k = sum(r["samples_ok"] > 0 for r in rows)
    per_sample = sum(r["samples_ok"] for r in rows) / (n * a.k) if n else 0.0
    libs: dict[str, list[int]] = {}
    for r in rows:
        libs.setdefault(r["library"], []).append(int(r["greedy_ok"]))
    result = {
        "split": a.split, "tasks": n, "model": a.model, "k": a.k, "temperature": a.temperature,
        "context_tokens": a.context_tokens,
        "greedy": round(g / n, 4) if n else 0.0, "greedy_ci95": [round(x, 4) for x in wilson_interval(g, n)],
        "greedy_exact": round(sum(r["greedy_exact"] for r in rows) / n, 4) if n else 0.0,
        "sample_pass@1": round(per_sample, 4), f"pass@{a.k}": round(any_k / n, 4) if n else 0.0,
        f"pass@{a.k}_ci95": [round(x, 4) for x in wilson_interval(any_k, n)],
        "groups_with_variance": round(sum(0 < r["samples_ok"] < a.k for r in rows) / n, 4) if n else 0.0,
        "per_library_greedy": {k: f"{sum(v)}/{len(v)}" for k, v in sorted(libs.items())},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
