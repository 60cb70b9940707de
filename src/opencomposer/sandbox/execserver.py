"""The exec server of a namespace sandbox: its wire protocol and its loop.

``namespace.py`` starts it once per sandbox as PID 1 of the sandbox's namespaces
(``python3 -I -S -c <server_code()>``) and sends it one request at a time over its
stdin/stdout (the host's end is ``session.py``). Standard library only, on purpose: under
``-I -S`` nothing of ours is importable, so ``server_code`` ships this module's source with
that of the process runner it uses (``runner.py``).

Protocol (both ways): a frame is ``>II`` (header length, body length), a JSON header, then
raw body bytes. Requests: ``exec`` (argv, env, cwd, timeout, max_output; body = stdin),
``read`` / ``write`` (path; body = file contents), ``kill`` (only while an ``exec`` runs:
its ``reason`` ends the command like a timeout). Replies to ``exec``: exit code, whether
it timed out or why it was killed, the output's total size and head length; body = the
capped head + tail.

The server forks each command in its own session with the sandbox's rlimits (so its
own CPU time never counts), and after every command kills whatever the command left in
the sandbox (``kill(-1)`` from PID 1 reaches every other process of the namespace, and
nothing inside can kill PID 1): processes never outlive their command, as when each
command had namespaces of its own. It exits when its stdin closes, so a killed host
takes its sandboxes' processes with it.

Test: ``pytest tests/unit/sandbox/test_sandbox_namespace.py tests/unit/sandbox/test_adversarial.py -q``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import struct
import time

from opencomposer.sandbox.runner import CHUNK, TICK, run_capped

_FRAME = struct.Struct(">II")
# Exit codes / error kinds of file requests.
ESCAPE, MISSING, ISDIR = "escape", "missing", "isdir"
# What ``python3 -I -S -c`` runs: each module's source, in order, as a module of its own name
# (so the server's ``from opencomposer.sandbox.runner import ...`` finds the runner), then ``serve``.
_BOOT = """import sys, types
for name, source in {modules!r}:
    module = sys.modules[name] = types.ModuleType(name)
    exec(compile(source, name, "exec"), module.__dict__)
module.serve(sys.argv[1:])
"""


# --------------------------------------------------------------------------- framing


def send_frame(fd: int, header: dict, body: bytes = b"") -> None:
    data = memoryview(_FRAME.pack(len(h := json.dumps(header).encode()), len(body)) + h + body)
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, CHUNK))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def recv_frame(fd: int) -> tuple[dict, bytes] | None:
    """The next frame, or None once the other side has closed."""
    head = _read_exact(fd, _FRAME.size)
    if head is None:
        return None
    hlen, blen = _FRAME.unpack(head)
    data = _read_exact(fd, hlen + blen)
    if data is None:
        return None
    return json.loads(data[:hlen]), data[hlen:]


# --------------------------------------------------------------------------- the server


def server_code() -> str:
    """What ``python3 -I -S -c`` runs as a sandbox's exec server: the runner's source and this
    module's, each run as a module of its own name, then ``serve``."""
    # runs on the host only: in the sandbox no package of ours exists
    from opencomposer.sandbox import runner

    modules = []
    for name, path in ((runner.__name__, runner.__file__), (__name__, __file__)):
        with open(path, encoding="utf-8") as f:
            modules.append((name, f.read()))
    return _BOOT.format(modules=modules)


def _reap_orphans(main_pid: int) -> None:
    """As PID 1 we inherit every orphan of the sandbox; reap the dead ones (not the
    command's own process, which ``Popen`` waits for)."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == main_pid:
            return
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            return


def sweep(seconds: float = 5.0) -> None:
    """Kill every other process of the namespace and reap them (we are its PID 1)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.0005)


