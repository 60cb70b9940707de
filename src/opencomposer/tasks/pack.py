"""Validated tasks and their environments in one file, for a machine with no network.

    opencomposer tasks pack tasks/ -o toolz.ocpack --part-size 60M      # toolz.ocpack.part-000, ...
    opencomposer tasks unpack toolz.ocpack -o tasks/                    # envs rebuilt with no index
    pack_tasks(Path("tasks"), Path("toolz.ocpack"));  unpack_tasks(Path("toolz.ocpack"), Path("tasks"))

A pack is a tar stream compressed with zstandard, cut into parts (one part unless
``part_size``). The tar holds ``manifest.json`` first, then ``objects/<sha256>``: each distinct
file content once. Tasks of one library share almost every file (each workspace is the library
with one feature deleted), so this stores each library once; objects go in order of their path
inside the task (every variant of ``workspace/pkg/mod.py`` side by side), which the compressor
then turns into a small delta. The manifest lists the tasks, every file (path relative to DIR,
sha256, size, mode), empty dirs, symlinks, the environments (``packenv.describe_env`` plus the
wheels carried, themselves objects), the format version and the opencomposer version.

Every part starts with a fixed ``HEADER``-byte header: ``MAGIC`` and a JSON line naming the pack
(the sha256 of its manifest), the part's number, whether it is the last, and its payload's
size and sha256. So a missing, reordered, foreign or damaged part is named before anything is read.

Unpacking checks every part, then every object against the manifest (sha256 and size; an object
not listed, or a listed one absent, is refused naming the file), and every path (relative,
inside DIR, under a packed task or ``_envs/``; symlinks stay inside their task). It all happens in
a staging dir beside DIR (``paths.staged_dir``: a ``.`` name no lister reads) renamed to DIR at
the end, after the envs are rebuilt offline (``packenv.rebuild_env``): a failure at any point
leaves no half-made task. DIR must be new or empty. Errors are ``PackError`` (a
``TaskFormatError``), ``EnvError`` or ``ConfigError``, each naming the file, part or dir.

``split_wheels`` (``opencomposer tasks split-wheels PACK -o OUT --wheelhouse DIR``) writes a pack again
without its wheels and puts them in a wheelhouse several packs share: task sets whose libraries
need the same wheels then carry them once (``unpack --fetch-wheels --find-links DIR`` rebuilds the
same environments offline).

Test: ``pytest tests/unit/tasks/test_pack.py``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import zstandard

import opencomposer
from opencomposer.config import ConfigError
from opencomposer.paths import remove_stale_temps, staged_dir, temp_name
from opencomposer.tasks import packenv
from opencomposer.tasks.format import (
    ENVS,
    TASK_FORMAT_VERSION,
    Task,
    check_task_id,
    task_dirs,
)
from opencomposer.tasks.packparts import (
    CHUNK,
    PACK_FORMAT_VERSION,
    PackError,
    PartsReader,
    PartsWriter,
    file_sha,
    find_parts,
)

MANIFEST = "manifest.json"


@dataclass
class PackReport:
    parts: list[str]
    tasks: int = 0
    files: int = 0
    objects: int = 0  # distinct contents stored
    bytes_in: int = 0  # sum of the file sizes (wheels included)
    bytes_stored: int = 0  # sum of the distinct contents
    bytes_out: int = 0  # the pack on disk, all parts
    envs: dict = field(default_factory=dict)  # name -> {"python", "installed", "wheels"}
    seconds: float = 0.0


@dataclass
class UnpackReport:
    out: str
    tasks: int = 0
    files: int = 0
    envs: list[str] = field(default_factory=list)  # rebuilt
    seconds: float = 0.0
    # env -> "made X.Y, rebuilt for A.B": its tasks were validated on another Python (session 39: 5 of 60 sampled
    # tasks made on 3.12 failed their gold on 3.11, their tests using 3.12-only features); check them before use
    retargeted: dict[str, str] = field(default_factory=dict)


def _inside(rel: str, top: str) -> bool:
    return rel == top or rel.startswith(top + "/")


# --------------------------------------------------------------------------- pack


def _walk(root: Path, name: str, files: list, dirs: list, links: list, sources: dict) -> None:
    """Add the tree at ``root`` under the pack path ``name``."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        d = Path(dirpath)
        rel_dir = PurePosixPath(name, d.relative_to(root).as_posix()).as_posix()
        dirs.append({"path": rel_dir, "mode": os.lstat(d).st_mode & 0o777})
        for entry in sorted(filenames) + [x for x in dirnames if (d / x).is_symlink()]:
            p, rel = d / entry, f"{rel_dir}/{entry}"
            st = os.lstat(p)
            if os.path.islink(p):
                target = os.readlink(p)
                where = os.path.normpath(os.path.join(os.path.dirname(rel), target))
                if os.path.isabs(target) or not _inside(where, name):
                    raise PackError(f"{p}: a symlink to {target!r}, outside the task {root}; expected links "
                                    "that stay inside their task")
                links.append({"path": rel, "target": target})
            elif os.path.isfile(p):
                sha, size = file_sha(p)
                files.append({"path": rel, "sha256": sha, "size": size, "mode": st.st_mode & 0o777})
                sources.setdefault(sha, (p, size))
            else:
                raise PackError(f"{p}: neither a file, a dir nor a symlink; a pack holds only those")
        dirnames[:] = [x for x in dirnames if not (d / x).is_symlink()]


