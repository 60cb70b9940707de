"""`opencomposer eval [compare|report]`: suites, the regression gate, reports."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from opencomposer.cli.common import (
    POLICY_KINDS, SANDBOX_HELP, emit, err, fail, known_errors, policy_options, sandbox_backend,
)
from opencomposer.cli.configs import load_for
from opencomposer.config import AgentRunConfig, ConfigError

eval_app = typer.Typer(help="CursorBench-style evaluation: run a suite, compare two runs (the gate), report.")


def _eval_errors() -> tuple[type[BaseException], ...]:
    from opencomposer.eval.results import EvalError, ResultsError
    from opencomposer.eval.suite import SuiteError
    return (SuiteError, ResultsError, EvalError, ValueError, *known_errors())


@eval_app.callback(invoke_without_command=True)
def eval_run(
    ctx: typer.Context,
    suite: Optional[str] = typer.Option(None, help="suite name (configs/suites/NAME.toml), suite file or task dir"),
    model: str = typer.Option("smollm2-135m", help="model name, HF dir or checkpoint dir (--policy model); model id (openai)"),
    k: int = typer.Option(1, help="episodes per task (pass@k)"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="results dir (default runs/eval/SUITE/LABEL)"),
    backend: Optional[str] = typer.Option(None, help=SANDBOX_HELP + "; default: the config's [sandbox] backend, "
                                           "else auto"),
    policy: str = typer.Option("model", help="model (transformers generate) | engine (the built-in inference "
                               "engine: continuous batching, paged and prefix-cached KV, as RL rollouts sample) | "
                               "openai | oracle (the gold patch: a ceiling)"),
    base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible endpoint for --policy openai"),
    api_key: Optional[str] = typer.Option(None, envvar="OPENAI_API_KEY", help="key for --policy openai"),
    label: Optional[str] = typer.Option(None, help="name of this run in reports (default: the model)"),
    config: Optional[Path] = typer.Option(None, help="TOML whose agent table sets the episode limits (and sandbox "
                                          "table the backend)"),
    max_turns: Optional[int] = typer.Option(None, help="override agent.max_turns"),
    max_new_tokens: int = typer.Option(256, help="--policy model|engine: tokens per turn"),
    temperature: Optional[float] = typer.Option(None, help="sampling temperature (default 0 for k=1, 0.7 for k>1)"),
    max_batch: int = typer.Option(8, help="--policy model: episodes batched per generate; engine: episodes "
                                  "in the running batch"),
    device: Optional[str] = typer.Option(None, help="--policy model|engine: cpu | cuda (default: cuda if available)"),
    price: float = typer.Option(0.0, help="USD per million completion tokens (cost)"),
    prompt_price: Optional[float] = typer.Option(None, help="USD per million prompt tokens (default: --price)"),
) -> None:
    """Run a suite: K episodes per task, pass@1 / pass@k / tokens / tool calls / cost -> results.json."""
    if ctx.invoked_subcommand is not None:
        return
    from opencomposer.eval.suite import load_suite

    if suite is None:
        fail(ConfigError("eval: --suite is required (or use `eval compare` / `eval report`)"))
    if k < 1:
        fail(ConfigError(f"--k: expected an integer >= 1, got {k}"))
    if max_turns is not None and max_turns < 1:
        fail(ConfigError(f"--max-turns: expected an integer >= 1, got {max_turns}"))
    temp = temperature if temperature is not None else (0.0 if k == 1 else 0.7)
    try:
        cfg = load_for(config, AgentRunConfig) if config else AgentRunConfig()
        if max_turns is not None:
            cfg.agent.max_turns = max_turns
        s = load_suite(suite)
        backend = sandbox_backend(backend, "--backend", config, "sandbox.backend", cfg.sandbox.backend)  # before a model is loaded
        # a checkpoint dir is named by its last two parts (".../step-3/model" -> "step-3/model")
        name = label or ("oracle" if policy == "oracle" else
                         "/".join(Path(model).parts[-2:]) if Path(model).exists() else model)
        dest = out_dir or Path("runs") / "eval" / s.name / name.replace("/", "_")
        err.print(f"eval {s.name}: {len(s.tasks)} tasks {s.levels()}, k={k}, policy {policy} ({name}), "
                  f"sandbox {backend} -> {dest}", highlight=False)
        from opencomposer.eval.run import (
            run_suite,  # the model stack: only once the input checks out
        )
        with _eval_policy(policy, model, base_url, api_key, max_new_tokens, temp, max_batch, device) as pol:
            res = run_suite(s, pol, k=k, backend=backend, agent_cfg=cfg.agent, label=name, out_dir=dest,
                            price_per_mtok=price, prompt_price_per_mtok=prompt_price)
    except _eval_errors() as e:
        fail(e)
    sm = res["summary"]
    if sm["episode_errors"]:
        err.print(f"[yellow]warning:[/] {sm['episode_errors']} episodes broke before grading (counted as "
                  f"failures; see stop_reason in {dest / 'results.json'})")
    at_k = f"  pass@{k} {sm['pass@k']:.3f}" if k > 1 else ""
    err.print(f"pass@1 {sm['pass@1']:.3f}{at_k}  tokens/ep {sm['mean_completion_tokens']:.0f}  "
              f"tool calls/ep {sm['tool_calls']:.1f}  invalid/ep {sm['invalid_calls']:.2f}  {sm['wall_s']:.0f}s  "
              f"${sm['cost_usd']:.4f}", highlight=False)
    emit({"suite": res["suite"], "label": res["label"], "k": k, "results": str(dest / "results.json"), **sm})


class _eval_policy:
    """The policy for ``eval``: a BatchedPolicy over one model, or a per-episode factory."""

    def __init__(self, kind: str, model: str, base_url: Optional[str], api_key: Optional[str],
                 max_new_tokens: int, temperature: float, max_batch: int, device: Optional[str]):
        self.args = (kind, model, base_url, api_key, max_new_tokens, temperature, max_batch, device)
        self.closer = None

    def __enter__(self):
        from opencomposer.policies import make_policy

        kind, model, base_url, api_key, max_new_tokens, temperature, max_batch, device = self.args
        if kind not in (*POLICY_KINDS, "engine"):
            raise ConfigError(f"--policy {kind!r}: expected model, engine, openai or oracle")
        if kind in ("model", "engine"):
            import torch

            dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
            options = policy_options("model", None, model, base_url, api_key, max_new_tokens, temperature)
            if kind == "engine":  # as rl/engines.rollout_policy builds the rollouts' engine
                from opencomposer.inference.engine.core import Engine
                from opencomposer.models import load_model

                hf, tok = load_model(options.pop("model"), device=dev)
                options["engine"] = Engine.for_agents(hf, tok, max_num_seqs=max_batch, device=dev)
            else:
                options["device"] = dev
            self.closer = make_policy(kind, **options, batch=max_batch)
            return self.closer
        if kind == "openai":  # checks the arguments once, up front
            make_policy(kind, **policy_options(kind, None, model, base_url, api_key))
        return lambda task: make_policy(kind, **policy_options(kind, task, model, base_url, api_key))

    def __exit__(self, *exc):
        if self.closer is not None:
            self.closer.close()


@eval_app.command("compare")
def eval_compare(
    a: Path = typer.Argument(..., help="baseline results.json (or the dir holding it)"),
    b: Path = typer.Argument(..., help="candidate results.json (or the dir holding it)"),
    metric: str = typer.Option("pass@1", help="pass@1 | pass@k | pass@N | mean_completion_tokens | tool_calls | "
                                              "invalid_calls | wall_s | reward"),
    tolerance: float = typer.Option(0.0, help="regression allowed, in the metric's units"),
    confidence: float = typer.Option(0.95, help="bootstrap interval level"),
    n_boot: int = typer.Option(2000, help="bootstrap resamples"),
    seed: int = typer.Option(0, help="bootstrap seed"),
    strict: bool = typer.Option(False, help="non-inferiority: B must show it is within the tolerance"),
    also_a: list[Path] = typer.Option([], "--also-a", help="more results of A's stage pooled with it (another seed: "
                                      "each task's episodes count together); repeatable"),
    also_b: list[Path] = typer.Option([], "--also-b", help="more results of B's stage pooled with it; repeatable"),
) -> None:
    """The regression gate: exit 1 when B is worse than A beyond the tolerance (paired bootstrap over tasks)."""
    from opencomposer.eval.gate import compare
    from opencomposer.eval.results import pool_results

    try:
        ra = pool_results([a, *also_a]) if also_a else a
        rb = pool_results([b, *also_b]) if also_b else b
        r = compare(ra, rb, metric=metric, tolerance=tolerance, confidence=confidence, n_boot=n_boot, seed=seed,
                    strict=strict)
    except _eval_errors() as e:
        fail(e)
    err.print(("[green]PASS[/] " if r.passed else "[red]BLOCKED[/] ") + _markup_escape(r.reason), highlight=False)
    emit(r.to_dict())
    if not r.passed:
        raise typer.Exit(1)


def _markup_escape(text: str) -> str:
    """Rich markup escape for text that may hold square brackets (intervals)."""
    from rich.markup import escape
    return escape(text)


@eval_app.command("report")
def eval_report(
    results: list[Path] = typer.Argument(..., help="results.json files (or dirs holding one)"),
    out_dir: Path = typer.Option(..., "--out", help="where index.html and the PNGs go"),
    title: str = typer.Option("", help="page title"),
) -> None:
    """HTML report + PNGs (score vs tokens, pass@k, per difficulty), rebuilt from results.json alone."""
    from opencomposer.eval.report import build_report

    try:
        page = build_report(results, out_dir, title)
    except _eval_errors() as e:
        fail(e)
    err.print(f"report: {page}", highlight=False)
    emit({"html": str(page), "pngs": sorted(str(p) for p in out_dir.glob("*.png")), "runs": len(results)})
