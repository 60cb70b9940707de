"""A run directory's big pieces (an SFT model, an RL run's checkpoints) across device-machine
calls that each bring back at most 8 files of 16 MiB (64 MiB) and carry at most 64 MiB in.

    # on the device machine, once per group (0, 1, ...) until "left" is 0:
    python benchmarks/carry_parts.py ship RUN/replace-lines/sft_model WORK $OUT --group G [--bf16 [--in-place]]
    # here, with every call's returned files:
    python benchmarks/carry_parts.py gather FILE... --into .gpuz-sft        # -> .gpuz-sft1/, .gpuz-sft2/, ...
    # which folders go together in one call (each call then runs `learn_device.sh stash`):
    python benchmarks/carry_parts.py plan .gpuw .gpug* .gpuh* .gpup* .gpuz-sftd* .gpuz-rl* .gpur
    # on the next machine, after the .gpuz* folders were carried to INCOMING:
    python benchmarks/carry_parts.py restore INCOMING RUN

``ship`` tars the directory once per state (again when it changed since: a fingerprint of its files' sizes and
times; a later group of a changed directory is refused) (``--bf16``: every floating tensor of its ``*.safetensors`` cast
to bfloat16 first, which halves an fp32 model; the loader casts back to the trainer's float32)
into 15 MiB parts as ``opencomposer tasks pack`` cuts its packs (``tasks.packparts.PartsWriter``: each
part behind a header with its number and sha256), with a manifest (the directory's path under the
run, the parts), and copies the group's parts (4 a call) and the manifest to ``$OUT``.
``--against MODEL`` (a name ``load_model`` reads, e.g. ``smollm2-135m``) carries each ``*.safetensors`` as its exact
XOR delta from that model (``opencomposer.sync.model_delta``: SFT's bf16 SmolLM2 269 MB -> 100 MB), rebuilt by
``restore`` (which loads the model, refuses one whose fingerprint differs, and checks every tensor's sha256);
``--part-mib`` sizes the parts (15: what a returned file may have; here, for parts carried in, up to what a call
carries beside the tree). ``gather`` puts the returned files into folders that each fit one call beside the tree that travels with it
(``--max-mib``, default ``benchmarks/carry_room.sh``'s answer; a part is never split, so at least one part a folder); ``restore`` checks
that every part is there and each part's checksum holds (``tasks.packparts.find_parts``), then unpacks the directory to its place under
the run (atomically; a directory already there is left alone). Every command prints one JSON line.

Used by ``benchmarks/learn_device.sh`` (``ship``, ``stash``). Test:
``pytest tests/bench/test_carry_parts.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from opencomposer.tasks.packparts import (
    HEADER,
    PackError,
    PartsReader,
    PartsWriter,
    find_parts,
)

PART_BYTES = 15 << 20  # under the 16 MiB a returned file may have (each part: header + payload)
PER_CALL = 4  # parts a call returns: 60 MiB of the 64
CARRY_BYTES = 56 << 20  # a carried folder at most, with the smallest tree beside it (gather --max-mib: the room now)
MANIFEST = "manifest.json"
DELTA = ".delta"  # model.safetensors.delta: model.safetensors as its difference from ``--against``'s model
PAYLOAD = "payload.tar"  # its parts: payload.tar.part-000, ... (``tasks.packparts.PartsWriter``: each checked by its header)


class PartsError(Exception):
    pass


def _bf16_copy(src: Path, dest: Path) -> None:
    """``src`` copied to ``dest`` with every safetensors file's floating tensors in bfloat16."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    for f in sorted(dest.glob("*.safetensors")):
        sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in load_file(f).items()}
        save_file(sd, f, metadata={"format": "pt"})


def fingerprint(src: Path) -> str:
    """What ``src`` holds now, cheaply: each file's path, size and modification time, hashed."""
    h = hashlib.sha256()
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(src)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _to_deltas(root: Path, against: str) -> None:
    """Each ``*.safetensors`` of ``root`` (a copy this module made) replaced by its delta from ``against``."""
    from opencomposer.sync.model_delta import write_delta

    ref = _reference(against)
    for f in sorted(root.glob("*.safetensors")):
        write_delta(f, ref, f.with_name(f.name + DELTA), against=against)
        f.unlink()


