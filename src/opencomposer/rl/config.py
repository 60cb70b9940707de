"""The root config of `opencomposer train` (RL) and `opencomposer sft`, loaded from TOML.

    cfg = load_config("configs/train/demo.toml", RLRunConfig)

Every table maps to one model below; unknown keys and bad values are errors naming
the file and the key (``config.load_config``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from opencomposer.config import (
    AgentConfig,
    ConfigError,
    LossSection,
    ModelSection,
    RunSection,
    SamplingSection,
    Strict,
    Temperature,
)
from opencomposer.rewards.config import RewardConfig
from opencomposer.train.config import PretrainRunConfig, PretrainSection, TrainConfig


class TasksSection(Strict):
    dir: str = Field(..., description="directory of task directories (made here if empty)")
    sources: list[str] = Field(default_factory=list, description="pypi:NAME==VERSION to make tasks from")
    max_per_source: int = Field(40, ge=1)
    heldout: int = Field(8, ge=0, description="tasks kept out of training, for pass@1 before/after")
    seed: int = 0
    levels: list[Literal["line", "block", "body", "function", "class", "feature"]] = ["body"]
    factory: str | None = Field(None, description="factory config (configs/tasks/factory.toml): with harder_every, "
                                "the trainer asks it for harder tasks as its pass rate rises")
    harder_every: int = Field(0, ge=0, description="every N steps, report the rolling pass@1 to the factory "
                              "(TaskFactory.harder) and add the batch it makes if its levels moved; 0: never")
    pass_window: int = Field(4, ge=1, description="training steps averaged into the rolling pass@1")
    # which unused task comes next (rl/sampler.py; docs/learning.md, "Informative groups")
    sampling: Literal["uniform", "informative"] = Field(
        "uniform", description="uniform: the seeded order. informative: prefer strata of tasks (tasks.strata) whose "
                               "estimated pass rate is nearest tasks.target_pass_rate, estimated from the groups "
                               "trained on")
    target_pass_rate: float = Field(0.5, gt=0, lt=1, description="sampling='informative': the pass rate preferred")
    strata: list[Literal["level", "library"]] = Field(
        ["level"], min_length=1, description="sampling='informative': what a stratum of tasks shares (task.toml "
                                             "feature.level, the library of source)")
    explore: float = Field(0.1, ge=0, le=1, description="sampling='informative': share of draws spread evenly over "
                                                        "the strata, so none starves")
    temperature: float = Field(0.1, gt=0, description="sampling='informative': of the softmax over -|estimate - "
                                                      "target| that weighs the strata; lower is greedier")
    prior_strength: float = Field(2.0, gt=0, description="sampling='informative': rollouts' worth of prior (at "
                                                         "target_pass_rate) in each stratum's Beta estimate")
    estimate_decay: float = Field(0.9, gt=0, le=1, description="sampling='informative': evidence kept at each "
                                                               "update of a stratum (an EMA; 1: a plain Beta posterior)")

    @model_validator(mode="after")
    def _harder_needs_factory(self) -> TasksSection:
        if self.harder_every and not self.factory:
            raise ValueError("tasks.harder_every needs tasks.factory (the factory config to ask for harder tasks)")
        return self


class SandboxPoolSection(Strict):
    """Episode sandboxes from a warm pool (``sandbox/pool.py``) instead of a fresh one each."""

    size: int = Field(16, ge=1, description="most sandboxes alive at once (idle + in use); acquires beyond wait")
    warm: int = Field(1, ge=0, description="idle sandboxes kept ready per task (base image + env)")
    health_check: bool = Field(True, description="exec 'true' before handing a sandbox out")


class RolloutSection(SamplingSection):
    """``[rollout]``: the GRPO groups and how they are sampled (``SamplingSection``'s keys, and these)."""

    k: int = Field(4, ge=1, description="rollouts per task (the GRPO group)")
    tasks_per_step: int = Field(2, ge=1)
    top_p: float = Field(1.0, gt=0, le=1)
    sandbox_pool: SandboxPoolSection | None = Field(
        None, description="e.g. {size = 16, warm = 2}: reuse reset sandboxes of a warm pool; absent: a fresh "
                          "sandbox per episode")
    # 'vllm' / 'sglang': an external server sampling token ids, given each version through its documented
    # update endpoint from weights_dir (policies/vllm.py, policies/sglang.py; docs/serving.md)
    engine: Literal["hf", "builtin", "server", "vllm", "sglang"] = Field(
        "hf", description="'builtin': inference/ engine (paged KV, prefix cache: agent turns are not re-prefilled); "
                          "'hf': transformers generate on the model; 'server': an `opencomposer serve "
                          "--weights-from` process (rollout.base_url, several: rollout.base_urls; fed through "
                          "[sync]); 'vllm' / 'sglang': such a "
                          "server at rollout.base_url, token ids in and out, new weights loaded from "
                          "rollout.weights_dir after each update")
    switch_interval_ms: float | None = Field(
        None, gt=0, le=100, description="rollout.engine='builtin': Python's thread switch interval in this process "
        "(sys.setswitchinterval) once an engine is built, in ms; absent: Python's 5 ms. The engine steps in a thread "
        "beside every episode's thread, and each wait for the device lets an episode thread hold the interpreter up "
        "to this long (benchmarks: `opencomposer bench engine --busy-threads 1 --switch-ms 0.5`)")
    episode_nice: int = Field(0, ge=0, le=19, description="the episodes' threads, and the sandboxes, commands and "
        "graders they start, run this many steps nicer than the process (Linux: per thread), so the built-in "
        "engine's stepping thread is first to a core when they fill every core (session 32: ~13 graders at once "
        "on each arm's 16 cores); 0: as the process. A [rollout] sandbox_pool's sandboxes are made by the pool's "
        "own threads, at the process's priority")
    base_url: str | None = Field(None, description="rollout.engine='server', 'vllm' or 'sglang': the server, e.g. "
                                                   "http://gpu-7:8000/v1")
    # several engines (policies/fanout.py, rl/engines.py; docs/scaling.md, "Several rollout engines")
    engines: int = Field(1, ge=1, description="rollout.engine='builtin': how many engines sample, each its own copy "
                                              "of the weights; a group's K rollouts run on one, the least-loaded when "
                                              "the group starts. 'server': the count of rollout.base_urls")
    engine_devices: list[str] | None = Field(
        None, min_length=1, description="rollout.engine='builtin': the device of each engine, one per engine, e.g. "
                                        "['cuda:0', 'cuda:1']; absent: every engine on the run's device")
    base_urls: list[str] | None = Field(
        None, min_length=1, description="rollout.engine='server', 'vllm' or 'sglang': several servers (`opencomposer "
                                        "serve --weights-from`, vLLM, SGLang), one rollout engine each (instead of "
                                        "rollout.base_url); vLLM/SGLang ones must all read rollout.weights_dir")
    served_model: str | None = Field(None, description="rollout.engine='vllm' or 'sglang': the model the server must "
                                                       "serve (its id or path); absent: [model] name. Another model "
                                                       "is refused at start")
    weights_dir: str | None = Field(None, description="rollout.engine='vllm' or 'sglang': where each version is "
                                                      "written for the server to load (a path it can read); absent: "
                                                      "<run.out_dir>/engine_weights")
    allow_missing_routes: bool = Field(False, description="rollout.engine='vllm' or 'sglang' with a MoE model: train "
                                                          "without router replay when the server returns no routes "
                                                          "(warned at start); false: such a run is refused")
    sync_timeout_s: float = Field(300.0, gt=0, description="rollout.engine='server': how long a step waits for "
                                                           "the server to run the trainer's version")
    max_staleness: int = Field(
        0, ge=0, description="0: synchronous steps (sync weights, collect, train). N >= 1: rollouts run ahead of "
                             "the trainer in a thread, up to N batches, and each update reaches the engine in flight "
                             "(mid-rollout; 'server': published without waiting); a batch whose oldest token is more "
                             "than N versions behind the trainer is dropped (its tasks handed out again). Needs "
                             "engine 'builtin' or 'server' (rl/async_rollouts.py)")
    zero_variance: Literal["keep", "skip", "resample"] = Field(
        "keep", description="groups whose K rewards are all equal (all passed or all failed: every advantage 0). "
                            "keep: trained on (only the KL term moves them). skip: left out of the update. resample: "
                            "left out, and more tasks drawn until the step holds tasks_per_step informative groups "
                            "(max_resample_rounds, max_resample_groups, or the pool's end). Their tasks count as "
                            "used either way (single epoch)")
    zero_variance_on: Literal["shaped", "task"] = Field(
        "shaped", description="what 'all K rewards equal' is judged on for zero_variance skip/resample. shaped: the "
                              "rewards the advantages use (a group whose rollouts all fail the tests but differ in "
                              "shaping terms is trained on). task: the hidden tests' rewards (such a group is left "
                              "out: the update holds only groups with a pass and a fail, each still trained on its "
                              "shaped advantages; session 41's run: 1-3 of 16 groups a step)")
    max_resample_rounds: int = Field(4, ge=0, description="zero_variance='resample': most further collections a step")
    max_resample_groups: int | None = Field(
        None, ge=1, description="zero_variance='resample': most extra groups (tasks) a step draws; absent: "
                                "max_resample_rounds bounds it (each round draws at most tasks_per_step)")
    keep_transcripts: Literal["none", "notable", "all"] = Field(
        "notable", description="the rollouts whose transcripts the run keeps under <out>/transcripts/step-NNNN/, for "
                               "a person to audit what was rewarded: notable = each one the hidden tests passed or a "
                               "monitor flagged (a few a step); all = every one; none (rl/transcripts.py)")
    keep_transcripts_sample: int = Field(
        2, ge=0, description="keep_transcripts='notable': also this many of each step's other rollouts, a seeded "
                             "draw (run seed, step), to read what the policy typically does")

    @property
    def servers(self) -> list[str]:
        """The servers of rollout.engine='server', 'vllm' or 'sglang', one engine each (base_urls, or base_url)."""
        return list(self.base_urls) if self.base_urls else [self.base_url] if self.base_url else []

    @property
    def engine_count(self) -> int:
        """How many rollout engines sample: rollout.engines, or (servers) the count of rollout.base_urls."""
        return len(self.base_urls) if self.base_urls else self.engines

    @model_validator(mode="after")
    def _zero_variance_on(self) -> RolloutSection:
        if self.zero_variance_on == "task" and self.zero_variance == "keep":
            raise ValueError("rollout.zero_variance_on='task' decides which groups skip or resample leave out, but "
                             "rollout.zero_variance is 'keep' (every group trained on): set rollout.zero_variance to "
                             "'skip' or 'resample', or leave zero_variance_on out")
        return self

    @model_validator(mode="after")
    def _several_engines(self) -> RolloutSection:
        n, engine = self.engines, self.engine
        servers = engine in ("server", "vllm", "sglang")  # one engine per server
        if n > 1 and engine == "hf":
            raise ValueError(f"rollout.engines = {n} with rollout.engine='hf': 'hf' samples with the trainer's own "
                             "model; several engines need rollout.engine='builtin' (rollout.engines, "
                             "rollout.engine_devices), or servers: 'server', 'vllm' or 'sglang' (rollout.base_urls)")
        if self.engine_devices is not None:
            if engine != "builtin":
                raise ValueError(f"rollout.engine_devices places built-in engines; rollout.engine is '{engine}' "
                                 "(set rollout.engine='builtin', or leave rollout.engine_devices out)")
            if len(self.engine_devices) != n:
                raise ValueError(f"rollout.engine_devices lists {len(self.engine_devices)} device(s) for "
                                 f"rollout.engines = {n}: give one device per engine")
            blank = [i for i, d in enumerate(self.engine_devices) if not d.strip()]
            if blank:
                raise ValueError(f"rollout.engine_devices[{blank[0]}] is empty: expected a device such as 'cuda:1'")
        if self.base_urls is not None:
            if not servers:
                raise ValueError(f"rollout.base_urls (several servers) needs rollout.engine='server', 'vllm' or "
                                 f"'sglang'; rollout.engine is '{engine}'")
            if self.base_url:
                raise ValueError("rollout.base_url and rollout.base_urls are both set: give the servers in "
                                 "rollout.base_urls alone")
            twice = sorted({u for u in self.base_urls if self.base_urls.count(u) > 1})
            if twice:
                raise ValueError(f"rollout.base_urls lists {twice[0]} more than once: each server is one engine")
            if n not in (1, len(self.base_urls)):
                raise ValueError(f"rollout.engines = {n} but rollout.base_urls lists {len(self.base_urls)} "
                                 f"server(s): with rollout.engine='{engine}' there is one engine per server (leave "
                                 "rollout.engines out)")
        elif servers and n > 1:
            raise ValueError(f"rollout.engines = {n} with rollout.engine='{engine}' needs rollout.base_urls (one "
                             "server per engine)")
        return self


class RLLossSection(LossSection):
    """``[loss]`` of a run: the shared loss keys, and how a group's advantages are scaled."""

    std_normalize: bool = Field(False, description="divide advantages by the group std (only when non-zero)")


Detector = Literal["invalid_call", "no_call", "long_message", "lint", "repeated_call"]
DETECTORS: tuple[str, ...] = Detector.__args__
DEFAULT_DETECTORS = ["invalid_call", "no_call", "long_message", "lint"]  # repeated_call: asked for by name


class FeedbackConfig(Strict):
    """Targeted textual-feedback distillation (``rl/feedback.py``)."""

    enabled: bool = False
    coef: float = Field(0.1, ge=0, description="weight of the distillation KL in the RL loss")
    detectors: list[Detector] = Field(list(DEFAULT_DETECTORS), description="failure points that get a hint "
                                      "(repeated_call: a look-up made again while nothing changed, off by default)")
    long_message_tokens: int = Field(200, ge=1)
    max_points_per_rollout: int = Field(2, ge=1, description="hints per rollout (the first ones)")


class SFTSection(Strict):
    enabled: bool = True
    epochs: int = Field(2, ge=1)
    lr: float = Field(5e-5, gt=0)
    max_traces: int = Field(32, ge=1, description="oracle traces of training tasks used")
    grounded_oracle: bool = Field(False, description="the oracle goes only where its observations point: it "
                                  "searches for the symbol's definition and reads from that line on, not a window "
                                  "around the gold hunk (policies/oracle.py)")


class PretrainStage(PretrainSection):
    """``[pretrain]``: continued pretraining as the pipeline's first stage (off by default).

    The keys of ``opencomposer pretrain --config``'s ``[pretrain]`` table, and its ``[train]``
    table as ``[pretrain.train]`` (same defaults), except ``model`` and ``out_dir``: the stage
    continues pretraining ``[model] name`` into ``<run.out_dir>/pretrain``, and its export is the
    model SFT, RL and the KL reference start from (``pipeline/run.py``).
    """

    enabled: bool = False
    train: TrainConfig = Field(PretrainRunConfig.model_fields["train"].default,
                               description="the optimiser of this stage (lr and warm-up: the pretrain table's)")

    @model_validator(mode="after")
    def _usable(self) -> PretrainStage:
        fixed = sorted(k for k in ("model", "out_dir")  # (set to the default: a dumped config read back)
                       if k in self.model_fields_set and getattr(self, k) != PretrainSection.model_fields[k].default)
        if fixed:
            raise ValueError(f"{' and '.join('pretrain.' + k for k in fixed)}: not used in a run config: the stage "
                             "continues pretraining [model] name and writes <run.out_dir>/pretrain")
        if self.enabled and not self.data:
            raise ValueError("pretrain.enabled = true needs pretrain.data (source files, directories, .jsonl "
                             "files; 'path' or 'path:weight')")
        for d in self.data:
            _source(d, "pretrain.data")  # a bad weight is named now, not after the tasks are made
        if self.held_out <= 0:
            raise ValueError(f"pretrain.held_out = {self.held_out}: the share of documents held out must be above 0")
        default = PretrainRunConfig.model_fields["train"].default
        both = sorted(k for k in ("lr", "warmup_steps")
                      if k in self.train.model_fields_set and getattr(self.train, k) != getattr(default, k))
        if both:  # the schedule is the pretrain table's, as in PretrainRunConfig
            raise ValueError(f"set {' and '.join('pretrain.' + k for k in both)} instead of "
                             f"{' and '.join('pretrain.train.' + k for k in both)}: the schedule of continued "
                             "pretraining is the pretrain table's")
        return self

    def check_paths(self) -> None:
        """Every data and eval_data path exists (relative ones: from the working directory); run
        before the pipeline's first stage, so a typo does not wait for the tasks to be made."""
        for key, specs in (("data", self.data), ("eval_data", self.eval_data)):
            for spec in specs:
                path = _source(spec, f"pretrain.{key}").path
                if not path.exists():
                    raise ConfigError(f"pretrain.{key}: {spec!r}: {path.resolve()} does not exist")

    def run_config(self, model: str, out_dir: str) -> PretrainRunConfig:
        """The ``opencomposer pretrain`` config this stage runs: continue ``model`` into ``out_dir``."""
        keys = set(PretrainSection.model_fields) - {"model", "out_dir"}
        return PretrainRunConfig(pretrain=PretrainSection(**self.model_dump(include=keys), model=model,
                                                          out_dir=out_dir), train=self.train)


def _source(spec: str, what: str):
    from opencomposer.train.corpus import parse_source  # torch and transformers: only once a stage is set

    return parse_source(spec, what)


class EvalSection(Strict):
    stages: list[Literal["base", "sft", "rl"]] = Field(
        ["base", "sft", "rl"], description="when to measure held-out pass@1: base model, after SFT, after RL")
    k: int = Field(1, ge=1, description="samples per held-out task for pass@1")
    temperature: Temperature = 0.0


class SyncSection(Strict):
    """Publish every new policy version to a weight store (``sync/``) for inference workers
    started with ``opencomposer serve --weights-from STORE`` (in another process or machine)."""

    store: str = Field(..., min_length=1, description="a directory, file:///path or s3://bucket/prefix")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="the followers' engine dtype: versions are exact in it")
    full_every: int = Field(20, ge=1, description="a full snapshot every N versions (the others: deltas)")
    keep_full: int = Field(2, ge=1, description="versions older than the N-th newest full snapshot are deleted")
    keep_on: Literal["device", "cpu"] = Field(
        "device", description="where the publisher keeps the last version to diff against ('cpu': pinned host "
                              "memory, 2 bytes a parameter off the trainer's GPU)")