def _env_of(src: Path, task: Task) -> str | None:
    """The env's path inside ``_envs/`` (``toolz-1.2.0``) of ``task``, or None when it names none."""
    env = task.meta.environment.env
    if not env:
        return None
    envs = os.path.abspath(src / ENVS)
    lexical = os.path.normpath(os.path.join(os.path.abspath(task.root), env))
    if not lexical.startswith(envs + os.sep):
        raise PackError(f"{task.root / 'task.toml'}: key 'environment.env': {env!r} is not under {envs}; "
                        "a pack carries the environments of DIR/_envs (link one there: tasks.envs.adopt_env)")
    return Path(os.path.relpath(lexical, envs)).as_posix()


def pack_tasks(src: Path, out: Path, part_size: int | None = None, wheels: bool = True,
               python_version: str | None = None, platform: list[str] | None = None,
               find_links: list[Path] | None = None, level: int = 10, libraries: list[str] | None = None,
               exclude_libraries: list[str] | None = None) -> PackReport:
    """Write the tasks of ``src`` (``task_dirs``) and their envs to ``out`` (or ``out.part-NNN``);
    with ``libraries`` only the tasks of those libraries (``SourceInfo.name``, e.g. 'toolz'), less
    those of ``exclude_libraries``."""
    t0 = time.time()
    src, out = Path(src), Path(out)
    tasks = select_libraries([Task.load(d) for d in task_dirs(src)], src, libraries, exclude_libraries)
    if not tasks:
        raise ConfigError(f"{src}: no task directories in it (expected {src}/<task>/task.toml)")
    files: list[dict] = []
    dirs: list[dict] = []
    links: list[dict] = []
    sources: dict[str, tuple[Path, int]] = {}
    env_users: dict[str, list[Task]] = {}
    for t in tasks:
        _walk(t.root, t.root.name, files, dirs, links, sources)
        name = _env_of(src, t)
        if name is not None:
            env_users.setdefault(name, []).append(t)
    envs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ocpack-wheels-") as tmp:
        for name, users in sorted(env_users.items()):
            env_dir = src / ENVS / name
            rec = {"name": name, "packages": sorted({t.meta.source.package for t in users} - {""}),
                   "python": "", "installed": [], "target_python": python_version, "platform": platform,
                   "wheels": [], "venv": (env_dir / "pyvenv.cfg").is_file()}
            if rec["venv"]:
                rec.update(packenv.describe_env(env_dir))
                rec["target_python"] = python_version or ".".join(rec["python"].split(".")[:2])
                if wheels:
                    wdir = Path(tmp) / f"env{len(envs)}"
                    try:
                        built = packenv.fetch_wheels(rec["installed"], wdir, python_version, platform, find_links)
                    except packenv.EnvError as err:  # say whose environment, and how to pack without it
                        libs = sorted({t.meta.source.name for t in users})
                        raise packenv.EnvError(
                            f"{ENVS}/{name} (the environment of {len(users)} task(s) of {', '.join(libs)}): {err}; "
                            f"pack without it: {' '.join('--exclude-library ' + x for x in libs)}") from None
                    for whl, was_built in sorted(built.items()):
                        sha, size = file_sha(wdir / whl)
                        rec["wheels"].append({"file": whl, "sha256": sha, "size": size, "built": was_built})
                        sources.setdefault(sha, (wdir / whl, size))
                for meta in sorted(env_dir.iterdir()):  # env.json, prep.json: what made it, beside the venv
                    if meta.is_file() and not meta.is_symlink() and meta.name != "pyvenv.cfg":
                        sha, size = file_sha(meta)
                        files.append({"path": f"{ENVS}/{name}/{meta.name}", "sha256": sha, "size": size,
                                      "mode": meta.stat().st_mode & 0o777})
                        sources.setdefault(sha, (meta, size))
            envs.append(rec)
        manifest = {"format": "opencomposer-pack", "format_version": PACK_FORMAT_VERSION,
                    "task_format_version": TASK_FORMAT_VERSION, "opencomposer": opencomposer.__version__,
                    "packed_with_python": sys.version.split()[0],
                    "tasks": [t.root.name for t in tasks], "files": files, "dirs": dirs, "links": links,
                    "envs": envs}
        parts = _write(out, manifest, sources, part_size, level)
    wheel_bytes = sum(w["size"] for e in envs for w in e["wheels"])
    return PackReport(parts=[str(p) for p in parts], tasks=len(tasks), files=len(files), objects=len(sources),
                      bytes_in=sum(f["size"] for f in files) + wheel_bytes,
                      bytes_stored=sum(s for _, s in sources.values()),
                      bytes_out=sum(p.stat().st_size for p in parts),
                      envs={e["name"]: {"python": e["target_python"], "installed": len(e["installed"]),
                                        "wheels": len(e["wheels"])} for e in envs},
                      seconds=round(time.time() - t0, 2))


