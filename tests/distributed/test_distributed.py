"""The FSDP2 trainer on 2 gloo ranks (torchrun, CPU) against the same steps in one process:
N ranks must give the single-process update, and their checkpoints must resume anywhere.
The ranks run tests/testkit/dist_worker.py; the GPU twin (NCCL) is tests/gpu/test_distributed_cuda.py.

Run: ``pytest tests/distributed/test_distributed.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opencomposer.models import load_model
from opencomposer.train.samples import Sample
from opencomposer.train import TrainConfig, Trainer, frozen_copy, load_checkpoint, save_checkpoint
from opencomposer.train.distributed import SINGLE, split

from testkit.dist_worker import WORKER, assert_same, steps, torchrun
from testkit.train_data import rollout_samples

pytestmark = pytest.mark.usefixtures("one_thread")  # testkit/train_data.py: the in-process steps on one thread

CFG = {"bf16": False, "lr": 1e-3, "temperature": 1.0, "micro_batch_tokens": 64}


@pytest.fixture(scope="module")
def data():
    """Sampled one-turn rollouts of uneven lengths, and feedback pairs (the same completion
    after a longer context), so that the two ranks' shares need different pass counts."""
    model, tok = load_model("tiny-random")
    samples = rollout_samples(model, tok, n=5, max_new_tokens=12)
    samples[1].advantage = 0.5
    pairs = [(s, Sample(input_ids=[7, 8, 9] + s.input_ids, loss_mask=[0, 0, 0] + s.loss_mask,
                        old_logprobs=[0.0] * 3 + s.old_logprobs, advantage=0.0))
             for s in samples[:3]]
    return {"samples": samples, "pairs": pairs, "normalizer": 200.0, "cfg": CFG}


def one_process(data: dict, device: str = "cpu") -> tuple[Trainer, list[dict]]:
    trainer = Trainer(*load_model("tiny-random", device=device), TrainConfig(**data["cfg"]), dist=SINGLE)
    return trainer, steps(trainer, data)


def test_two_ranks_make_the_single_process_update(data, tmp_path):
    lengths = [len(s) for s in data["samples"]]
    shares = split(lengths, 2)
    assert sorted(sum(shares, [])) == list(range(5)) and len(shares[0]) != len(shares[1])  # uneven: idle passes run
    got = torchrun("steps", data, tmp_path)
    trainer, metrics = one_process(data)
    # each rank holds half the parameters; metrics are summed over ranks
    assert got["sharded_params"] < 0.6 * sum(p.numel() for p in trainer.params)
    for mine, theirs in zip(metrics, got["metrics"]):
        for key in ("loss", "tokens", "loss_tokens", "grad_norm", "distill_kl", "distill_tokens", "kl", "ratio_max"):
            if key in mine:
                assert theirs[key] == pytest.approx(mine[key], rel=1e-4, abs=1e-6), key
    assert got["metrics"][0]["grad_norm"] > 0 and got["metrics"][1]["version"] == 2
    assert_same(got["weights"], trainer)


def test_two_ranks_with_muon_make_the_single_process_update(data, tmp_path):
    """``optimizer = "muon"`` sharded: each matrix's Nesterov term gathered whole, orthogonalized,
    each rank's rows applied; the same weights as one process's Muon + AdamW steps."""
    muon = {**data, "cfg": {**CFG, "optimizer": "muon"}}
    got = torchrun("steps", muon, tmp_path)
    trainer, metrics = one_process(muon)
    assert type(trainer.optimizer).__name__ == "MuonAdamW"
    for mine, theirs in zip(metrics, got["metrics"]):
        assert theirs["loss"] == pytest.approx(mine["loss"], rel=1e-4, abs=1e-6)
    assert_same(got["weights"], trainer)
    adamw, _ = one_process(data)  # and Muon moved the weights otherwise than AdamW would
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(trainer.params, adamw.params))


