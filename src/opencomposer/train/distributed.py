"""torch.distributed for the trainer: the process group torchrun describes, FSDP2 sharding,
and how one optimizer step's samples are split over the ranks.

    torchrun --nproc-per-node 4 -m opencomposer.cli sft runs/oracle --model M --out runs/sft
    torchrun --nproc-per-node 4 -m opencomposer.cli pretrain src/ --model M --out runs/cpt

Every rank runs the same program. ``Trainer`` (``train/trainer.py``) joins the group at
construction (``init_from_env``), shards its model with FSDP2 (``shard_model``: each
decoder layer, then the root; parameters, gradients and AdamW state are 1/world per rank,
all-gathered layer by layer for the forward and backward), and from then on every
``*_backward`` call takes the step's WHOLE sample list on every rank and trains on this
rank's share (``split``). The shares are balanced by tokens and are a pure function of the
list, so every rank agrees on them without talking.

Two rules make N ranks compute exactly what one process would:

* gradients are summed over ranks, not averaged (FSDP2 divides by the world size by
  default; ``shard_model`` turns that off), because each loss already divides by a
  constant that covers the whole step (``train/loss.py``: no per-sequence normalisation);
* every rank runs the same number of forward/backward passes: FSDP2 all-gathers inside
  each one, so a rank with fewer micro-batches would leave the others waiting forever.
  ``Trainer`` pads the shorter ranks with zero-weight passes (``equal_count``).

Which rank does what is decided here and only here: ``on_main`` runs a function on rank 0
and hands its result (or its error) to every rank; ``main_only`` builds an object on rank 0
alone (the RL actor: engine, sandboxes, logs) and gives the other ranks an ``Absent``
stand-in, so the code that drives both (``rl/run.py``) is one program without rank tests.

Checkpoints are in the single-process format by default (``train/checkpoint.py`` gathers
full tensors to rank 0, which writes), or with ``[train] checkpoint_format = "sharded"`` each
rank writes its own shards (DCP); either way a run saved on 8 ranks resumes on 1 and vice versa.

On CUDA the backend is NCCL and FSDP2 all-gathers parameters in bf16 (fp32 master weights
and fp32 gradient reduction); on CPU it is gloo, which is what the tests use.

Test: ``pytest tests/distributed/test_distributed.py`` (2 ranks on gloo).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Dist:
    """Where this process stands: rank ``rank`` of ``world`` (1 = not distributed)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        """The rank that writes files, prints results and runs rollouts."""
        return self.rank == 0


SINGLE = Dist()


def current() -> Dist:
    """The process group this process is already in, or ``SINGLE``."""
    if not (dist.is_available() and dist.is_initialized()):
        return SINGLE
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env(device: str | torch.device | None = None, timeout_s: float = 1800.0) -> Dist:
    """Join the group torchrun set up in the environment (once per process); without
    torchrun (``WORLD_SIZE`` unset or 1) this is a plain process: ``SINGLE``.

    The backend follows the device: NCCL for CUDA (each rank on ``cuda:LOCAL_RANK``),
    gloo otherwise. A half-set environment is an error naming what is missing.
    """
    if dist.is_available() and dist.is_initialized():
        return current()
    if not launched_by_torchrun():
        return SINGLE
    missing = [k for k in ENV_KEYS if k not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} not set: start "
                           "distributed runs with torchrun (e.g. torchrun --nproc-per-node 4 -m opencomposer.cli ...)")
    local = int(os.environ["LOCAL_RANK"])
    cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if cuda:
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local} but this host has {torch.cuda.device_count()} CUDA devices")
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s),
                            **({"device_id": torch.device("cuda", local)} if cuda else {}))
    atexit.register(_leave)
    return current()


def _leave() -> None:
    """The group torn down, and its threads stopped, while the interpreter is still whole.

    A gloo worker thread still releasing a finished collective's tensors takes the GIL to drop
    their Python objects; once the interpreter finalizes, CPython ends such a thread with
    pthread_exit, whose unwinding through C++ aborts the rank ("terminate called without an
    active exception": about 1 exit in 20 on 2 CPU ranks when the group was left to static
    destructors). Gloo stops its threads only when the group object is freed, and
    ``destroy_process_group`` does not free it while a ``DeviceMesh`` holds it: DTensor's
    sharding caches keep the FSDP mesh alive and the mesh its groups, so those are let go too.
    """
    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()  # sharded modules no longer used, held only in reference cycles, drop the group
    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            # the last reference to the group: freeing it joins its threads, here
            getattr(obj, "_pg_registry", {}).clear()


def rank_device(d: Dist, device: str | torch.device) -> torch.device:
    """This rank's device: ``cuda`` means ``cuda:LOCAL_RANK`` under torchrun."""
    dev = torch.device(device)
    if dev.type == "cuda" and d.enabled and dev.index is None:
        return torch.device("cuda", d.local_rank)
    return dev


