"""`opencomposer agent|train|sft|pretrain|train-mtp|export|serve`: run the agent, train it, serve it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from opencomposer.cli.common import SANDBOX_HELP, app, emit, err, fail, known_errors, policy_options, sandbox_backend
from opencomposer.cli.configs import load_for
from opencomposer.config import AgentRunConfig, ConfigError, validate


@app.command()
def agent(
    task_dir: Path = typer.Option(..., "--task", help="a task directory"),
    policy: str = typer.Option("oracle", help="oracle | model | openai"),
    model: Optional[str] = typer.Option(None, help="model name for --policy model/openai"),
    base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible endpoint for --policy openai"),
    api_key: Optional[str] = typer.Option(None, envvar="OPENAI_API_KEY", help="key for --policy openai"),
    sandbox: Optional[str] = typer.Option(None, help=SANDBOX_HELP + "; default: the config's [sandbox] backend, "
                                           "else auto"),
    config: Optional[Path] = typer.Option(None, help="TOML with [agent] limits and [sandbox] backend"),
    transcript: Optional[Path] = typer.Option(None, help="where to write the JSON transcript"),
    verbose: bool = typer.Option(True, help="print each step"),
    max_new_tokens: int = typer.Option(256, min=1, help="--policy model: tokens per turn"),
    temperature: float = typer.Option(0.0, min=0.0, help="--policy model: sampling temperature (0 = greedy)"),
) -> None:
    """Run one episode on a task and print reward, turns, tool calls, invalid calls and time."""
    from rich.markup import escape

    from opencomposer.episode.run import run_task
    from opencomposer.policies import make_policy
    from opencomposer.tasks.format import Task

    try:
        cfg = load_for(config, AgentRunConfig) if config else AgentRunConfig()
        task = Task.load(task_dir)
        sandbox = sandbox_backend(sandbox, "--sandbox", config, "sandbox.backend", cfg.sandbox.backend)
        pol = make_policy(policy, **policy_options(policy, task, model, base_url, api_key, max_new_tokens, temperature))
        transcript = transcript or Path("runs") / "transcripts" / f"{task.id}-{policy}-{int(time.time())}.json"
        transcript.parent.mkdir(parents=True, exist_ok=True)

        def show(step) -> None:
            if verbose:
                for ev in step.tool_events:
                    args = json.dumps(ev.arguments)[:70]
                    state = "ok" if ev.ok else ("[red]invalid[/]" if ev.invalid else "[yellow]error[/]")
                    err.print(f"  turn {step.turn:>2} {ev.name or '?'} {args} -> {state}", highlight=False)

        res = run_task(task, pol, sandbox, cfg.agent, transcript, on_step=show)
    except known_errors() as e:
        fail(e)
    s = res.summary()
    err.print(f"reward {s['reward']}  exit {s['exit_reason']}  turns {s['turns']}  tool calls "
              f"{s['tool_calls']}  invalid {s['invalid_calls']}  {s['seconds']['total']}s  transcript {transcript}")
    for kind, evidence in s["flags"].items():
        err.print(f"[red]flagged {kind}[/] (reward voided): {escape('; '.join(evidence)[:300])}", highlight=False)
    emit({**s, "policy": policy, "sandbox": sandbox, "transcript": str(transcript)})


@app.command()
def train(
    config: Path = typer.Option(..., help="run config (TOML), e.g. configs/train/demo.toml"),
    resume: bool = typer.Option(False, help="continue from the run directory's latest checkpoint"),
    steps: Optional[int] = typer.Option(None, help="override run.steps"),
    out_dir: Optional[str] = typer.Option(None, "--out", help="override run.out_dir"),
    sandbox: Optional[str] = typer.Option(None, help="override rollout.backend: " + SANDBOX_HELP),
) -> None:
    """Tasks -> SFT warm start -> GRPO steps -> held-out evals -> report."""
    from opencomposer.rl.config import RLRunConfig
    from opencomposer.rl.sampler import PoolExhausted

    try:
        cfg = load_for(config, RLRunConfig)
        if steps is not None:
            cfg.run.steps = steps
        if out_dir is not None:
            cfg.run.out_dir = out_dir
        cfg.rollout.backend = sandbox_backend(sandbox, "--sandbox", config, "rollout.backend", cfg.rollout.backend)
        from opencomposer.pipeline.run import run_pipeline

        def show(row: dict) -> None:
            if err.width >= WIDE_TABLE:
                t = Table(*STEP_COLUMNS, title=f"RL step {row['step']}", title_justify="left")
                t.add_row(*(_cell(row.get(c)) for c in STEP_COLUMNS))
                err.print(t)
            else:  # a table would cut its cells short here (a log file is 80 columns): one line instead
                err.print(step_line(row), highlight=False)

        result = run_pipeline(cfg, resume=resume, log=lambda m: err.print(m, highlight=False), on_step=show)
    except known_errors() + (PoolExhausted,) as e:
        fail(e)
    if "report" in result:  # rank 0's (under torchrun the others only train)
        err.print(f"report: {result['report']}")
    emit(result)


# a step's figures on the console: (metrics key, label on a line, unit)
STEP_LINE = (("reward_mean", "reward", ""), ("pass@1", "pass@1", ""), ("mean_completion_tokens", "tokens", ""),
             ("tool_calls", "tool calls", ""), ("invalid_calls", "invalid calls", ""), ("loss", "loss", ""),
             ("kl", "kl", ""), ("grad_norm", "grad norm", ""), ("time_rollout", "rollout", " s"),
             ("time_train", "train", " s"))
STEP_COLUMNS = ("step", *(k for k, _, _ in STEP_LINE))  # the table's columns: the metrics keys
WIDE_TABLE = 140  # console columns from which the step table shows every cell whole


def _cell(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else "" if v is None else str(v)


def step_line(row: dict) -> str:
    """One RL step's figures on one line (wraps, never cuts a value short)."""
    return f"RL step {row.get('step')}: " + " | ".join(f"{label} {_cell(row.get(k))}{unit}"
                                                      for k, label, unit in STEP_LINE if k in row)