class ClusterSection(Strict):
    """The rollout side on a Ray cluster (``rl/cluster.py``): engine actors and sandbox hosts
    placed on its nodes; the trainer stays where ``opencomposer train`` runs (torchrun's ranks)."""

    ray: str = Field(..., min_length=1, description="the Ray cluster to join: 'auto' (RAY_ADDRESS or the one "
                     "started on this node), 'HOST:PORT', 'ray://HOST:10001', or 'local' (start one here)")
    engines: int = Field(0, ge=0, description="engine actors, each an `opencomposer serve` that follows the [sync] "
                         "store (needs rollout.engine='server', no rollout.base_url(s)); 0: the rollout engines "
                         "of [rollout], in this process")
    engine_gpus: float = Field(0.0, ge=0, description="GPUs each engine actor asks Ray for (0: it runs on CPU)")
    engine_cpus: float = Field(1.0, ge=0, description="CPUs each engine actor asks Ray for")
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the engines' weights ('auto': bfloat16 on a GPU, float32 on CPU)")
    engine_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources each engine "
                                               "actor needs, e.g. {rollout = 1} to keep engines on nodes so marked")
    sandbox_hosts: int = Field(0, ge=0, description="SandboxHost actors that make every rollout's and grader's "
                               "sandboxes (rollout.backend) on their nodes; 0: sandboxes in this process")
    sandbox_cpus: float = Field(0.0, ge=0, description="CPUs each sandbox host asks Ray for (a host mostly waits "
                                "on its sandboxes' processes)")
    sandbox_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources each "
                                                "sandbox host needs")
    spread: bool = Field(True, description="ask Ray to spread the actors over nodes (SPREAD), else pack them")
    local_cpus: int | None = Field(None, ge=1, description="ray='local': CPUs the local Ray offers (default: all)")
    local_gpus: list[int] = Field(default_factory=list, description="ray='local': this machine's GPUs the local Ray "
                                  "may give engines (keep the trainer's out); none: it offers no GPU")
    start_timeout_s: float = Field(300.0, gt=0, description="how long the actors may take to start (model load)")

    @model_validator(mode="after")
    def _something_to_place(self) -> "ClusterSection":
        if not self.engines and not self.sandbox_hosts:
            raise ValueError("[cluster] places nothing: set cluster.engines (engine actors) and/or "
                             "cluster.sandbox_hosts (sandbox host actors), each >= 1")
        if self.ray != "local" and (self.local_cpus is not None or self.local_gpus):
            raise ValueError(f"cluster.local_cpus / local_gpus describe a Ray started here (cluster.ray = 'local'); "
                             f"cluster.ray = {self.ray!r} joins one that exists: set its resources with `ray start`")
        return self