def _write(out: Path, manifest: dict, sources: dict[str, tuple[Path, int]], part_size: int | None,
           level: int) -> list[Path]:
    """The pack: ``manifest`` first, then each object of ``sources`` (sha256 -> (file, size)) once, in the
    order of its smallest path inside a task (the variants of one file side by side compress as a delta)."""
    body = json.dumps(manifest, indent=1, sort_keys=True).encode()
    first: dict[str, tuple[str, str]] = {}  # sha -> its smallest (path inside the task, path)
    for f in manifest["files"]:
        key = (f["path"].split("/", 1)[-1], f["path"])
        first[f["sha256"]] = min(first.get(f["sha256"], key), key)
    order = sorted(sources, key=lambda sha: first.get(sha, ("~", sha)))
    writer = PartsWriter(out, part_size, hashlib.sha256(body).hexdigest()[:32])
    try:
        zw = zstandard.ZstdCompressor(level=level, write_checksum=True).stream_writer(writer, closefd=False)
        with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(_info(MANIFEST, len(body)), io.BytesIO(body))
            for sha in order:
                path, size = sources[sha]
                with open(path, "rb") as f:
                    src_f = _Hashing(f)
                    tar.addfile(_info(f"objects/{sha}", size), src_f)
                if src_f.h.hexdigest() != sha or src_f.n != size:
                    raise PackError(f"{path}: changed while it was being packed; pack again")
        zw.close()
        return writer.finish()
    except BaseException:
        writer.abort()
        raise


