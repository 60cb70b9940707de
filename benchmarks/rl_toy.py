"""Does the RL learner raise a reward at all, and how fast at the long run's gradient scale? A bandit on the
embedded SmolLM2-135M through the run's own learner (``rl.learner.Learner``: the Composer GRPO loss, LoRA,
AdamW, the constant normaliser ``agent.max_tokens x rollouts``), no harness and no sandbox.

Each step samples K short answers to each of P prompts ("Name a number between 1 and 20.") from the current
adapters (temperature 1), rewards an answer 1 when it holds a digit (the base model answers with a number in
~12% of its 6-token answers; most talk around the question), and updates on the group advantages
(r - group mean). Before and after, a fixed set of other prompts is sampled N times each: the reward there is the
held-out figure. Arms differ in ``[train] adam_eps`` (and anything else given with --set); the normaliser is the
run's ratio of loss tokens to ``max_tokens x rollouts`` unless --max-tokens says otherwise. Each arm also reports
the median gradient scale Adam sees (the square root of its bias-corrected second moment) on LoRA's A and B
matrices, to compare with the long run's (session 41: 5.2e-10 on A, 2.6e-8 on B, against epsilon 1e-8).

    python benchmarks/rl_toy.py --steps 12 --eps 1e-8 --eps 1e-12          # one line of JSON last

Reading: a rise of the held-out reward says the learner learns; the arms' difference says what epsilon costs at
this scale. A toy, not the agent: it says nothing of transfer to code.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from opencomposer.rl.advantages import group_advantages
from opencomposer.rl.config import RLRunConfig
from opencomposer.rl.learner import Learner, TrainBatch
from opencomposer.train import distributed
from opencomposer.train.samples import NOT_GENERATED, Sample

TRAIN_PROMPTS = [f"Name a number between 1 and 20. ({c})" for c in "abcdefgh"]
HELD_PROMPTS = [f"Pick a whole number from 1 to 20 and say only it. [{c}]" for c in "wxyz"]


def reward(text: str) -> float:
    return 1.0 if any(c.isdigit() for c in text) else 0.0


@torch.no_grad()
def sample(model, tok, prompts: list[str], k: int, new_tokens: int, seed: int):
    """``k`` answers to each prompt: (prompt ids, completion ids, their sampling logprobs, text) per answer."""
    torch.manual_seed(seed)
    out = []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt")
        if not torch.is_tensor(ids):
            ids = ids["input_ids"]
        g = model.generate(ids.repeat(k, 1), attention_mask=torch.ones(k, ids.shape[1], dtype=torch.long),
                           do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        comp = g.sequences[:, ids.shape[1]:]
        lps = torch.stack([torch.log_softmax(s.float(), -1) for s in g.logits], 1)  # [k, T, V]
        for i in range(k):
            c = comp[i].tolist()
            if tok.eos_token_id in c:
                c = c[: c.index(tok.eos_token_id) + 1]
            lp = [float(lps[i, t, c[t]]) for t in range(len(c))]
            out.append((ids[0].tolist(), c, lp, tok.decode(c, skip_special_tokens=True)))
    return out


def grad_scale(learner: Learner) -> dict[str, float]:
    """Median sqrt of Adam's bias-corrected second moment on LoRA's A and B matrices."""
    opt = learner.trainer.optimizer
    a, b = [], []
    names = {id(p): n for n, p in learner.trainer.model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st or "exp_avg_sq" not in st:
                continue
            step = float(st["step"])
            v = (st["exp_avg_sq"] / (1 - group["betas"][1] ** step)).sqrt().flatten()
            name = names.get(id(p), "")
            (a if "lora_A" in name else b if "lora_B" in name else []).append(v.median().item())
    return {"sqrt_v_A": statistics.median(a) if a else None, "sqrt_v_B": statistics.median(b) if b else None}


def run_arm(eps: float, args, out: Path) -> dict:
    cfg = RLRunConfig(tasks={"dir": str(out / "tasks")}, model={"name": args.model},
                      train={"lr": args.lr, "bf16": False, "lora": True, "lora_r": 16, "adam_eps": eps},
                      agent={"max_tokens": args.max_tokens}, rollout={"temperature": 1.0, "k": args.k},
                      loss={"kl_coef": 0.0}, run={"steps": args.steps + 1, "save_every": 10_000})
    torch.manual_seed(args.seed)
    ln = Learner(cfg, out, args.model, distributed.SINGLE, "cpu")
    model, tok = ln.trainer.policy_pair()

    def held() -> float:
        rows = sample(model, tok, HELD_PROMPTS, args.held_k, args.new_tokens, seed=10_000 + args.seed)
        return sum(reward(r[3]) for r in rows) / len(rows)

    before = held()
    curve = []
    for step in range(1, args.steps + 1):
        t0 = time.time()
        rows = sample(model, tok, TRAIN_PROMPTS, args.k, args.new_tokens, seed=args.seed * 1000 + step)
        samples = []
        for gi in range(len(TRAIN_PROMPTS)):
            group = rows[gi * args.k:(gi + 1) * args.k]
            adv = group_advantages([reward(r[3]) for r in group])
            for (prompt, comp, lp, _), a in zip(group, adv):
                if a == 0.0:
                    continue
                n = len(prompt) + len(comp)
                samples.append(Sample(prompt + comp, [0] * len(prompt) + [1] * len(comp), [0.0] * len(prompt) + lp,
                                      a, [NOT_GENERATED] * len(prompt) + [ln.version] * len(comp),
                                      task_id=f"g{gi}", group_id=f"g{gi}"))
                assert len(samples[-1]) == n
        m = ln.update(TrainBatch(samples, pairs=[], rollouts=len(rows)))
        r = sum(reward(x[3]) for x in rows) / len(rows)
        curve.append(r)
        print(json.dumps({"eps": eps, "step": step, "train_reward": round(r, 4), "samples": len(samples),
                          "clip_fraction": round(m.get("clip_fraction", 0.0), 5), "grad_norm": m.get("grad_norm"),
                          "seconds": round(time.time() - t0, 1)}), flush=True)
    scale = grad_scale(ln)
    after = held()
    return {"adam_eps": eps, "held_before": before, "held_after": after, "train_first": statistics.mean(curve[:3]),
            "train_last": statistics.mean(curve[-3:]), **scale}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--held-k", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-tokens", type=int, default=16,
                    help="agent.max_tokens of the normaliser; 16 puts this toy's ~6 loss tokens a rollout at the "
                         "long run's ratio of loss tokens to the normaliser (~0.37)")
    ap.add_argument("--eps", type=float, action="append", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    random.seed(args.seed)
    arms = []
    for eps in args.eps or [1e-8, 1e-12]:
        with tempfile.TemporaryDirectory(prefix="rl-toy-") as d:
            arms.append(run_arm(eps, args, Path(d)))
        print(json.dumps({"arm": arms[-1]}), flush=True)
    print(json.dumps({"bench": "rl_toy", "model": args.model, "steps": args.steps, "k": args.k,
                      "prompts": len(TRAIN_PROMPTS), "held_prompts": len(HELD_PROMPTS), "held_k": args.held_k,
                      "lr": args.lr, "max_tokens": args.max_tokens, "seed": args.seed, "arms": arms}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