def shard_model(model: Any, d: Dist, device: torch.device, bf16: bool) -> Any:
    """FSDP2 over ``model`` in place: every decoder layer its own unit (its parameters are
    gathered just before it runs and freed after), the rest (embeddings, final norm, a tied
    lm_head) in the root unit. Gradients are summed over ranks (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (d.world,))
    # bf16 all-gathers halve the traffic; reduction stays fp32 so summed gradients keep their bits
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if (
        bf16 and device.type == "cuda") else MixedPrecisionPolicy()
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__}: found no decoder layers to shard (looked for modules named "
                         "*DecoderLayer / *Block in a ModuleList)")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in [*layers, model]:
        m.set_gradient_divide_factor(1.0)
        # a plain SUM collective (a factor of 1 would otherwise go through PREMUL_SUM, which gloo lacks)
        m.set_force_sum_reduction_for_comms(True)
    return model


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The repeated transformer blocks of an HF causal LM (Llama, Qwen2/3, their MoE kin;
    a peft wrapper included), found by class name inside ModuleLists."""
    out = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList):
            out += [m for m in mod if type(m).__name__.endswith(("DecoderLayer", "Block"))]
    return out


def split(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Indices of ``lengths`` per rank, balanced by total length: longest first, each to the
    rank with the fewest tokens so far (ties: the lower rank). Deterministic, so every rank
    computes the same split from the same list."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def share(items: list, lengths: Sequence[int], d: Dist) -> list:
    """This rank's part of ``items`` (all of them when not distributed)."""
    if not d.enabled:
        return list(items)
    return [items[i] for i in split(lengths, d.world)[d.rank]]


def _device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo takes CPU ones
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def equal_count(n: int, d: Dist) -> int:
    """The largest ``n`` over ranks: how many passes every rank must run."""
    return int(reduce_metrics({"n": n}, d, maxed=("n",))["n"])


def reduce_metrics(sums: dict[str, float], d: Dist, maxed: Sequence[str] = ()) -> dict[str, float]:
    """``sums`` added over ranks (keys in ``maxed``: their maximum), in one collective each."""
    if not d.enabled or not sums:
        return sums
    keys = sorted(sums)
    add = [k for k in keys if k not in maxed]
    out = dict(sums)
    for names, op in ((add, dist.ReduceOp.SUM), ([k for k in keys if k in maxed], dist.ReduceOp.MAX)):
        if names:
            t = torch.tensor([float(sums[k]) for k in names], dtype=torch.float64, device=_device())
            dist.all_reduce(t, op=op)
            out.update(zip(names, t.tolist()))
    return out


def broadcast(obj: Any, d: Dist, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank (pickled; for samples, states, small things)."""
    if not d.enabled:
        return obj
    box = [obj if d.rank == src else None]
    dist.broadcast_object_list(box, src=src, device=_device())
    return box[0]


def gather(obj: Any, d: Dist) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not d.enabled:
        return [obj]
    out: list[Any] = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


@dataclass
class _Failed:
    reason: str


def on_main(d: Dist, fn: Callable[[], Any], what: str, error: type[Exception] = RuntimeError) -> Any:
    """``fn()`` run on rank 0, its result on every rank (pickled: keep it small). If it raises,
    rank 0 raises that and every other rank ``error(f"{what}: {reason}")``, instead of waiting
    for a result that never comes. Not distributed: just ``fn()``."""
    if not d.enabled:
        return fn()
    got: Any = None
    if d.main:
        try:
            got = fn()
        except BaseException as e:
            broadcast(_Failed(f"{type(e).__name__}: {e}"), d)
            raise
    got = broadcast(got, d)
    if isinstance(got, _Failed):
        raise error(f"{what}: {got.reason}")
    return got


class Absent:
    """What a rank other than 0 holds in place of an object that lives on rank 0 alone
    (``main_only``): any attribute of it is itself and any call returns None, so a line
    written for rank 0 (``actor.publish(weights)``, ``run.actor.sampler.state()``) does nothing
    on the others. Its methods are never run: pass them to ``on_main`` to share a result."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends look for dunders: there are none
            raise AttributeError(name)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __repr__(self) -> str:
        return "Absent()"


def main_does(d: Dist, fn: Callable[[], T]) -> T | None:
    """``fn()`` on rank 0 (or in a plain process) alone, no collective; None on the other ranks.
    For what rank 0 does for the whole run: files, evaluations, the report, the console."""
    return fn() if d.main else None


def shows_progress(d: Dist, progress: bool) -> bool:
    """Whether this process draws a progress bar when ``progress`` is asked for: rank 0 (or a
    plain process) alone, so that N ranks draw one bar, not N."""
    return progress and d.main


def main_only(d: Dist, make: Callable[[], T]) -> T:
    """``make()`` on rank 0 (or in a plain process); on every other rank an ``Absent``
    stand-in, without calling ``make``. For what only rank 0 may hold: an engine, sandboxes,
    the metrics log."""
    return make() if d.main else Absent()  # type: ignore[return-value]


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