@dataclass
class SplitReport:
    parts: list[str]
    tasks: int
    wheels: int  # wheels the pack carried
    added: int  # of them, new to the wheelhouse (the others were there, identical)
    bytes_in: int
    bytes_out: int
    seconds: float


def split_wheels(pack: Path, out: Path, wheelhouse: Path, part_size: int | None = None,
                 level: int = 10) -> SplitReport:
    """``pack`` written again to ``out`` without its wheels (as ``--no-wheels`` makes it), and the wheels into
    ``wheelhouse``: packs of libraries that share wheels then carry them once, and ``unpack_tasks(out,
    fetch_wheels=True, find_links=[wheelhouse])`` rebuilds the same environments offline. A wheel already in
    the wheelhouse under its name must be the same file (else refused, naming both checksums)."""
    t0 = time.time()
    parts = find_parts(Path(pack))
    bytes_in = sum(p.stat().st_size for p in parts)
    wheelhouse.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(wheelhouse)
    with tempfile.TemporaryDirectory(prefix="ocpack-split-", dir=out.parent if out.parent.is_dir() else None) as tmp:
        objects = Path(tmp) / "objects"
        m = _extract(parts, objects)
        wheels = [w for e in m["envs"] for w in e["wheels"]]
        added = 0
        for w in wheels:
            name = _safe(w["file"], "wheel")
            if "/" in name or not name.endswith(".whl"):
                raise PackError(f"{pack}: wheel {w['file']!r}: expected a plain *.whl file name")
            dest = wheelhouse / name
            if dest.exists():
                have = file_sha(dest)[0]
                if have != w["sha256"]:
                    raise PackError(f"{wheelhouse}/{name}: sha256 {have}, but {pack} carries {name} with sha256 "
                                    f"{w['sha256']}: two different builds of one wheel; use another wheelhouse")
                continue
            tmp_w = temp_name(dest)
            shutil.copyfile(objects / w["sha256"], tmp_w)
            os.replace(tmp_w, dest)
            added += 1
        for e in m["envs"]:
            e["wheels"] = []
        sources = {f["sha256"]: (objects / f["sha256"], f["size"]) for f in m["files"]}
        written = _write(out, m, sources, part_size, level)
    return SplitReport(parts=[str(p) for p in written], tasks=len(m["tasks"]), wheels=len(wheels), added=added,
                       bytes_in=bytes_in, bytes_out=sum(p.stat().st_size for p in written),
                       seconds=round(time.time() - t0, 2))


class _Hashing:
    """A file read through, hashed on the way (what is packed is what was listed)."""

    def __init__(self, f):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        b = self.f.read(size)
        self.h.update(b)
        self.n += len(b)
        return b


def select_libraries(tasks: list[Task], src: Path, only: list[str] | None, exclude: list[str] | None) -> list[Task]:
    """The tasks of the ``only`` libraries (all when None) less the ``exclude`` ones, names compared
    as pip does (case, '-', '_' and '.' alike); a named library with no task in ``src`` is an error."""
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    have = {norm(t.meta.source.name) for t in tasks}
    for flag, names in (("--library", only), ("--exclude-library", exclude)):
        missing = sorted(n for n in names or [] if norm(n) not in have)
        if missing:
            raise ConfigError(f"{flag} {', '.join(missing)}: no task of that library in {src} "
                              f"(its libraries: {', '.join(sorted(have))})")
    keep = {norm(n) for n in only} if only else have
    keep -= {norm(n) for n in exclude or []}
    return [t for t in tasks if norm(t.meta.source.name) in keep]


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info


# --------------------------------------------------------------------------- unpack