def test_two_ranks_with_a_sharded_kl_reference_make_the_single_process_update(data, tmp_path):
    got = torchrun("kl", data, tmp_path)
    model, tok = load_model("tiny-random")
    ref = frozen_copy(model)
    trainer = Trainer(model, tok, TrainConfig(**data["cfg"]), dist=SINGLE)
    metrics = steps(trainer, data, ref) + steps(trainer, data, ref)
    assert metrics[2]["kl"] != 0  # the second update saw a policy that had moved from the reference
    for mine, theirs in zip(metrics, got["metrics"]):
        for key in ("loss", "kl", "grad_norm"):
            if key in mine:
                assert theirs[key] == pytest.approx(mine[key], rel=1e-4, abs=1e-6), key
    assert_same(got["weights"], trainer)


def test_rank_0s_result_and_its_failure_reach_every_rank(tmp_path):
    torch.save({}, tmp_path / "data.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(WORKER), "on_main", str(tmp_path / "data.pt"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    zero, one = (torch.load(tmp_path / f"on_main-{r}.pt") for r in (0, 1))
    assert zero["from"] == one["from"] == "rank 0"
    assert zero["raised"] == "OSError: disk full"  # rank 0: its own error, as one process would raise it
    assert one["raised"] == "ValueError: rank 0 could not write: OSError: disk full"  # the others: named, not a hang


def test_leaving_stops_the_group_threads_of_a_sharded_model(data, tmp_path):
    """A gloo thread still running at interpreter exit aborted its rank now and then ("terminate
    called without an active exception"): the teardown at exit must stop them, even though
    DTensor's caches keep the FSDP mesh (and so the group) alive."""
    zero = torchrun("leave", data, tmp_path)["threads"]
    one = torch.load(tmp_path / "leave-1.pt")["threads"]
    for threads in (zero, one):
        assert "python" in threads and not [t for t in threads if "gloo" in t], threads


def test_a_checkpoint_of_two_ranks_resumes_in_one_process_and_on_two_ranks(data, tmp_path):
    got = torchrun("save", data, tmp_path)
    # one process: resume from the 2-rank checkpoint, run the second round of steps
    trainer = Trainer(*load_model("tiny-random"), TrainConfig(**data["cfg"]), dist=SINGLE)
    state = load_checkpoint(tmp_path / "ckpt", trainer)
    assert state["note"] == "from 2 ranks" and trainer.version == 2
    steps(trainer, data)
    assert_same(got["weights"], trainer)  # optimizer moments came through: same as never stopping
    exported = load_model(str(tmp_path / "model"))[0]
    assert_same(exported.state_dict(), trainer)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:  # a tied weight written once
        assert "lm_head.weight" not in set(f.keys()) and "model.embed_tokens.weight" in set(f.keys())
    # two ranks: resume from a checkpoint written by one process
    single = Trainer(*load_model("tiny-random"), TrainConfig(**data["cfg"]), dist=SINGLE)
    steps(single, data)
    save_checkpoint(tmp_path / "ckpt1", single, {"note": "from 1 process"}, step=1)
    resumed = torchrun("resume", {**data, "checkpoint": str(tmp_path / "ckpt1")}, tmp_path)
    assert resumed["state"]["note"] == "from 1 process" and resumed["version"] == 2
    steps(single, data)
    assert_same(resumed["weights"], single)


def test_a_checkpoint_before_the_first_step_leaves_the_optimizer_as_it_was(data, tmp_path):
    """Saving before any optimizer step must not create AdamW state (DSD does, by a zero-lr step:
    the moments' step count would then start at 1 and every later update differ). Both the
    run that saved and a run resumed from its checkpoint make the single-process updates."""
    got = torchrun("save_first", data, tmp_path)
    trainer, _ = one_process(data)
    assert_same(got["weights"], trainer)
    saved = torch.load(tmp_path / "ckpt0" / "step-0000" / "optimizer.pt", weights_only=True)
    assert saved["state"] == {}
    resumed = Trainer(*load_model("tiny-random"), TrainConfig(**data["cfg"]), dist=SINGLE)
    assert load_checkpoint(tmp_path / "ckpt0", resumed)["note"] == "before any step"
    steps(resumed, data)
    assert_same(got["weights"], resumed)
    again = torchrun("resume", {**data, "checkpoint": str(tmp_path / "ckpt0")}, tmp_path)  # and on 2 ranks
    assert again["state"]["note"] == "before any step"
    assert_same(again["weights"], trainer)


SHARDED = {**CFG, "checkpoint_format": "sharded"}


def test_a_sharded_checkpoint_resumes_exactly_on_two_ranks_in_one_process_and_back(data, tmp_path):
    """Each rank writes its own shards (DCP); the layout is read from the files, so a trainer
    set up for the full layout resumes it too, on any number of ranks."""
    got = torchrun("save", {**data, "cfg": SHARDED}, tmp_path)  # steps, a checkpoint, steps, an export
    step = tmp_path / "ckpt" / "step-0001"
    assert sorted(p.name for p in step.iterdir()) == ["rng-ranks.pt", "rng.pt", "shards", "state.json", "trainer.json"]
    assert sorted(p.name for p in (step / "shards").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    meta = json.loads((step / "trainer.json").read_text())
    assert (meta["layout"], meta["world_size"], meta["config"]["checkpoint_format"]) == ("sharded", 2, "sharded")
    assert len(torch.load(step / "rng-ranks.pt", weights_only=True)) == 2
    # the export is gathered as before: one safetensors file, a tied weight written once
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys()) and "model.embed_tokens.weight" in set(f.keys())
    exported = load_model(str(tmp_path / "model"))[0].state_dict()
    assert all(torch.equal(exported[k], got["weights"][k]) for k in exported)

    # 2 -> 2: bit for bit what the uninterrupted run computed
    resumed = torchrun("resume", {**data, "cfg": SHARDED, "checkpoint": str(tmp_path / "ckpt")}, tmp_path)
    assert resumed["state"]["note"] == "from 2 ranks" and resumed["version"] == 2
    assert all(torch.equal(resumed["weights"][k], got["weights"][k]) for k in got["weights"])
    # 2 -> 1, by a trainer set up for the full layout: the files say which they are
    trainer = Trainer(*load_model("tiny-random"), TrainConfig(**CFG), dist=SINGLE)
    assert load_checkpoint(tmp_path / "ckpt", trainer)["note"] == "from 2 ranks" and trainer.version == 2
    steps(trainer, data)
    assert_same(got["weights"], trainer)
    # 1 -> 2: one process writes one shard file; two ranks resume from it
    single = Trainer(*load_model("tiny-random"), TrainConfig(**SHARDED), dist=SINGLE)
    steps(single, data)
    path = save_checkpoint(tmp_path / "ckpt1", single, {"note": "from 1 process"}, step=1)
    assert sorted(p.name for p in (path / "shards").iterdir()) == [".metadata", "__0_0.distcp"]
    resumed = torchrun("resume", {**data, "checkpoint": str(tmp_path / "ckpt1")}, tmp_path)
    assert resumed["state"]["note"] == "from 1 process" and resumed["version"] == 2
    steps(single, data)
    assert_same(resumed["weights"], single)


def test_a_failed_shard_write_or_a_lost_shard_is_an_error_on_every_rank(data, tmp_path):
    """Rank 1 cannot write: both ranks raise, naming the rank and the cause, and the previous
    checkpoint stays the newest, no temp dir left. Then a lost shard file: both ranks name it."""
    torchrun("save_fails", {**data, "cfg": SHARDED}, tmp_path)
    ckpt = tmp_path / "ckpt"
    for rank in (0, 1):
        failed_save, lost_shard = torch.load(tmp_path / f"errors-{rank}.pt")
        assert "step-0002" in failed_save and "rank 1: OSError: [Errno 28] No space left on device" in failed_save
        assert "shards: shard files missing: __1_0.distcp" in lost_shard and "step-0001" in lost_shard
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-0001"]  # no step-0002, no temp dir
    assert (ckpt / "latest").read_text().strip() == "step-0001"


def test_sft_command_under_torchrun_prints_one_result_and_exports(tmp_path, transcripts):
    """`torchrun -m opencomposer.cli sft` as a user runs it: one JSON line (rank 0's), a
    model directory that loads, and the losses of the same run in one process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["sft", str(transcripts[0].parent), "--model", "tiny-random", "--epochs", "2", "--lr", "3e-3"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "opencomposer.cli", *args, "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, proc.stdout  # rank 1 prints nothing
    two = json.loads(lines[0])
    assert two["world_size"] == 2 and two["steps"] == 2 and two["samples"] == 2
    one = json.loads(subprocess.run([sys.executable, "-m", "opencomposer.cli", *args, "--out", str(tmp_path / "one")],
                                    env=env, capture_output=True, text=True, timeout=600).stdout.splitlines()[-1])
    assert one["world_size"] == 1
    # same batches, the same update; bf16 autocast where the CPU has it: agree to its rounding
    assert two["losses"] == pytest.approx(one["losses"], rel=2e-2)
    model, _ = load_model(two["export"])
    assert sum(p.numel() for p in model.parameters()) > 0


def test_pretrain_command_on_two_ranks_makes_the_single_process_model(tmp_path):
    """`torchrun -m opencomposer.cli pretrain`: each rank trains half of every global batch;
    the exported model and the held-out loss are the single process's (fp32)."""
    import shutil
    import sysconfig

    code = tmp_path / "code"
    code.mkdir()
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py"):
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, code / name)
    cfg = tmp_path / "cpt.toml"
    cfg.write_text(f"[pretrain]\ndata = ['{code}']\nmodel = 'tiny-random'\nsteps = 3\nseq_len = 32\nbatch_size = 4\n"
                   "held_out = 0.3\neval_windows = 4\neval_every = 0\nlr = 3e-3\nwarmup_steps = 1\n[train]\nbf16 = false\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = []
    for nproc, out in ((2, tmp_path / "two"), (1, tmp_path / "one")):
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m"] if nproc > 1 else ["-m"]
        proc = subprocess.run([sys.executable, *launch, "opencomposer.cli", "pretrain", "--config", str(cfg),
                               "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        assert len(lines) == 1, proc.stdout
        results.append(json.loads(lines[0]))
    two, one = results
    assert (two["world_size"], one["world_size"]) == (2, 1)
    assert two["after"]["held_out"]["loss"] != two["before"]["held_out"]["loss"]  # it trained
    assert two["after"]["held_out"]["loss"] == pytest.approx(one["after"]["held_out"]["loss"], abs=1e-4)
    a, b = load_model(two["model_dir"])[0].state_dict(), load_model(one["model_dir"])[0].state_dict()
    start = load_model("tiny-random")[0].state_dict()
    assert max(float((b[k] - start[k]).abs().max()) for k in b) > 1e-3
    worst = max(float((a[k] - b[k]).abs().max()) for k in b)
    assert worst < 1e-5, worst


def test_what_lives_on_rank_0_alone_is_an_absent_stand_in_elsewhere():
    """``main_only``: rank 0 builds the object; another rank never calls ``make`` and holds a
    stand-in whose calls do nothing (so one program drives every rank, no rank tests)."""
    from opencomposer.train.distributed import Absent, Dist, main_only

    made = []

    def make() -> list:
        made.append(1)
        return made

    assert main_only(SINGLE, make) is made and main_only(Dist(0, 2), make) is made and made == [1, 1]
    other = main_only(Dist(1, 2), make)
    assert isinstance(other, Absent) and made == [1, 1]
    assert other.publish({"w": 1}, version=3) is None and other.sampler.state() is None
    assert other.next_batch is other  # a method to pass to on_main, which never runs it off rank 0
    assert not hasattr(other, "__len__")  # no dunders faked: copy, pickle and len see a plain object
