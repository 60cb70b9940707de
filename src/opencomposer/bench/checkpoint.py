"""Checkpoint cost of the sharded trainer: seconds and host memory of ``save_checkpoint`` and
``load_checkpoint`` per layout (``full``: gathered to rank 0; ``sharded``: DCP, every rank its own).

    PYTHONPATH=src python -m opencomposer.bench.checkpoint --shape tiny --worlds 2
    PYTHONPATH=src python -m opencomposer.bench.checkpoint --shape h1024-l8 --worlds 1,2

For each layout and world size W the driver starts ``torchrun --nproc-per-node W`` (fresh
processes, so one layout's peak cannot hide the other's). Every rank builds the same random
model in fp32 (CPU, gloo), takes one ``sft_step`` so AdamW state exists, then saves and loads
a checkpoint while a thread samples its resident memory (``/proc/self/statm``, every ms).
Reported per rank: seconds, the peak RSS above the RSS just before (what the call itself
needed), the absolute peak; and the checkpoint's size on disk. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

SHAPES = {  # random Qwen2 shapes beyond inference.bench.SHAPES
    "h1024-l8": {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
                 "intermediate_size": 2816, "vocab_size": 32000, "tie_word_embeddings": True},
    "h1536-l12": {"hidden_size": 1536, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 2,
                  "intermediate_size": 4096, "vocab_size": 32000, "tie_word_embeddings": True},
}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The highest RSS seen while the block runs, sampled by a thread."""

    def __enter__(self) -> PeakRSS:
        self.before = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def measured(fn: Any) -> dict[str, float]:
    t0 = time.perf_counter()
    with PeakRSS() as mem:
        fn()
    return {"seconds": round(time.perf_counter() - t0, 3), "extra_rss_mib": round((mem.peak - mem.before) / 2**20, 1),
            "peak_rss_mib": round(mem.peak / 2**20, 1)}


def worker(args: argparse.Namespace) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from opencomposer.bench.toolkit import SHAPES as BASE_SHAPES, random_model
    from opencomposer.train.samples import Sample
    from opencomposer.train.checkpoint import load_checkpoint, save_checkpoint
    from opencomposer.train.config import TrainConfig
    from opencomposer.train.distributed import gather, init_from_env
    from opencomposer.train.trainer import Trainer

    BASE_SHAPES.update(SHAPES)
    torch.set_num_threads(1)
    d = init_from_env("cpu")
    model = random_model(args.shape, "cpu", torch.float32, seed=0)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>")),
                                  pad_token="<pad>", unk_token="<unk>")
    cfg = TrainConfig(bf16=False, lr=1e-5, checkpoint_format=args.format)
    trainer = Trainer(model, tok, cfg, name=args.shape, dist=d)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g).tolist()
    trainer.sft_step([Sample(input_ids=row, loss_mask=[0] + [1] * 15, old_logprobs=[0.0] * 16) for row in ids])
    ckpt = Path(args.out) / f"{args.format}-{d.world}"
    out: dict[str, Any] = {"format": args.format, "world": d.world, "shape": args.shape,
                           "parameters": sum(p.numel() for p in model.parameters())}
    save = measured(lambda: save_checkpoint(ckpt, trainer, {}, step=1))
    load = measured(lambda: load_checkpoint(ckpt, trainer))
    saves, loads = gather(save, d), gather(load, d)
    if d.main:
        out["checkpoint_mib"] = round(sum(f.stat().st_size for f in (ckpt / "step-0001").rglob("*") if f.is_file())
                                      / 2**20, 1)
        out.update(save=saves, load=loads)
        print(json.dumps(out), flush=True)


def drive(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(os.getcwd(), "src"), os.environ.get("PYTHONPATH")]))}
    for w in [int(x) for x in args.worlds.split(",")]:
        for fmt in args.formats.split(","):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={w}",
                   "-m", "opencomposer.bench.checkpoint", "--worker", "--format", fmt, "--shape", args.shape,
                   "--out", args.out]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            run = json.loads(lines[-1]) if lines else {"format": fmt, "world": w,
                                                       "error": f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"}
            runs.append(run)
            print(json.dumps(run), flush=True)
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny", help=f"inference.bench.SHAPES or {', '.join(SHAPES)}")
    ap.add_argument("--worlds", default="2", help="world sizes, e.g. 1,2")
    ap.add_argument("--formats", default="full,sharded")
    ap.add_argument("--out", default="/tmp/bench_checkpoint", help="where the checkpoints go")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--format", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
    else:
        print(json.dumps({"shape": args.shape, "runs": drive(args)}))


if __name__ == "__main__":
    main()