def _safe(rel, what: str) -> str:
    """``rel`` if it is a relative path that stays inside DIR, else PackError naming it."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel or rel.startswith("/") or \
            any(p in ("", ".", "..") for p in rel.split("/")):
        raise PackError(f"{what} {rel!r}: refused; expected a relative path that stays inside DIR "
                        "(no absolute path, no '..', '.' or empty parts)")
    return rel


def check_manifest(m: dict, pack: Path) -> None:
    """Refuse a manifest of another format, or one whose paths leave DIR or their task (a pack is input)."""
    if not isinstance(m, dict) or m.get("format") != "opencomposer-pack":
        raise PackError(f"{pack}: {MANIFEST} is not an opencomposer pack manifest")
    if m.get("format_version") != PACK_FORMAT_VERSION:
        raise PackError(f"{pack}: pack format version {m.get('format_version')}; expected {PACK_FORMAT_VERSION}")
    tasks = m.get("tasks") or []
    for t in tasks:
        check_task_id(t, f"{pack}: {MANIFEST}: tasks")
    tops = set(tasks)
    envs = {_safe(e.get("name"), f"{pack}: env") for e in m.get("envs", [])}
    seen: set[str] = set()
    for kind in ("dirs", "files", "links"):
        for e in m.get(kind, []):
            rel = _safe(e.get("path"), f"{pack}: {kind[:-1]}")
            top = rel.split("/", 1)[0]
            if top not in tops and not (top == ENVS and any(_inside(rel, f"{ENVS}/{n}") for n in envs)):
                raise PackError(f"{pack}: {kind[:-1]} {rel!r}: refused; expected a path under a packed task "
                                f"({', '.join(sorted(tops)[:3])}...) or {ENVS}/<env>")
            if rel in seen:
                raise PackError(f"{pack}: {rel!r} is listed twice in the manifest")
            seen.add(rel)
    link_paths = {e["path"] for e in m.get("links", [])}
    for rel in seen:  # nothing is written through a link: no entry lies under one
        parent = rel.rsplit("/", 1)[0]
        while "/" in parent or parent in link_paths:
            if parent in link_paths:
                raise PackError(f"{pack}: {rel!r} lies under the symlink {parent!r}; refused")
            parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
    for e in m.get("links", []):
        target, top = e.get("target"), e["path"].split("/", 1)[0]
        where = os.path.normpath(os.path.join(os.path.dirname(e["path"]), str(target)))
        if not isinstance(target, str) or "\0" in target or os.path.isabs(target) or not _inside(where, top):
            raise PackError(f"{pack}: symlink {e['path']!r} -> {target!r}: refused; expected a target inside its task")
    for kind in ("files", "wheels"):
        for e in m.get(kind, []) if kind == "files" else [w for v in m.get("envs", []) for w in v.get("wheels", [])]:
            if kind == "wheels":
                _safe(e.get("file"), f"{pack}: wheel")
                if "/" in e["file"]:
                    raise PackError(f"{pack}: wheel {e['file']!r}: refused; expected a file name")
            if not re.fullmatch(r"[0-9a-f]{64}", str(e.get("sha256"))) or not isinstance(e.get("size"), int):
                raise PackError(f"{pack}: {e.get('path') or e.get('file')!r}: no valid sha256 and size in the manifest")


def _manifest_of(tar: tarfile.TarFile, pack: Path) -> dict:
    """The manifest, the first member of the pack's stream ``tar``, read and checked."""
    first = tar.next()
    if first is None or first.name != MANIFEST or not first.isfile():
        raise PackError(f"{pack}: the first member is {first.name if first else 'missing'}; expected {MANIFEST}")
    try:
        manifest = json.loads(tar.extractfile(first).read())
    except ValueError as e:
        raise PackError(f"{pack}: {MANIFEST} is not valid JSON: {e}") from None
    check_manifest(manifest, pack)
    return manifest