def not_dumpable() -> None:
    """Make this process non-dumpable (``PR_SET_DUMPABLE`` 0): with every capability dropped, the
    commands it runs (same uid) can then neither ``ptrace`` it nor open its ``/proc/PID/mem``,
    ``environ`` or ``fd``. Commands get dumpable again at ``exec``, as any new program does."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):  # not Linux: nothing to do
        pass


def _oom_score_adj(value: str) -> None:
    # Inherited at fork: commands start as the OOM killer's first choice, the server does
    # not (lowering back to 0 needs no privilege, only not below the last privileged value).
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(value)
    except OSError:
        pass


def _fresh_tmp(home: str) -> None:
    """/tmp (and HOME in it) as new for the next command, as when each had namespaces of its own."""
    for name in os.listdir("/tmp"):
        p = os.path.join("/tmp", name)
        if os.path.isdir(p) and not os.path.islink(p):
            _rmtree(p)
        else:
            os.unlink(p)
    os.makedirs(home, exist_ok=True)


def _rmtree(path: str) -> None:
    import shutil

    def fix(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)


def _exec(req: dict, body: bytes, state: dict) -> tuple[dict, bytes]:
    main = [0]

    def watch() -> str | None:
        _reap_orphans(main[0])
        while _readable(0):
            msg = recv_frame(0)
            if msg is None:
                state["host_gone"] = True
                return "the sandbox host went away"
            if msg[0].get("op") == "kill":
                return str(msg[0].get("reason") or "killed by the host")
        return None

    def started(proc) -> None:
        main[0] = proc.pid
        _oom_score_adj("0")

    _oom_score_adj("1000")
    code, cap, timed_out, killed_for, seconds = run_capped(
        req["argv"], env=req["env"], cwd=req["cwd"], stdin=body if req.get("stdin") else None,
        timeout=req["timeout"], max_output=req["max_output"], on_start=started, watch=watch, watch_every=TICK,
    )
    _oom_score_adj("0")  # also when the command could not start
    if code < 0:  # killed by a signal: report it as a shell (and bwrap) does, 128 + signal
        code = 128 - code
    sweep()
    _fresh_tmp(state["home"])
    head, tail = bytes(cap.head), bytes(cap.tail)
    return ({"code": code, "timed_out": timed_out, "killed_for": killed_for, "total": cap.total,
             "head": len(head), "seconds": seconds}, head + tail)


MAX_FILE_READ = 256 * 2**20  # bytes ``read_file`` returns at most (the whole file is sent in one frame)


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])


class _Escape(Exception):
    pass


def _confined(path: str, root: str) -> str:
    real = os.path.realpath(path)
    if real != root and not real.startswith(root + "/"):
        raise _Escape(real)
    return real


def _file(req: dict, body: bytes, root: str) -> tuple[dict, bytes]:
    try:
        real = _confined(req["path"], root)
        if req["op"] == "read":
            # never block on a FIFO or device, never load more than a file API reply may hold
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return {"error": "os", "detail": f"{req['path']} is not a regular file"}, b""
                if st.st_size > MAX_FILE_READ:
                    return {"error": "os", "detail": f"{req['path']} is {st.st_size} bytes, over the file API's "
                                                     f"{MAX_FILE_READ}"}, b""
                return {"ok": True}, f.read(MAX_FILE_READ + 1)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        with open(real, "wb") as f:
            f.write(body)
        return {"ok": True}, b""
    except _Escape as e:
        return {"error": ESCAPE, "detail": str(e)}, b""
    except FileNotFoundError as e:
        return ({"error": MISSING, "detail": str(e)} if req["op"] == "read" else {"error": "os", "detail": str(e)}), b""
    except IsADirectoryError as e:
        return {"error": ISDIR, "detail": str(e)}, b""
    except OSError as e:
        return {"error": "os", "detail": f"{type(e).__name__}: {e}"}, b""


def serve(args: list[str]) -> None:
    """The server loop. ``args``: workspace root, HOME, JSON list of (resource, soft, hard)
    rlimits, and a marker (the sandbox dir, so the host can find us by command line).

    The rlimits are set on the server itself and inherited by every command it forks (a
    ``preexec_fn`` instead would force a full fork, ~5 ms). Its own CPU time counts
    against ``RLIMIT_CPU`` too, so once it has used half the allowance it says
    ``recycle`` and exits after the reply: the host starts a fresh one (invisible to
    commands, which find /tmp fresh every time anyway).
    """
    root, home, rlimits = args[0], args[1], json.loads(args[2])
    not_dumpable()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write over the size cap fails, not kills us (commands get it back)
    cpu_budget = float("inf")
    for res, soft, hard in rlimits:
        resource.setrlimit(res, (soft, hard))
        if res == resource.RLIMIT_CPU:
            cpu_budget = soft / 2
    os.makedirs(home, exist_ok=True)
    state = {"host_gone": False, "home": home}
    send_frame(1, {"ready": os.getpid()})
    while not state["host_gone"]:
        msg = recv_frame(0)
        if msg is None:
            break
        req, body = msg
        op = req.get("op")
        if op == "exec":
            reply = _exec(req, body, state)
        elif op in ("read", "write"):
            reply = _file(req, body, root)
        elif op == "kill":  # arrived after its command ended: nothing to kill
            continue
        else:
            reply = ({"error": "os", "detail": f"unknown request {op!r}"}, b"")
        usage = resource.getrusage(resource.RUSAGE_SELF)
        recycle = usage.ru_utime + usage.ru_stime > cpu_budget
        if recycle:
            reply[0]["recycle"] = True
        try:
            send_frame(1, *reply)
        except OSError:
            break
        if recycle:
            break
    sweep()