_refs: dict[str, dict] = {}


def _reference(name: str) -> dict:
    """The state dict of the model ``name`` (loaded once per process, on the CPU, in float32)."""
    if name not in _refs:
        import torch

        from opencomposer.models.registry import load_model

        _refs[name] = load_model(name, dtype=torch.float32)[0].state_dict()
    return _refs[name]


def prepare(src: Path, work: Path, run: Path | None = None, bf16: bool = False, group: int = 0,
            against: str | None = None, part_bytes: int | None = None) -> dict:
    """The parts and manifest of ``src`` in ``work`` (atomically), made again when ``src`` changed since
    (an RL run's checkpoints written after an earlier ship: session 41 shipped a stale step that way). A
    later group of a directory that changed after its group 0 is refused: the parts would be of two states."""
    manifest = work / MANIFEST
    source = fingerprint(src) if src.is_dir() else None
    part_bytes = part_bytes or PART_BYTES
    settings = {"bf16": bf16, "against": against, "part_bytes": part_bytes}
    if manifest.is_file():
        info = json.loads(manifest.read_text())
        same = all(info.get(k) == v for k, v in settings.items())
        if same and (source is None or info.get("source") == source):
            return info
        if group > 0:
            raise PartsError(f"{src} changed since its group 0 was shipped (new checkpoints? other --bf16, --against "
                             f"or --part-mib?): the parts already returned are of the earlier state; ship again "
                             f"from --group 0")
    if source is None:
        raise PartsError(f"{src}: no such directory to ship")
    tmp = work.with_name(work.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    root = src
    if bf16:
        root = tmp / "bf16" / src.name
        _bf16_copy(src, root)
    if against:
        if root == src:  # never edit src: a copy (the bf16 one is already ours)
            root = tmp / "delta" / src.name
            shutil.copytree(src, root)
        _to_deltas(root, against)
    dest = str(src.relative_to(run)) if run is not None else src.name
    writer = PartsWriter(tmp / PAYLOAD, part_bytes, pack_id=f"carry:{dest}:{source}")  # parts of two states never mix
    with tarfile.open(fileobj=writer, mode="w|") as t:
        t.add(root, arcname=".")
    parts = [f.name for f in writer.finish()]
    info = {"dest": dest, "parts": parts, "bytes": sum((tmp / n).stat().st_size - HEADER for n in parts),
            "slug": dest.replace("/", "__"), "source": source, **settings}
    shutil.rmtree(tmp / "bf16", ignore_errors=True)
    shutil.rmtree(tmp / "delta", ignore_errors=True)
    (tmp / MANIFEST).write_text(json.dumps(info, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    tmp.rename(work)
    return info


def ship(src: Path, work: Path, out: Path, group: int, run: Path | None = None, bf16: bool = False,
         in_place: bool = False, against: str | None = None, part_bytes: int | None = None) -> dict:
    if in_place and bf16 and not (src / ".shipped").exists() and (
            began := sorted((src.parent / "rl_run" / "checkpoints").glob("step-*"))):
        # (session 47: an SFT model shipped in place after 12 RL updates; their checkpoints record the fp32
        # weights they started from, so they could not resume on the bf16 copy and RL began again)
        raise PartsError(f"{src}: RL has already trained from these weights ({len(began)} checkpoint(s) in "
                         f"{began[0].parent}, which record them); --in-place would round them to bf16 and those "
                         "checkpoints could not resume: ship without --in-place, or before RL begins")
    info = prepare(src, work, run, bf16, group, against, part_bytes)
    if in_place and info["bf16"] and not (src / ".shipped").exists():
        # src becomes what was shipped, so this machine goes on from exactly what a later one restores
        _unpack(work / PAYLOAD, src.with_name(src.name + ".shipped"))
        (src.with_name(src.name + ".shipped") / ".shipped").write_text(info["dest"])
        old = src.with_name(src.name + ".before-ship")
        src.rename(old)
        src.with_name(src.name + ".shipped").rename(src)
        shutil.rmtree(old)
        info["source"] = fingerprint(src)  # what was shipped is what src now is: the next group goes on
        tmp = work / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(info, indent=1))
        tmp.replace(work / MANIFEST)
    groups = -(-len(info["parts"]) // PER_CALL)
    if not 0 <= group < groups:
        raise PartsError(f"--group {group}: {src} has {len(info['parts'])} parts, groups 0..{groups - 1}")
    names = info["parts"][group * PER_CALL:(group + 1) * PER_CALL]
    out.mkdir(parents=True, exist_ok=True)
    prefix = f"{info['slug']}."  # several directories' parts may come back in one place
    for n in [*names, MANIFEST]:
        shutil.copy2(work / n, out / (prefix + n))
    return {"ship": info["dest"], "group": group, "groups": groups, "left": groups - group - 1,
            "files": [prefix + n for n in [*names, MANIFEST]], "bytes": info["bytes"]}


def call_room_bytes(spare: int = 1 << 20) -> int:
    """What one device call can carry beside the tree that travels with it now, exactly, less ``spare``
    (``carry_room.sh`` rounds the tree up and keeps 2 MiB more, for parts made before the tree grows)."""
    return _carry_room("--bytes") - spare


def _carry_room(*args: str) -> int:
    script = Path(__file__).with_name("carry_room.sh")
    r = subprocess.run([str(script), *args], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise PartsError(f"{script}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return int(r.stdout.strip())


def carry_room_bytes() -> int:
    """What one device call carries beside the working tree of a device session, in bytes: with the task packs
    out of it (``benchmarks/carry_room.sh --slim``; ``tree_slim.sh on`` while the session runs)."""
    return _carry_room("--slim") << 20


def gather(files: list[Path], into: str, max_bytes: int = CARRY_BYTES) -> dict:
    """Returned files -> folders ``<into>1``, ``<into>2``, ... of at most ``max_bytes`` each (a folder holds
    one file at least: a part larger than ``max_bytes`` is refused, naming both sizes)."""
    files = sorted(set(files), key=lambda p: p.name)
    if not any(f.name.endswith(MANIFEST) for f in files):
        raise PartsError(f"no {MANIFEST} among the {len(files)} files given")
    if too_big := [f for f in files if f.stat().st_size > max_bytes]:
        raise PartsError(f"{too_big[0]}: {too_big[0].stat().st_size} bytes, more than a call can carry beside the "
                         f"tree ({max_bytes} bytes): make room (benchmarks/carry_room.sh) and gather again")
    for old in Path(into).parent.glob(Path(into).name + "*"):
        shutil.rmtree(old)
    bins: list[tuple[int, list[Path]]] = []  # first fit, largest first: the fewest folders (calls) in practice
    for f in sorted(files, key=lambda p: (-p.stat().st_size, p.name)):
        n = f.stat().st_size
        k = next((i for i, (used, _) in enumerate(bins) if used + n <= max_bytes), len(bins))
        if k == len(bins):
            bins.append((0, []))
        bins[k] = (bins[k][0] + n, [*bins[k][1], f])
    dirs = []
    for k, (_, members) in enumerate(bins, 1):
        dirs.append(Path(f"{into}{k}"))
        dirs[-1].mkdir(parents=True)
        for f in members:
            shutil.copy2(f, dirs[-1] / f.name)
    return {"gathered": len(files), "dirs": [str(d) for d in dirs]}


def plan(folders: list[Path], max_bytes: int) -> dict:
    """The carried folders grouped into device calls of at most ``max_bytes`` each (first fit, largest first):
    what to pass as ``carry`` call after call (each call then runs ``learn_device.sh stash``)."""
    sizes = {}
    for d in folders:
        if not d.is_dir():
            raise PartsError(f"{d}: no such folder to carry")
        sizes[d] = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    if too_big := [d for d, n in sizes.items() if n > max_bytes]:
        raise PartsError(f"{too_big[0]}: {sizes[too_big[0]]} bytes, more than a call carries beside the tree "
                         f"({max_bytes} bytes): gather it again into smaller folders")
    calls: list[tuple[int, list[str]]] = []
    for d in sorted(folders, key=lambda d: (-sizes[d], str(d))):
        k = next((i for i, (used, _) in enumerate(calls) if used + sizes[d] <= max_bytes), len(calls))
        if k == len(calls):
            calls.append((0, []))
        calls[k] = (calls[k][0] + sizes[d], [*calls[k][1], str(d)])
    return {"calls": [names for _, names in calls], "count": len(calls), "bytes": sum(sizes.values())}


def _unpack(payload: Path, dest: Path) -> None:
    """The tar cut into ``payload``'s parts, each checked first, unpacked as ``dest`` (made beside it, then renamed)."""
    try:
        parts = find_parts(payload)
    except PackError as e:
        raise PartsError(str(e)) from None
    tmp = dest.with_name(dest.name + ".restoring")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(fileobj=PartsReader(parts), mode="r|") as t:
        t.extractall(tmp, filter="data")
    deltas = sorted(tmp.rglob("*" + DELTA))
    if deltas:
        from opencomposer.sync.model_delta import DeltaError, apply_delta, read_header

        for d in deltas:
            try:
                against = read_header(d)[0]["against"]
                apply_delta(d, _reference(against), d.with_name(d.name[: -len(DELTA)]))
            except DeltaError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise PartsError(str(e)) from None
            d.unlink()
    tmp.rename(dest)


def restore(incoming: Path, run: Path) -> dict:
    """Every complete shipped directory in ``incoming`` unpacked under ``run``."""
    done, skipped = [], []
    for m in sorted(incoming.glob(f"*.{MANIFEST}")):
        info = json.loads(m.read_text())
        prefix = m.name[: -len(MANIFEST)]
        dest = run / info["dest"]
        if dest.exists():
            skipped.append(info["dest"])
            continue
        missing = [prefix + n for n in info["parts"] if not (incoming / (prefix + n)).is_file()]
        if missing:
            raise PartsError(f"{m}: {len(missing)} of {len(info['parts'])} parts not carried yet "
                             f"({', '.join(missing[:4])})")
        _unpack(incoming / (prefix + PAYLOAD), dest)
        done.append(info["dest"])
    return {"restored": done, "already_there": skipped}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("ship")
    s.add_argument("src", type=Path)
    s.add_argument("work", type=Path, help="where the parts are made (again when src changed)")
    s.add_argument("out", type=Path)
    s.add_argument("--group", type=int, default=0)
    s.add_argument("--run", type=Path, default=None, help="the run directory src lies under (default: src's parent)")
    s.add_argument("--bf16", action="store_true")
    s.add_argument("--against", default=None, metavar="MODEL",
                   help="carry each *.safetensors as its exact delta from this model (restore loads it again)")
    s.add_argument("--part-mib", type=int, default=None,
                   help="size of each part (15: a returned file's limit; parts made here may be up to a call's room)")
    s.add_argument("--in-place", action="store_true",
                   help="with --bf16: src becomes the bf16 copy, so this machine goes on from what is restored later")
    g = sub.add_parser("gather")
    g.add_argument("files", type=Path, nargs="+")
    g.add_argument("--into", required=True)
    g.add_argument("--max-mib", type=int, default=None,
                   help="each folder at most this many MiB (default: what a call of a device session carries beside "
                        "the tree, benchmarks/carry_room.sh --slim)")
    pl = sub.add_parser("plan", help="group carried folders into device calls (what `carry` each call takes)")
    pl.add_argument("folders", type=Path, nargs="+")
    pl.add_argument("--max-mib", type=int, default=None,
                    help="default: 64 MiB less the tree that travels now, less 1 MiB")
    r = sub.add_parser("restore")
    r.add_argument("incoming", type=Path)
    r.add_argument("run", type=Path)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "ship":
            res = ship(a.src, a.work, a.out, a.group, a.run or a.src.parent, a.bf16, a.in_place, a.against,
                       (a.part_mib << 20) if a.part_mib else None)
        elif a.cmd == "plan":
            res = plan(a.folders, (a.max_mib << 20) if a.max_mib else call_room_bytes())
        elif a.cmd == "gather":
            res = gather(a.files, a.into, (a.max_mib << 20) if a.max_mib else carry_room_bytes())
        else:
            res = restore(a.incoming, a.run)
    except PartsError as e:
        print(json.dumps({"error": str(e)}))
        return 2
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