class TrainRunSection(RunSection):
    """``[run]`` of ``opencomposer train``: ``RunSection``'s keys, and the length and checkpoints of the run."""

    out_dir: str = "runs/rl"
    steps: int = Field(3, ge=1)
    save_every: int = Field(1, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    keep_every: int = Field(0, ge=0, description="also keep the weights of every N-th step's checkpoint (no "
                            "optimizer state): milestones a later evaluation reads; 0: none")
    profile_steps: list[int] = Field(default_factory=list, description="RL steps whose update (and the weights "
                                     "gathered after it) torch.profiler records: <out_dir>/profile/step-NNNN.txt, "
                                     "the ops by self device and CPU time, with a JSON line of totals")

    @field_validator("profile_steps")
    @classmethod
    def _positive_steps(cls, v: list[int]) -> list[int]:
        bad = [s for s in v if s < 1]
        if bad:
            raise ValueError(f"run.profile_steps: {bad}: steps count from 1")
        return v


class RLRunConfig(Strict):
    model: ModelSection = ModelSection()
    tasks: TasksSection
    rollout: RolloutSection = RolloutSection()
    agent: AgentConfig = AgentConfig()
    loss: RLLossSection = RLLossSection()
    reward: RewardConfig = RewardConfig()
    feedback: FeedbackConfig = FeedbackConfig()
    train: TrainConfig = TrainConfig()
    pretrain: PretrainStage = PretrainStage()
    sft: SFTSection = SFTSection()
    eval: EvalSection = EvalSection()
    run: TrainRunSection = TrainRunSection()
    sync: SyncSection | None = None
    cluster: ClusterSection | None = None

    @model_validator(mode="after")
    def _cluster_engines_are_servers(self) -> "RLRunConfig":
        c, r = self.cluster, self.rollout
        if c is None:
            return self
        if c.engines:
            if r.engine != "server" or r.servers or r.engines != 1:
                raise ValueError(f"cluster.engines = {c.engines} starts `opencomposer serve` actors that follow the "
                                 "weight store: set rollout.engine = 'server' without rollout.base_url(s) or "
                                 f"rollout.engines (got rollout.engine = {r.engine!r}, base_url(s) "
                                 f"{r.servers or 'none'}, engines = {r.engines})")
            if self.sync is None:
                raise ValueError(f"cluster.engines = {c.engines} needs a [sync] store every node can read (s3://... "
                                 "or a path on a filesystem all nodes mount): the engines take the weights from it")
        if c.sandbox_hosts and r.sandbox_pool is not None:
            raise ValueError("cluster.sandbox_hosts with [rollout.sandbox_pool]: sandboxes come from the hosts' "
                             "actors; drop one of the two")
        return self

    @model_validator(mode="after")
    def _engine_needs_plain_weights(self) -> "RLRunConfig":
        ray_engines = self.cluster is not None and self.cluster.engines
        if self.rollout.engine == "server" and (not (self.rollout.servers or ray_engines) or self.sync is None):
            raise ValueError("rollout.engine='server' needs rollout.base_url (the server; several: "
                             "rollout.base_urls, or cluster.engines actors on Ray) and a [sync] store (the server follows it: opencomposer serve "
                             "--weights-from STORE)")
        if self.rollout.engine in ("vllm", "sglang"):
            r = self.rollout
            if not r.servers:
                raise ValueError(f"rollout.engine='{r.engine}' needs rollout.base_url (the server, e.g. "
                                 "http://gpu-7:8000/v1; several: rollout.base_urls)")
            if self.train.lora:
                raise ValueError(f"rollout.engine='{r.engine}' with train.lora=true: the server loads full weights; "
                                 "train without LoRA")
            if r.max_staleness:
                raise ValueError(f"rollout.engine='{r.engine}' with rollout.max_staleness >= 1: weights reach this "
                                 "server between steps only (its tokens carry no per-token version); use "
                                 "rollout.max_staleness = 0")
        if self.rollout.max_staleness and self.rollout.engine == "hf":
            raise ValueError("rollout.max_staleness >= 1 with rollout.engine='hf': 'hf' samples with the trainer's own "
                             "model object, which the optimizer would change under running rollouts; use "
                             "rollout.engine='builtin' or 'server', or rollout.max_staleness = 0")
        return self  # [sync] with LoRA: followers get whole weights, the adapters merged (Trainer.full_state_dict)
