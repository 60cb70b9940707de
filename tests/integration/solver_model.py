"""A CPU-sized model checkpoint that really solves a few tasks, and a damaged copy of it.

For the eval gate test (``test_eval_gate.py``): nothing pretrained that runs on CPU in the
test budget solves any task, so this trains one, at toy scale, through the repo's own
pieces:

1. ``record_demos``: per task, a short demonstration through the real harness and sandbox
   (``rl.episode.run_task``): one ``edit_file`` per hunk of the gold patch (its removed
   lines -> its added lines), then ``submit``. The hidden tests must pass, else it raises.
   (The compact oracle's trace is ~400 assistant tokens per task in ~2,100; this one is
   ~100 in ~1,450, which a tiny model memorises in a fraction of the steps.)
2. ``tiny_base``: a random 2-layer, hidden-64 Llama with SmolLM2's tokenizer (tiny-random's,
   but a 4096-token context: the harness prompt alone is ~1,300 tokens).
3. ``train.sft.run_sft`` on those transcripts (assistant tokens only), exported as a plain
   HF directory by ``train.export.export_model``: the directory ``--model`` loads.
4. ``damage``: the same weights with Gaussian noise added to every matrix, written through
   the same checkpoint writer; ``resave``: the weights loaded and written again unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from opencomposer.config import AgentConfig
from opencomposer.models.codec import format_assistant
from opencomposer.harness.patch import Hunk, parse_patch
from opencomposer.policies.scripted import ScriptedPolicy, tool_call
from opencomposer.models import load_model
from opencomposer.episode.run import run_task
from opencomposer.tasks.format import Task
from opencomposer.train.export import export_model
from opencomposer.train.config import TrainConfig
from opencomposer.train.sft import build_sft_samples, load_transcripts, run_sft
from opencomposer.train.trainer import Trainer

CONTEXT = 4096


def demo_policy(task: Task) -> ScriptedPolicy:
    """Edit every hunk of the gold patch in one turn, then submit in the next."""
    calls = []
    for fp in parse_patch(task.gold_patch):
        text = (task.workspace / fp.path).read_text()
        for h in fp.hunks:
            old, new = _shortest_edit(h, text)
            if not old:
                raise ValueError(f"{task.id}: a hunk of {fp.path} has no old side (a new file?); no edit_file demo")
            calls.append(tool_call("edit_file", path=fp.path, old=old, new=new))
    return ScriptedPolicy([format_assistant("Fix it.", calls),
                           format_assistant("Done.", [tool_call("submit", message="Done.")])])


def _shortest_edit(hunk: Hunk, text: str) -> tuple[str, str]:
    """The hunk's removed -> added lines when they are one block whose old side is unique in
    ``text``, else its whole old -> new side (context included), as the oracle edits it."""
    changed = [i for i, (tag, _) in enumerate(hunk.lines) if tag != " "]
    block = hunk.lines[changed[0]: changed[-1] + 1] if changed else []
    old = "".join(t for tag, t in block if tag == "-")
    if old and all(tag != " " for tag, _ in block) and text.count(old) == 1:
        return old, "".join(t for tag, t in block if tag == "+")
    return hunk.old_text, hunk.new_text


def record_demos(tasks: list[Task], out: Path, backend: str, cfg: AgentConfig) -> list[Path]:
    """One passing demonstration transcript per task, under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for task in tasks:
        res = run_task(task, demo_policy(task), backend, cfg, transcript=out / f"{task.id}.json")
        if not res.reward.passed:
            raise AssertionError(f"{task.id}: the demonstration did not pass the hidden tests: {res.reward}")
        paths.append(out / f"{task.id}.json")
    return paths


def tiny_base(out: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A random Llama with tiny-random's tokenizer and a ``CONTEXT``-token window, saved to ``out``."""
    _, tok = load_model("tiny-random")
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    tok.model_max_length = CONTEXT
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def train_solver(transcripts: list[Path], base: Path, out: Path, epochs: int = 60, more: int = 20,
                 lr: float = 5e-3, max_rounds: int = 4) -> dict:
    """SFT ``base`` on ``transcripts`` (one sequence per optimizer step) until greedy decoding
    reproduces every demonstrated token: ``run_sft`` for ``epochs`` epochs, then rounds of
    ``more`` epochs from the previous round's export while any token is wrong. Returns the
    last round's result plus ``rounds``, ``seconds`` (all rounds) and ``mistakes`` (per
    round: ``greedy_mistakes``)."""
    cfg = TrainConfig(lr=lr, seed=0, bf16=False, micro_batch_tokens=CONTEXT)
    model, seconds, mistakes = str(base), 0.0, []
    for rounds in range(1, max_rounds + 1):
        res = run_sft(transcripts, model, out / f"round-{rounds}", cfg, epochs=epochs if rounds == 1 else more,
                      batch_size=1, progress=False)
        model, seconds = res["export"], seconds + res["seconds"]
        mistakes.append(greedy_mistakes(Path(model), transcripts))
        if not mistakes[-1]:
            break
    return {**res, "rounds": rounds, "seconds": round(seconds, 1), "mistakes": mistakes}


@torch.no_grad()
def greedy_mistakes(model_dir: Path, transcripts: list[Path], margin: float = 1.0) -> int:
    """Demonstrated assistant tokens whose logit, given the transcript so far, does not beat
    every other token's by ``margin``: greedy decoding might not pick them (the margin keeps
    batched, left-padded generation from flipping a near tie)."""
    model, tok = load_model(str(model_dir))
    samples, _ = build_sft_samples(load_transcripts(transcripts), tok, CONTEXT)
    wrong = 0
    for s in samples:
        ids = torch.tensor([s.input_ids])
        pos = (torch.tensor(s.loss_mask[1:]) > 0).nonzero().squeeze(1)  # output t predicts token t + 1
        logits = model(input_ids=ids, logits_to_keep=pos).logits[0]
        target = ids[0, pos + 1, None]
        best = logits.gather(1, target)[:, 0]
        rival = logits.scatter(1, target, float("-inf")).max(-1).values
        wrong += int((best - rival < margin).sum())
    return wrong


def damage(src: Path, dst: Path, noise: float, seed: int = 0) -> dict:
    """``src`` with N(0, noise * std) added to every 2-D weight, exported to ``dst``; returns what changed."""
    model, tok = load_model(str(src))
    gen = torch.Generator().manual_seed(seed)
    changed = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.add_(torch.randn(p.shape, generator=gen) * noise * float(p.std()))
                changed.append(name)
    export_model(dst, Trainer(model, tok, TrainConfig(bf16=False)))
    info = {"noise": noise, "seed": seed, "tensors": changed}
    (dst / "damage.json").write_text(json.dumps(info, indent=1))
    return info


def resave(src: Path, dst: Path) -> Path:
    """``src`` loaded and written again through the checkpoint writer, weights unchanged."""
    model, tok = load_model(str(src))
    return export_model(dst, Trainer(model, tok, TrainConfig(bf16=False)))