def _extract(parts: list[Path], objects: Path) -> dict:
    """Read the stream of ``parts``: the manifest, then every object into ``objects/``, each checked."""
    pack = parts[0]
    objects.mkdir()
    with zstandard.ZstdDecompressor().stream_reader(PartsReader(parts), read_across_frames=True) as raw:
        try:
            tar = tarfile.open(fileobj=raw, mode="r|")
            manifest = _manifest_of(tar, pack)
            want: dict[str, tuple[int, list[str]]] = {}
            for f in manifest["files"] + [{"path": f"{ENVS}/{e['name']} wheel {w['file']}", **w}
                                          for e in manifest["envs"] for w in e["wheels"]]:
                want.setdefault(f["sha256"], (f["size"], []))[1].append(f["path"])
            seen: set[str] = set()
            while (member := tar.next()) is not None:  # not ``for``: that starts again at the manifest
                sha = member.name.removeprefix("objects/")
                if not member.isfile() or sha not in want or sha in seen or member.name == sha:
                    raise PackError(f"{pack}: member {member.name!r} is not a file listed in the manifest "
                                    "(expected only objects/<sha256> of its files, each once)")
                size, users = want[sha]
                h, n, src = hashlib.sha256(), 0, tar.extractfile(member)
                with open(objects / sha, "wb") as out:
                    while b := src.read(CHUNK):
                        h.update(b)
                        n += len(b)
                        out.write(b)
                if n != size or h.hexdigest() != sha:
                    raise PackError(f"{users[0]}: altered or damaged in the pack: {n} bytes with sha256 "
                                    f"{h.hexdigest()}, expected {size} bytes with sha256 {sha}")
                seen.add(sha)
        except (tarfile.TarError, zstandard.ZstdError, EOFError) as e:
            raise PackError(f"{pack}: the pack's stream is damaged: {e}") from None
    for sha in want.keys() - seen:
        size, users = want[sha]
        raise PackError(f"{users[0]}: missing from the pack (expected {size} bytes with sha256 {sha})")
    return manifest


def read_manifest(pack: Path) -> dict:
    """The manifest of the pack at ``pack`` (file, base name or first part), read without the objects after it
    (each part's header checked; the objects are checked when unpacked)."""
    parts = find_parts(Path(pack))
    with zstandard.ZstdDecompressor().stream_reader(PartsReader(parts), read_across_frames=True) as raw:
        try:
            return _manifest_of(tarfile.open(fileobj=raw, mode="r|"), parts[0])
        except (tarfile.TarError, zstandard.ZstdError, EOFError) as e:
            raise PackError(f"{parts[0]}: the pack's stream is damaged: {e}") from None


def _python_version(python: str) -> str | None:
    """``X.Y`` of the interpreter ``python`` (None: this one, pip's default target)."""
    if python == sys.executable:
        return None
    version = packenv.interpreter_version(python)
    if version is None:
        raise ConfigError(f"{python}: not a working Python interpreter (expected one to build the environments with)")
    return version


