"""``opencomposer bench sync``: weight sync from a trainer to a decoding engine, by version.

    opencomposer bench sync --shape qwen2.5-1.5b --lrs 1e-6,1e-5 --steps 3
    PYTHONPATH=src python -m opencomposer.bench.sync --shape tiny --device cpu    # quick check

A randomly initialised model of the shape trains in fp32 (AdamW on random tokens: real
optimizer steps, so which bf16 values move is what a run moves), and after every step its
weights are published to a directory store as the differences from the last version
(``sync.WeightPublisher``). An engine built from the initial weights, in bf16, decodes a
batch of sequences in a background thread the whole time and follows the store
(``sync.WeightSubscriber``): each version is applied between two of its steps. The
trainer's side (train step, publish) runs with the decoder paused, as in a separate
trainer process; the follower's side runs while the engine decodes, as in ``serve``.

Per version: the share of bf16 values that changed, bytes stored against the bf16 model's
bytes, the publisher's seconds (the blob: compare + gather on the device, compress, write, overlapped; then the checksums and the manifest), the
follower's seconds (read + decompress + to the device; the engine's pause; the checksum
check), whether the engine's weights are then bit-identical to the trainer's (every
tensor compared), and the decode steps the engine ran while it happened. Baseline, same
run: the full bf16 state dict through safetensors (write, read, ``Engine.update_weights``),
what ``POST /admin/weights`` does. The last line printed is one JSON object.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from opencomposer.bench.toolkit import SHAPES, _sync, emit, random_model
from opencomposer.inference.engine.core import Engine, SamplingParams
from opencomposer.sync import codec
from opencomposer.sync.publisher import WeightPublisher
from opencomposer.sync.store import FileStore
from opencomposer.sync.subscriber import WeightSubscriber


def _exact(engine: Engine, model, dtype: torch.dtype) -> bool:
    sd = model.state_dict()
    views = engine.weight_views({k: v.shape for k, v in sd.items()})
    return all(torch.equal(codec.bits(v), codec.bits(sd[k].to(dtype))) for k, v in views.items())


class _Decoder:
    """Keeps ``batch`` sequences decoding on the engine in a thread; records step times."""

    def __init__(self, engine: Engine, batch: int, vocab: int):
        self.engine, self.times, self.stop = engine, [], threading.Event()
        self.go = threading.Event()  # cleared: the thread waits between steps (the trainer has the GPU)
        self.go.set()
        g = torch.Generator().manual_seed(0)
        self.prompts = [torch.randint(0, vocab, (64,), generator=g).tolist() for _ in range(batch)]
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        params = SamplingParams(max_tokens=1024, temperature=1.0)  # aborted after 256 steps
        while not self.stop.is_set():
            rids = [self.engine.add_request(p, params) for p in self.prompts]
            for _ in range(256):
                if self.stop.is_set():
                    break
                self.go.wait()
                t = time.perf_counter()
                self.engine.step()
                self.times.append((t, time.perf_counter()))
            for r in rids:
                self.engine.abort(r)
            while self.engine.has_unfinished():
                self.engine.step()

    def between(self, t0: float, t1: float) -> list[float]:
        return [b - a for a, b in self.times if a >= t0 and b <= t1]


def run(shape: str = "qwen2.5-1.5b", device: str = "cuda", lrs: tuple[float, ...] = (1e-6, 1e-5), steps: int = 3,
        batch: int = 4, seq: int = 512, decode_batch: int = 16, level: int = 3, store_dir: str | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {sorted(SHAPES)}")
    dtype = torch.bfloat16
    trainer = random_model(shape, device, torch.float32).train()
    vocab = trainer.config.vocab_size
    engine = Engine(trainer, None, dtype=dtype, max_num_seqs=decode_batch, max_model_len=2048)
    tmp = tempfile.TemporaryDirectory(dir=store_dir)
    store = FileStore(Path(tmp.name) / "store")
    pub, sub = WeightPublisher(store, dtype=dtype, full_every=10**6, level=level), WeightSubscriber(store)
    out: dict[str, Any] = {"bench": "sync", "shape": shape, "device": str(device),
                           "gpu": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else None,
                           "torch": torch.__version__, "params": sum(p.numel() for p in trainer.parameters()),
                           "train_batch": [batch, seq], "decode_batch": decode_batch, "level": level}
    raw = sum(t.numel() * 2 for t in pub.tensors(trainer.state_dict()).values())
    out["bf16_mb"] = raw / 2**20

    # baseline: the whole bf16 state dict through safetensors, as POST /admin/weights loads it
    from safetensors.torch import load_file, save_file
    path = Path(tmp.name) / "model.safetensors"
    sd = {k: v.detach().to(dtype).contiguous() for k, v in pub.tensors(trainer.state_dict()).items()}
    _sync(device)
    t0 = time.perf_counter()
    save_file({k: v.cpu() for k, v in sd.items()}, str(path))
    t1 = time.perf_counter()
    loaded = load_file(str(path))
    t2 = time.perf_counter()
    engine.update_weights(loaded, 0)
    _sync(device)
    out["baseline_full_safetensors"] = {"mb": path.stat().st_size / 2**20, "save_s": t1 - t0, "load_s": t2 - t1,
                                        "update_s": time.perf_counter() - t2}
    del sd, loaded
    path.unlink()
    log(f"baseline: {out['baseline_full_safetensors']}")

    first = pub.publish(trainer.state_dict(), 0)
    applied = sub.poll(engine)
    out["full"] = {**{k: first[k] for k in ("stored_bytes", "compression", "blob_s", "commit_s")},
                   **{k: applied[k] for k in ("fetch_decode_s", "pause_s", "verify_s")},
                   "exact": _exact(engine, trainer, dtype)}
    log(f"full snapshot: {out['full']}")

    decoder = _Decoder(engine, decode_batch, vocab)
    decoder.thread.start()
    g = torch.Generator(device=device).manual_seed(1)
    version, rows = 0, []
    try:
        time.sleep(1.0)  # the decoder's first steps (graph warm-up) out of the way
        for lr in lrs:
            opt = torch.optim.AdamW(trainer.parameters(), lr=lr, weight_decay=0.0)
            for _ in range(steps):
                # the trainer's side runs alone (in a real run it is another process or machine);
                # the follower's side runs while the engine decodes, as in a serving process
                decoder.go.clear()
                ids = torch.randint(0, vocab, (batch, seq), device=device, generator=g)
                loss = trainer(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                version += 1
                _sync(device)
                t0 = time.perf_counter()
                p = pub.publish(trainer.state_dict(), version)
                t1 = time.perf_counter()
                decoder.go.set()
                a = sub.poll(engine)
                t2 = time.perf_counter()
                during = decoder.between(t1, t2)
                row = {"version": version, "lr": lr, "changed_fraction": p["changed_fraction"],
                       "stored_mb": p["stored_bytes"] / 2**20, "compression": p["compression"],
                       "publish_s": t1 - t0, "blob_s": p["blob_s"], "commit_s": p["commit_s"],
                       "fetch_decode_s": a["fetch_decode_s"], "pause_s": a["pause_s"], "verify_s": a["verify_s"],
                       "follow_s": t2 - t1, "decode_steps_during_follow": len(during),
                       "exact": _exact(engine, trainer, dtype)}
                rows.append(row)
                log(f"v{version} lr {lr:g}: changed {100 * row['changed_fraction']:.2f}%, "
                    f"{row['stored_mb']:.1f} MB ({row['compression']:.1f}x), publish {row['publish_s']:.3f} s, "
                    f"follow {row['follow_s']:.3f} s (pause {row['pause_s'] * 1e3:.1f} ms), exact {row['exact']}")
            del opt
    finally:
        decoder.stop.set()
        decoder.go.set()
        decoder.thread.join(60)
        tmp.cleanup()
    steps_all = [b - a for a, b in decoder.times]
    out["versions"] = rows
    out["decode_step_ms_median"] = 1e3 * statistics.median(steps_all) if steps_all else None
    out["decode_steps"] = len(steps_all)
    out["all_exact"] = out["full"]["exact"] and all(r["exact"] for r in rows)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lrs", default="1e-6,1e-5", help="learning rates, each for --steps versions")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", default="4x512", help="train batch: sequences x tokens")
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--level", type=int, default=3, help="zstd level")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    b, s = (int(v) for v in a.batch.split("x"))
    emit(run(a.shape, a.device, tuple(float(x) for x in a.lrs.split(",")), a.steps, b, s, a.decode_batch, a.level),
         a.out)


if __name__ == "__main__":
    main()
