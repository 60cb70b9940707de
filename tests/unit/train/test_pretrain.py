"""Continued pretraining (``train/pretrain.py``) and its corpus (``train/corpus.py``) on tiny-random with
real stdlib source files: held-out loss falls, a stopped run resumes to the same weights, the
split is by document, the mix is a pure function of the step, bad input is named."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import pytest
import torch

from opencomposer.config import ConfigError, load_config
from opencomposer.models import load_model
from opencomposer.train.checkpoint_files import CheckpointError
from opencomposer.train.config import PretrainRunConfig
from opencomposer.train.corpus import Document, Mix, pack_corpus, parse_source, read_documents, split_documents
from opencomposer.train.pretrain import lr_at, run_pretrain

STDLIB = Path(string.__file__).parent
FILES = ["string.py", "textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "json/decoder.py", "json/encoder.py",
         "json/scanner.py", "json/__init__.py", "bisect.py", "heapq.py", "keyword.py"]
# small and fast: 4 windows of 32 tokens a step
SMALL = dict(seq_len=32, batch_size=4, eval_windows=8, held_out=0.25, progress=False)


@pytest.fixture
def code(tmp_path) -> Path:
    """Twelve real stdlib modules (about 40k tokens), copied so the paths (and the split) are fixed."""
    d = tmp_path / "code"
    for name in FILES:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(STDLIB / name, d / name)
    return d


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(str(model_dir))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_held_out_loss_falls_and_the_exported_model_loads(code, tmp_path):
    other = tmp_path / "other"  # a different codebase, never trained on
    other.mkdir()
    shutil.copy(STDLIB / "calendar.py", other / "calendar.py")
    res = run_pretrain([code], "tiny-random", tmp_path / "run", steps=24, lr=3e-3, warmup=3, eval_every=12,
                       save_every=0, eval_data=[other], **SMALL)
    before, after = res["before"], res["after"]
    assert [e["step"] for e in res["evals"]] == [0, 12, 24]
    assert after["held_out"]["loss"] < before["held_out"]["loss"] - 1.0, res["evals"]  # from ~ln(49152) = 10.8
    assert after[str(other)]["loss"] < before[str(other)]["loss"]  # code structure carries to other code
    assert after["held_out"]["perplexity"] == pytest.approx(2.718281828 ** after["held_out"]["loss"], rel=1e-3)
    assert res["tokens"] == 24 * 4 * 32 and res["tokens_per_second"] > 0 and res["resumed_from"] == 0
    counts = res["corpus"][str(code)]
    assert counts["documents"] + counts["held_out_documents"] == len(FILES) and counts["held_out_documents"] >= 1
    assert counts["windows"] == res["train_windows"] and counts["share"] == 1.0
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["after"] == after and len(saved["history"]) == 24
    # the export is a plain model directory whose held-out loss is the run's
    model, tok = load_model(str(tmp_path / "run" / "model"))
    assert type(model).__name__ == "LlamaForCausalLM" and tok.eos_token_id is not None
    ckpt = json.loads((tmp_path / "run" / "checkpoints" / "step-0024" / "state.json").read_text())
    assert ckpt["step"] == 24 and ckpt["evals"][-1] == saved["evals"][-1]


def test_a_stopped_run_resumes_at_the_exact_step_to_the_same_weights(code, tmp_path, monkeypatch):
    args = dict(steps=6, lr=1e-3, warmup=2, eval_every=0, save_every=3, **SMALL)
    seen: dict[str, list] = {"whole": [], "resumed": []}
    draw = Mix.batch_for_step

    def recording(key, stop_at=None):
        def batch(self, step):
            if step == stop_at:
                raise KeyboardInterrupt  # a stop after the checkpoint of step 3
            seen[key].append((step, draw(self, step)))
            return seen[key][-1][1]
        return batch

    monkeypatch.setattr(Mix, "batch_for_step", recording("whole"))
    whole = run_pretrain([code], "tiny-random", tmp_path / "a", **args)
    monkeypatch.setattr(Mix, "batch_for_step", recording("resumed", stop_at=4))
    with pytest.raises(KeyboardInterrupt):
        run_pretrain([code], "tiny-random", tmp_path / "b", **args)
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text().strip() == "step-0003"
    seen["resumed"].clear()
    monkeypatch.setattr(Mix, "batch_for_step", recording("resumed"))
    resumed = run_pretrain([code], "tiny-random", tmp_path / "b", **args)
    assert resumed["resumed_from"] == 3 and resumed["tokens"] == 3 * 4 * 32
    assert seen["resumed"] == seen["whole"][3:]  # steps 3, 4, 5: the very batches of the uninterrupted run
    assert resumed["before"] == whole["before"] and resumed["after"] == whole["after"]
    a, b = _weights(tmp_path / "a" / "model"), _weights(tmp_path / "b" / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    history = json.loads((tmp_path / "b" / "result.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert history == json.loads((tmp_path / "a" / "result.json").read_text())["history"]


def test_a_checkpoint_of_other_settings_is_refused(code, tmp_path):
    run_pretrain([code], "tiny-random", tmp_path / "run", steps=2, eval_every=0, save_every=1, **SMALL)
    with pytest.raises(CheckpointError, match=r"state.json: the checkpoint was made with seq_len=32, this run has "
                                              r"seq_len=16; resume with the same settings or use another --out"):
        run_pretrain([code], "tiny-random", tmp_path / "run", steps=4, **{**SMALL, "seq_len": 16})
    with pytest.raises(CheckpointError, match="made with model=tiny-random, this run has model=tiny-random-moe"):
        run_pretrain([code], "tiny-random-moe", tmp_path / "run", steps=4, **SMALL)
    (code / "extra.py").write_text("def more():\n    return 1\n" * 50)
    with pytest.raises(CheckpointError, match="made with corpus="):
        run_pretrain([code], "tiny-random", tmp_path / "run", steps=4, **SMALL)


def test_bad_input_is_named(code, tmp_path):
    with pytest.raises(FileNotFoundError, match="pretrain data: .*nowhere does not exist"):
        run_pretrain([tmp_path / "nowhere"], "tiny-random", tmp_path / "run", **SMALL)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blob.bin").write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="pretrain data .*empty'\\]: no documents found"):
        run_pretrain([empty], "tiny-random", tmp_path / "run", **SMALL)
    one = tmp_path / "one.py"
    shutil.copy(STDLIB / "keyword.py", one)
    with pytest.raises(ValueError, match="1 document \\(one.py\\); the held-out split is by document"):
        run_pretrain([one], "tiny-random", tmp_path / "run", **SMALL)
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.py").write_text("x = 1\n")
    (small / "b.py").write_text("y = 2\n")
    with pytest.raises(ValueError, match="make 0 windows of seq_len=32. Add data or lower --seq-len"):
        run_pretrain([small], "tiny-random", tmp_path / "run", **SMALL)
    with pytest.raises(ValueError, match="held-out documents .* make 0 windows of seq_len=512"):
        run_pretrain([code], "tiny-random", tmp_path / "run", **{**SMALL, "seq_len": 512, "held_out": 0.05})
    with pytest.raises(ValueError, match="seq_len=4096 is longer than tiny-random's context \\(2048 tokens"):
        run_pretrain([code], "tiny-random", tmp_path / "run", **{**SMALL, "seq_len": 4096})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "def f(): pass"}\n{"txt": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with a \"text\" string"):
        run_pretrain([bad], "tiny-random", tmp_path / "run", **SMALL)
    with pytest.raises(ValueError, match="pretrain data 'x.py:-1': weight '-1' must be a positive number"):
        parse_source("x.py:-1", "pretrain data")
    assert not (tmp_path / "run").exists()  # nothing written by a run that could not start


def test_the_split_is_by_document_and_stable(code, tiny):
    _, tok = tiny
    docs = read_documents([parse_source(code)], tok)
    assert len(docs) == len(FILES)
    train, held = split_documents(docs, 0.25, seed=0)
    assert {d.key for d in train}.isdisjoint(d.key for d in held) and len(train) + len(held) == len(docs)
    assert held and train
    # adding documents never moves one already there to the other side
    extra = [Document(0, f"new/{i}.py", [1, 2, 3]) for i in range(40)]
    train2, held2 = split_documents(docs + extra, 0.25, seed=0)
    assert {d.key for d in held} <= {d.key for d in held2} and {d.key for d in train} <= {d.key for d in train2}
    # a .jsonl line is a document of its own; packing keeps the sides apart: each side's windows
    # hold only its own documents' tokens
    packed = pack_corpus([parse_source(code)], tok, 32, 0.25)[0]
    held_tokens = set(torch.cat([torch.tensor(d.ids) for d in held]).tolist())
    train_only = set(torch.cat([torch.tensor(d.ids) for d in train]).tolist()) - held_tokens - {tok.eos_token_id}
    assert train_only and not train_only & set(packed.held_out.flatten().tolist())
    assert packed.documents == len(train) and packed.held_out_documents == len(held)


def test_batches_are_a_pure_function_of_the_step_and_follow_the_weights():
    a, b = torch.arange(40).view(10, 4), torch.arange(100, 120).view(5, 4)
    mix = Mix([a, b], [1.0, 2.0], batch_size=4, seed=7)
    assert mix.pass_len == 20 and mix.shares() == [0.5, 0.5]  # 5 windows of b, twice a pass
    later = Mix([a, b], [1.0, 2.0], batch_size=4, seed=7)
    assert later.batch_for_step(9) == mix.batch_for_step(9)  # no history needed: a fresh mix draws the same
    one_pass = [w for s in range(5) for w in mix.batch_for_step(s)]
    firsts = sorted(w[0] for w in one_pass)
    assert firsts == sorted(list(range(0, 40, 4)) + list(range(100, 120, 4)) * 2)  # each window as often as weighted
    assert mix.batch_for_step(5) != mix.batch_for_step(0) and Mix([a, b], [1.0, 2.0], 4, seed=8).batch_for_step(0) \
        != mix.batch_for_step(0)
    half = Mix([a], [0.5], batch_size=5, seed=0)
    assert half.pass_len == 5 and len({w[0] for s in range(4) for w in half.batch_for_step(s)}) > 5  # new halves


def test_the_schedule_warms_up_then_follows_a_cosine():
    lrs = [lr_at(s, 1e-3, 10, 2, 0.1) for s in range(10)]
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
    assert all(x > y for x, y in zip(lrs[1:], lrs[2:])) and lrs[-1] == pytest.approx(1e-4)
    assert lrs[5] == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half way down the cosine
    assert lr_at(0, 1e-3, 10, 0, 0.1) < 1e-3  # no warm-up: the cosine from the first step


def test_the_config_names_a_second_learning_rate(tmp_path):
    p = tmp_path / "pretrain.toml"
    p.write_text("[pretrain]\ndata = ['src']\nlr = 3e-4\n[train]\nlr = 1e-5\n")
    with pytest.raises(ConfigError, match="set pretrain.lr instead of train.lr"):
        load_config(p, PretrainRunConfig)
    p.write_text("[pretrain]\ndata = ['src']\nseq_len = 1\n")
    with pytest.raises(ConfigError, match="pretrain.seq_len"):
        load_config(p, PretrainRunConfig)


def test_the_command_runs_a_config_with_overrides_and_ends_with_json(code, tmp_path):
    from typer.testing import CliRunner

    from opencomposer.cli import app

    cfg = tmp_path / "pretrain.toml"
    cfg.write_text(f"[pretrain]\ndata = ['{code}']\nmodel = 'tiny-random'\nsteps = 50\nseq_len = 32\nbatch_size = 2\n"
                   "held_out = 0.25\neval_windows = 4\n[train]\nweight_decay = 0.1\n")
    res = CliRunner().invoke(app, ["pretrain", "--config", str(cfg), "--steps", "2", "--out", str(tmp_path / "o"),
                                   "--eval-every", "0"])
    assert res.exit_code == 0, res.output
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert last["steps"] == 2 and last["batch_size"] == 2 and last["model_dir"] == str(tmp_path / "o" / "model")
    assert [e["step"] for e in last["evals"]] == [0, 2]
    res = CliRunner().invoke(app, ["pretrain", str(code), "--model", "tiny-random", "--seq-len", "4096",
                                   "--out", str(tmp_path / "p")])
    assert res.exit_code == 2
    assert json.loads(res.stdout.strip().splitlines()[-1])["error"].startswith("seq_len=4096 is longer than")