@app.command()
def sft(
    transcripts: list[Path] = typer.Argument(..., help="transcript JSON files or directories of them"),
    model: str = typer.Option("smollm2-135m", help="model to fine-tune"),
    out_dir: Path = typer.Option(Path("runs/sft"), "--out"),
    epochs: int = typer.Option(2, min=1),
    lr: float = typer.Option(5e-5),
    lora: bool = typer.Option(False, help="train LoRA adapters instead of all weights"),
) -> None:
    """SFT on agent traces (loss on assistant tokens only); writes a loadable model dir."""
    from opencomposer.train.config import TrainConfig
    from opencomposer.train.sft import run_sft

    files = [f for p in transcripts for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    try:
        if not files:
            raise ConfigError(f"no transcript files in {[str(p) for p in transcripts]}")
        res = run_sft(files, model, out_dir, TrainConfig(lr=lr, lora=lora), epochs=epochs)
    except known_errors() as e:
        fail(e)
    emit(res)


@app.command("train-mtp")
def train_mtp(
    data: list[Path] = typer.Argument(..., help="source files or directories, .jsonl of {\"text\"}, agent transcripts"),
    model: str = typer.Option("smollm2-135m", help="the base model (frozen) the head drafts for"),
    out_dir: Path = typer.Option(Path("runs/mtp"), "--out", help="writes OUT/head and OUT/checkpoint (resumed)"),
    steps: int = typer.Option(200, min=1),
    depth: int = typer.Option(3, min=1, max=16, help="draft steps trained (the head chained this deep)"),
    lr: float = typer.Option(1e-3),
    batch_size: int = typer.Option(4, min=1),
    seq_len: int = typer.Option(256, min=4, help="tokens per training window"),
    seed: int = typer.Option(0),
) -> None:
    """Train an MTP head by self-distillation for speculative decoding (serve --draft OUT/head)."""
    from opencomposer.models.mtp import MTPError
    from opencomposer.train.mtp import train_mtp as run

    try:
        res = run(model, data, out_dir, steps=steps, depth=depth, lr=lr, batch_size=batch_size, seq_len=seq_len,
                  seed=seed, progress=sys.stderr.isatty())
    except (*known_errors(), MTPError, FileNotFoundError, ValueError) as e:
        fail(e)
    emit(res)


@app.command()
def pretrain(
    data: Optional[list[str]] = typer.Argument(None, help="source files or directories, .jsonl of {\"text\"}; "
                                               "PATH or PATH:WEIGHT (2 = its windows twice a pass)"),
    config: Optional[Path] = typer.Option(None, help="TOML with a pretrain table and a train table (configs/pretrain/pretrain.toml)"),
    model: Optional[str] = typer.Option(None, help="model to continue pretraining (default smollm2-135m)"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="writes OUT/model, OUT/checkpoints (resumed), "
                                           "OUT/result.json (default runs/pretrain)"),
    steps: Optional[int] = typer.Option(None, min=1, help="optimizer steps (default 100)"),
    seq_len: Optional[int] = typer.Option(None, min=2, help="tokens per window (default 256)"),
    batch_size: Optional[int] = typer.Option(None, min=1, help="windows per optimizer step (default 8)"),
    lr: Optional[float] = typer.Option(None, min=0.0, help="peak learning rate (default 1e-4)"),
    warmup_steps: Optional[int] = typer.Option(None, min=0, help="linear warm-up steps, then a cosine (default 10)"),
    eval_every: Optional[int] = typer.Option(None, min=0, help="held-out loss every N steps (default 25)"),
    save_every: Optional[int] = typer.Option(None, min=0, help="checkpoint every N steps (default 50)"),
    eval_data: Optional[list[str]] = typer.Option(None, help="another codebase to measure on, never trained on "
                                                  "(repeatable)"),
    context_factor: Optional[float] = typer.Option(None, min=1.0, help="extend the context this many times by "
                                                   "YaRN RoPE scaling before training (default 1: none)"),
    eval_length: Optional[list[int]] = typer.Option(None, min=2, help="held-out loss also on windows of this many "
                                                    "tokens (repeatable; e.g. the native context and 4x it)"),
) -> None:
    """Continued pretraining: next-token loss on raw code, held-out loss before/after; writes a loadable model dir.
    With --context-factor: a long-context extension (YaRN), measured at --eval-length before and after."""
    from opencomposer.train.checkpoint_files import CheckpointError
    from opencomposer.train.config import PretrainRunConfig
    from opencomposer.train.pretrain import run_pretrain_config

    try:
        cfg = load_for(config, PretrainRunConfig) if config else PretrainRunConfig()
        given = {"data": data, "model": model, "out_dir": str(out_dir) if out_dir else None, "steps": steps,
                 "seq_len": seq_len, "batch_size": batch_size, "lr": lr, "warmup_steps": warmup_steps,
                 "eval_every": eval_every, "save_every": save_every, "eval_data": eval_data,
                 "context_factor": context_factor, "eval_lengths": eval_length}
        merged = cfg.model_dump(exclude_unset=True)  # the command line over the file, checked as one
        merged.setdefault("pretrain", {}).update({k: v for k, v in given.items() if v is not None})
        cfg = validate(merged, PretrainRunConfig, f"{config} + command line" if config else "command line")
        if not cfg.pretrain.data:
            raise ConfigError("no data: give DATA paths, or data in the pretrain table of --config")
        res = run_pretrain_config(cfg, progress=sys.stderr.isatty())
    except (*known_errors(), CheckpointError, FileNotFoundError, ValueError) as e:
        fail(e)
    b, a = res["before"], res["after"]
    if b.get("native_rope"):
        err.print("before: the model as it came (its native RoPE); after: extended and trained", highlight=False)
    for name, v in b.items():
        if isinstance(v, dict) and name in a:  # a measured set ("step", "native_rope" are not)
            err.print(f"{name}: loss {v['loss']} -> {a[name]['loss']} (perplexity {v['perplexity']} -> "
                      f"{a[name]['perplexity']})", highlight=False)
    emit(res)


@app.command("export")
def export(
    checkpoint: Path = typer.Argument(..., help="a checkpoint: a step-NNNN dir, or a run's checkpoints/ dir (its latest)"),
    out_dir: Path = typer.Option(..., "--out", help="the HF model directory to write (replaced atomically)"),
    model: Optional[str] = typer.Option(None, help="the base model the run started from (default: the one the "
                                        "checkpoint names)"),
) -> None:
    """A training checkpoint (full or sharded layout; LoRA merged in) as a loadable model directory."""
    from opencomposer.train.checkpoint_files import CheckpointError
    from opencomposer.train.export import export_checkpoint

    try:
        res = export_checkpoint(checkpoint, out_dir, model)
    except (*known_errors(), CheckpointError, FileNotFoundError) as e:
        fail(e)
    emit(res)


@app.command()
def serve(
    model: str = typer.Option("smollm2-135m", help="model name or path, as for load_model"),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, min=0, max=65535, help="port (0 = any free port; the ready line says which)"),
    served_model_name: Optional[str] = typer.Option(None, help="name clients send as 'model' (default: --model)"),
    max_num_seqs: int = typer.Option(64, min=1, help="sequences the engine runs at once"),
    max_pending: int = typer.Option(256, min=1, help="sequences in flight before requests get 429"),
    max_model_len: Optional[int] = typer.Option(None, min=2, help="context length (default: the model's)"),
    default_max_tokens: Optional[int] = typer.Option(None, min=1, help="chat max_tokens when a request gives none"),
    kv_blocks: Optional[int] = typer.Option(None, min=1, help="KV-cache blocks (default: the engine's)"),
    kv_memory_fraction: float = typer.Option(0.8, min=0.01, max=1.0,
                                             help="share of free GPU memory for the KV cache (without --kv-blocks)"),
    max_num_batched_tokens: Optional[int] = typer.Option(None, min=1, help="new tokens per prefill step"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: the engine's)"),
    log_dir: Optional[str] = typer.Option(None, help="log every session (completions + feedback) as JSONL here"),
    log_window: str = typer.Option("1h", help="one log file per window: 30m, 1h, 5h, ..."),
    ab_model: Optional[str] = typer.Option(None, help="arm b of an A/B split: a second model/checkpoint"),
    ab_fraction: float = typer.Option(0.5, min=0.0, max=1.0, help="share of sessions routed to arm b"),
    api_token: Optional[str] = typer.Option(None, "--api-token", "--admin-token",
                                            envvar=["OPENCOMPOSER_SERVE_TOKEN", "OPENCOMPOSER_ADMIN_TOKEN"],
                                            help="bearer token that /admin/* and /v1/feedback require; prefer the "
                                            "env var OPENCOMPOSER_SERVE_TOKEN (argv is visible to every user). "
                                            "Default: none, admin from loopback only, and a warning at start"),
    weights_from: Optional[str] = typer.Option(None, help="follow a trainer's weight store (directory, "
                                               "file:///path or s3://bucket/prefix): new versions apply in flight"),
    weights_poll: float = typer.Option(1.0, min=0.05, help="seconds between two looks at --weights-from"),
    draft: Optional[str] = typer.Option(None, help="speculative decoding with this MTP head (a directory "
                                        "written by `opencomposer train-mtp`)"),
    num_draft: int = typer.Option(3, min=1, max=16, help="tokens the head drafts per step (with --draft)"),
    spec_max_batch: int = typer.Option(1, min=1, help="with --draft: larger decode batches step plainly (on the 2-core CPU speculation paid at batch 1 only)"),
) -> None:
    """OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics;
    /v1/feedback and /admin/weights for the real-time loop)."""
    from opencomposer.inference.server.app import ServeConfig
    from opencomposer.inference.server.front import serve as run_server
    from opencomposer.realtime.config import parse_duration

    try:
        cfg = ServeConfig(model=model, served_model_name=served_model_name, host=host, port=port,
                          max_num_seqs=max_num_seqs, max_pending=max_pending, max_model_len=max_model_len,
                          default_max_tokens=default_max_tokens, kv_blocks=kv_blocks,
                          kv_memory_fraction=kv_memory_fraction, max_num_batched_tokens=max_num_batched_tokens,
                          dtype=dtype, device=device,
                          log_dir=log_dir, log_window_s=parse_duration(log_window, "--log-window"),
                          ab_model=ab_model, ab_fraction=ab_fraction, api_token=api_token,
                          weights_from=weights_from, weights_poll_s=weights_poll, draft=draft, num_draft=num_draft,
                          spec_max_batch=spec_max_batch)
        run_server(cfg, on_ready=lambda url: emit({"serving": url, "model": served_model_name or model,
                                                   "log_dir": log_dir, "ab_model": ab_model,
                                                   "weights_from": weights_from}))
    except known_errors() as e:
        fail(e)