def unpack_tasks(pack: Path, dest: Path, envs: bool = True, python: str = sys.executable,
                 timeout: float = 900.0, fetch_wheels: bool = False,
                 find_links: list[Path] | None = None) -> UnpackReport:
    """Restore the pack at ``pack`` (file, base name or part) into ``dest`` (new or empty), and with
    ``envs`` rebuild its environments from the carried wheels, offline. ``fetch_wheels``: an env
    packed without its wheels (``--no-wheels``) gets the same pinned distributions from the index
    (or ``find_links``) for ``python``, whatever Python it was made with, then is rebuilt the same
    way: the compact pack of a task set kept in git becomes a working one wherever an index (or a
    wheelhouse) is reachable."""
    t0 = time.time()
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"{dest}: exists and is not empty; unpack into a new or empty directory")
    parts = find_parts(Path(pack))
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest.parent)
    with staged_dir(dest) as tmp:
        objects = tmp / ".objects"
        m = _extract(parts, objects)
        keep = (lambda rel: True) if envs else (lambda rel: not _inside(rel, ENVS))
        files = [f for f in m["files"] if keep(f["path"])]
        todo = m["envs"] if envs else []
        retargeted: dict[str, str] = {}
        wheel_dirs: dict[str, Path] = {}  # env -> where its wheels are installed from
        house, house_pins = packenv.wheelhouse_pins(find_links) if fetch_wheels else (None, set())
        version = None  # X.Y of ``python``, asked once, when an env's wheels must be fetched for it
        for e in todo:
            if not e.get("venv"):
                raise PackError(f"{pack}: env {e['name']}: was not a Python venv when packed, so it cannot be "
                                "rebuilt; unpack with --no-envs and link an env into _envs/ (tasks.envs.adopt_env)")
            wheels = wheel_dirs[e["name"]] = tmp / ".wheels" / e["name"].replace("/", "_")
            if len(e["wheels"]) < len(e["installed"]):
                if not fetch_wheels:
                    raise PackError(f"{pack}: env {e['name']}: packed without wheels (--no-wheels); unpack with "
                                    "--fetch-wheels where an index is reachable, or with --no-envs and link a "
                                    "matching env into _envs/ (tasks.envs.adopt_env)")
                version = version or _python_version(python)
                if house is not None and packenv.has_pins(e["installed"], house_pins):
                    wheel_dirs[e["name"]] = house  # a wheel of every pin already on disk there: pip picks at install
                else:
                    try:
                        packenv.fetch_wheels(e["installed"], wheels, version, None, find_links, timeout)
                    except packenv.EnvError as err:
                        raise packenv.EnvError(f"{pack}: env {e['name']}: fetching its pinned wheels: {err}") from None
                # the same pins, fetched for the interpreter that will run them (a set made on the GPU
                # machine's 3.12 rebuilt on a 3.11 laptop): a pin with no wheel for it failed above (or, from a
                # wheelhouse, fails at install, naming the env)
                e["target_python"] = version or "%d.%d" % sys.version_info[:2]
                made = ".".join(str(e.get("python", "")).split(".")[:2])
                if made and made != e["target_python"]:
                    retargeted[e["name"]] = f"made with Python {made}, rebuilt for {e['target_python']}"
                continue
            wheels.mkdir(parents=True)
            for w in e["wheels"]:
                shutil.copyfile(objects / w["sha256"], wheels / w["file"])
        uses: dict[str, int] = {}
        for f in files:
            uses[f["sha256"]] = uses.get(f["sha256"], 0) + 1
        for d in m["dirs"]:
            if keep(d["path"]):
                (tmp / d["path"]).mkdir(parents=True, exist_ok=True)
        for f in files:  # links come last: no file is ever written through one
            target = tmp / f["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            uses[f["sha256"]] -= 1
            (os.replace if uses[f["sha256"]] == 0 else shutil.copyfile)(objects / f["sha256"], target)
            os.chmod(target, f["mode"] & 0o777)
        for ln in m["links"]:
            os.symlink(ln["target"], tmp / ln["path"])
            top = os.path.realpath(tmp / ln["path"].split("/", 1)[0])
            real = os.path.realpath(tmp / ln["path"])
            if not (real == top or real.startswith(top + os.sep)):
                raise PackError(f"{pack}: symlink {ln['path']!r} -> {ln['target']!r} resolves outside its task")
        packenv.rebuild_envs([(tmp / ENVS / e["name"], wheel_dirs[e["name"]], e) for e in todo], python, timeout,
                             staged=(tmp, dest))
        for d in sorted((d for d in m["dirs"] if keep(d["path"])), key=lambda d: -d["path"].count("/")):
            os.chmod(tmp / d["path"], d["mode"] & 0o777)
        shutil.rmtree(objects)
        shutil.rmtree(tmp / ".wheels", ignore_errors=True)
    return UnpackReport(out=str(dest), tasks=len(m["tasks"]), files=len(files), envs=[e["name"] for e in todo],
                        seconds=round(time.time() - t0, 2), retargeted=retargeted)
