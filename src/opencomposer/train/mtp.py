"""Train an ``MTPHead`` (``models/mtp.py``) by self-distillation, for speculative decoding.

    result = train_mtp("smollm2-135m", ["runs/oracle", "src/"], "runs/mtp", steps=200)
    Engine.from_name("smollm2-135m", draft="runs/mtp/head")

The base model is frozen; its own next-token distributions are the targets. For a window
of tokens ``x`` with the base model's final hidden states ``H`` and logits ``L``, draft
step ``j`` (1..``depth``) computes ``h_j = head(h_{j-1}, embed(x[i + j]))`` from ``h_0 = H[i]``
and is pulled towards ``softmax(L[i + j])`` (what the model predicts for ``x[i + j + 1]``)
by ``KL(p_model || q_head)``. Training the chain ``depth`` steps deep is what lets the
engine draft several tokens a step by feeding the head its own outputs.

Reported per draft depth (on held-out windows, before and after training):
``acceptance`` = mean ``sum_x min(p(x), q(x))``, the probability that rejection sampling at
temperature 1 accepts the head's draft (exact, not a proxy), and ``top1`` = how often the
head's argmax is the model's argmax (greedy acceptance). Both assume the earlier drafts
were accepted.

Data: source files or directories of them, ``.jsonl`` files of ``{"text": ...}`` and agent
transcripts, read by ``train/corpus.py`` (shared with continued pretraining). All are
tokenised, joined with the end-of-text token and cut into ``seq_len`` windows; a tenth of
the windows (at least one, at most ``eval_windows``) is held out.

The head drafts from the ``draft_vocab`` most frequent tokens of the training windows only
(FR-Spec's observation: a few thousand tokens carry nearly all of the mass, and drafting
then reads that many rows of ``lm_head`` instead of all of them); ``draft_vocab_coverage``
is the share of training tokens they cover. The reported acceptance and top-1 are the
draft vocabulary's, as the engine drafts (training minimises the KL over all of it).

Writes ``<out>/head`` (the head, atomically) and ``<out>/checkpoint`` (head, optimizer and
step, every ``save_every`` steps and at the end: a run resumes from it).

Test: ``pytest tests/unit/train/test_mtp.py``.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from opencomposer.models import load_model
from opencomposer.models.mtp import MTPConfig, MTPHead
from opencomposer.paths import atomic_write_text
from opencomposer.train.corpus import read_corpus, windows
from opencomposer.train.sft import progress_bar


def head_for(model: Any, intermediate_size: int = 0, base_model: str = "") -> MTPHead:
    """A fresh head shaped for the HF ``model``."""
    cfg = model.config
    return MTPHead(MTPConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                             intermediate_size=intermediate_size, rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-5),
                             base_model=base_model))


def chain_losses(model: Any, head: MTPHead, ids: torch.Tensor, depth: int) -> list[dict[str, torch.Tensor]]:
    """For a batch of windows ``ids`` [B, T]: per draft step, the KL to the base model, the
    acceptance (``sum min(p, q)``) and the top-1 agreement, each averaged over positions."""
    n = ids.shape[1] - depth
    if n < 1:
        raise ValueError(f"windows of {ids.shape[1]} tokens are too short for depth {depth}")
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # after the final norm: what lm_head reads
        teacher = model.lm_head(hidden).float().log_softmax(-1)
        embeds = model.get_input_embeddings()(ids)
    h = hidden[:, :n]
    out = []
    for j in range(1, depth + 1):
        h = head(h, embeds[:, j:n + j])
        logits = model.lm_head(h).float()
        target = teacher[:, j:n + j]
        kl = F.kl_div(logits.log_softmax(-1), target, log_target=True, reduction="none").sum(-1).mean()
        with torch.no_grad():  # as the engine drafts: from the draft vocabulary only
            vocab = head.draft_vocab
            sub = logits[..., vocab]
            accept = torch.minimum(sub.softmax(-1), target[..., vocab].exp()).sum(-1).mean()
            top1 = (vocab[sub.argmax(-1)] == target.argmax(-1)).float().mean()
        out.append({"kl": kl, "acceptance": accept, "top1": top1})
    return out


@torch.no_grad()
def evaluate(model: Any, head: MTPHead, held_out: list[list[int]], depth: int, batch_size: int = 4) -> dict[str, list]:
    """Per draft step: mean acceptance, top-1 agreement and KL over ``held_out`` windows."""
    dev = next(model.parameters()).device
    sums = [[0.0, 0.0, 0.0] for _ in range(depth)]
    count = 0
    for i in range(0, len(held_out), batch_size):
        ids = torch.tensor(held_out[i:i + batch_size], device=dev)
        for s, row in zip(sums, chain_losses(model, head, ids, depth)):
            for k, key in enumerate(("acceptance", "top1", "kl")):
                s[k] += float(row[key]) * len(ids)
        count += len(ids)
    return {key: [round(s[k] / count, 4) for s in sums] for k, key in enumerate(("acceptance", "top1", "kl"))}


def train_mtp(model_name: str, data: Sequence[str | Path], out_dir: str | Path, steps: int = 200, depth: int = 3,
              lr: float = 1e-3, batch_size: int = 4, seq_len: int = 256, seed: int = 0, save_every: int = 50,
              intermediate_size: int = 0, eval_windows: int = 32, draft_vocab: int = 8192, device: str | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Self-distil a head for ``model_name`` on ``data``; resumes from ``out_dir/checkpoint``."""
    if steps < 1 or depth < 1 or batch_size < 1 or seq_len < depth + 2:
        raise ValueError(f"need steps >= 1, depth >= 1, batch_size >= 1 and seq_len >= depth + 2; got steps={steps}, "
                         f"depth={depth}, batch_size={batch_size}, seq_len={seq_len}")
    out = Path(out_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    model, tok = load_model(model_name, device=device)
    model.requires_grad_(False)
    sep = tok.eos_token_id if tok.eos_token_id is not None else 0
    docs = read_corpus(data, tok)
    wins = windows(docs, seq_len, sep)
    if len(wins) < 2:
        raise ValueError(f"MTP data {[str(p) for p in data]}: {sum(map(len, docs))} tokens make {len(wins)} windows "
                         f"of seq_len={seq_len}; need at least 2 (one held out). Add data or lower --seq-len")
    random.Random(seed).shuffle(wins)
    n_held = min(max(1, len(wins) // 10), eval_windows)
    held, train = wins[:n_held], wins[n_held:]
    head = head_for(model, intermediate_size, model_name).to(device)
    coverage = 1.0
    if draft_vocab:  # the most frequent tokens of the training windows
        coverage = head.set_draft_vocab(torch.bincount(torch.tensor(train).flatten(), minlength=head.cfg.vocab_size),
                                        draft_vocab)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    start, history = _resume(out / "checkpoint", head, opt)
    before = history.get("before") or evaluate(model, head, held, depth)
    rng = random.Random(seed + start)
    warm = max(1, steps // 20)
    t0, tokens = time.perf_counter(), 0
    with progress_bar(progress) as bar:
        task = bar.add_task("mtp", total=steps, completed=start, loss=float("nan")) if bar else None
        for step in range(start, steps):
            for g in opt.param_groups:  # linear warm-up, cosine to a tenth
                g["lr"] = lr * min(1.0, (step + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
            ids = torch.tensor(rng.sample(train, min(batch_size, len(train))), device=device)
            rows = chain_losses(model, head, ids, depth)
            loss = sum(r["kl"] for r in rows) / depth
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            tokens += ids.numel()
            history.setdefault("loss", []).append(round(loss.item(), 5))
            history.setdefault("acceptance_1", []).append(round(float(rows[0]["acceptance"]), 4))
            if bar:
                bar.update(task, advance=1, loss=float(loss))
            if (step + 1) % save_every == 0 and step + 1 < steps:
                _checkpoint(out / "checkpoint", head, opt, step + 1, {**history, "before": before})
    seconds = time.perf_counter() - t0
    after = evaluate(model, head, held, depth)
    head.cfg.trained = {"steps": steps, "depth": depth, "seq_len": seq_len, "windows": len(train),
                        "held_out": len(held), "acceptance": after["acceptance"], "top1": after["top1"],
                        "draft_vocab_coverage": round(coverage, 4)}
    _checkpoint(out / "checkpoint", head, opt, steps, {**history, "before": before})
    head.save(out / "head")
    return {"model": model_name, "head": str(out / "head"), "steps": steps, "resumed_from": start, "depth": depth,
            "train_windows": len(train), "held_out_windows": len(held), "tokens": tokens,
            "seconds": round(seconds, 2), "params": sum(p.numel() for p in head.parameters()),
            "first_loss": history["loss"][0], "last_loss": history["loss"][-1],
            "acceptance_before": before["acceptance"], "acceptance": after["acceptance"],
            "top1_before": before["top1"], "top1": after["top1"], "kl": after["kl"],
            "draft_vocab": head.cfg.draft_vocab_size or head.cfg.vocab_size, "draft_vocab_coverage": round(coverage, 4)}


def _checkpoint(d: Path, head: MTPHead, opt: torch.optim.Optimizer, step: int, history: dict) -> None:
    """Head + optimizer + step, each file replaced atomically; ``state.json`` (the step) last."""
    d.mkdir(parents=True, exist_ok=True)
    head.save(d / "head")
    tmp = d / "optim.pt.tmp"
    torch.save(opt.state_dict(), tmp)
    tmp.replace(d / "optim.pt")
    atomic_write_text(d / "state.json", json.dumps({"step": step, "history": history}))


def _resume(d: Path, head: MTPHead, opt: torch.optim.Optimizer) -> tuple[int, dict]:
    if not (d / "state.json").is_file():
        return 0, {}
    state = json.loads((d / "state.json").read_text())
    saved = MTPHead.load(d / "head", head.cfg.hidden_size, head.cfg.vocab_size)
    head.load_state_dict(saved.state_dict())
    opt.load_state_dict(torch.load(d / "optim.pt", weights_only=True))
    return int(state["step"]), state.get("history", {})
