"""Running one command with a timeout and an output cap, on the host or inside a sandbox.

Standard library only, on purpose: this module is both

- the process runner every backend uses (``base.run_process`` wraps ``run_capped``), and
- the exec server of a namespace sandbox: ``namespace.py`` starts it once per sandbox as
  PID 1 of the sandbox's namespaces (``python3 -I -S -c <this file's source>``, see
  ``server_code``), and sends it one request at a time over its stdin/stdout.

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

Test: ``pytest tests/unit/sandbox/test_sandbox_base.py tests/unit/sandbox/test_adversarial.py -q``.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import signal
import stat
import struct
import subprocess
import sys
import threading
import time

_CHUNK = 1 << 20  # read size; with a 1 MiB pipe a 1 GB flood is ~1000 reads
EXIT_GRACE = 0.2  # seconds we keep reading after the main process exits (see run_capped)
_TICK = 0.02  # how often the read loop looks at the clock and the process
_FRAME = struct.Struct(">II")
# Exit codes / error kinds of file requests.
ESCAPE, MISSING, ISDIR = "escape", "missing", "isdir"


# --------------------------------------------------------------------------- output


class OutputCap:
    """Keeps the first and last bytes of a stream within ``max_output`` and counts the rest.

    Memory stays O(max_output) however much is fed: the middle is dropped as it arrives.
    Half goes to the head and half to the tail, because for test runs the summary at the
    end matters as much as the first error.
    """

    def __init__(self, max_output: int):
        self.limit = max(0, int(max_output))
        self.tail_limit = self.limit // 2
        self.head_limit = self.limit - self.tail_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    @classmethod
    def from_parts(cls, limit: int, head: bytes, tail: bytes, total: int) -> OutputCap:
        """A cap as another process left it (the exec server sends head, tail and total)."""
        cap = cls(limit)
        cap.head, cap.tail, cap.total = bytearray(head), bytearray(tail), total
        return cap

    def feed(self, chunk) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_limit:
            self.tail += chunk[-self.tail_limit :]
            del self.tail[: max(0, len(self.tail) - self.tail_limit)]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def text(self) -> str:
        if not self.truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace")
        head = bytes(self.head).decode("utf-8", "replace")
        tail = bytes(self.tail).decode("utf-8", "replace")
        omitted = self.total - len(self.head) - len(self.tail)
        middle = f"\n[... {omitted} bytes omitted ...]\n" if tail else "\n"
        return (
            f"{head}{middle}{tail}\n[output truncated: {self.total} bytes total, "
            f"showing first {len(self.head)} and last {len(self.tail)}]"
        )


def observation(cap: OutputCap, timed_out: bool, killed_for: str | None, timeout: float | None) -> str:
    """The capped output plus the line saying why the command was killed, if it was."""
    out = cap.text()
    if killed_for:
        out += f"\n[killed: {killed_for}]"
    elif timed_out:
        out += f"\n[timed out after {timeout:g} s: process killed]"
    return out


# --------------------------------------------------------------------------- processes


def _feed_stdin(pipe, data: bytes) -> None:
    # A thread, so a command that reads slowly (or never) cannot deadlock the reader.
    try:
        pipe.write(data)
    except (BrokenPipeError, OSError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def kill_group(proc: subprocess.Popen) -> None:
    # The leader is not reaped yet (poll() said running), so its pgid cannot be reused.
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def run_capped(argv, *, env, cwd=None, stdin=None, timeout=60.0, max_output=32_000, on_start=None,
               preexec=None, watch=None, watch_every=0.25):
    """Run ``argv`` in its own session, stdout+stderr merged and capped, killed at ``timeout``.

    Returns ``(exit_code, cap, timed_out, killed_for, seconds)``; exit code 127 with the
    error as output if it cannot start. On timeout the whole process group gets SIGKILL.
    After the main process exits we read for at most ``EXIT_GRACE`` seconds more: a
    background job that keeps the pipe open must not hold the call hostage.

    ``preexec`` runs in the child before exec (rlimits, cgroups); ``watch`` is called
    every ``watch_every`` seconds while the command runs, and a reason it returns kills
    the command the way a timeout does.
    """
    start = time.monotonic()
    cap = OutputCap(max_output)
    try:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, start_new_session=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            preexec_fn=preexec,
        )
    except (OSError, subprocess.SubprocessError) as e:
        cap.feed(f"failed to start {argv[0]!r}: {e}".encode())
        return 127, cap, False, None, time.monotonic() - start
    if on_start is not None:
        on_start(proc)
    if stdin is not None:
        threading.Thread(target=_feed_stdin, args=(proc.stdin, stdin), daemon=True).start()
    fd = proc.stdout.fileno()
    if sys.platform.startswith("linux"):
        try:
            import fcntl

            fcntl.fcntl(fd, 1031, _CHUNK)  # F_SETPIPE_SZ: fewer, larger reads for floods
        except OSError:
            pass
    timed_out, exited_at, killed_for = False, None, None
    next_watch = start + watch_every if watch is not None else float("inf")
    buf = bytearray(_CHUNK)  # reused: a flood must not allocate a fresh chunk per read
    view = memoryview(buf)
    deadline = start + timeout if timeout and timeout > 0 else float("inf")
    # Non-blocking reads, and the clock/poll() checks at most every _TICK: a flood then
    # costs one read syscall per chunk rather than select+read+waitpid.
    os.set_blocking(fd, False)
    next_check, streaming = 0.0, False
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _TICK
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                if exited_at is None and now >= deadline:
                    timed_out = True
                    kill_group(proc)
                    exited_at = now
                if exited_at is None and now >= next_watch:
                    killed_for = watch()
                    next_watch = time.monotonic() + watch_every
                    if killed_for:
                        kill_group(proc)
                        exited_at = now
                if exited_at is not None and now - exited_at > EXIT_GRACE:
                    break
            try:
                n = os.readv(fd, [buf])
            except BlockingIOError:
                if streaming:  # let a fast writer fill the pipe: far fewer wakeups
                    time.sleep(0.001)
                    streaming = False
                else:  # EOF wakes us anyway; the clock only matters for deadlines and grace
                    limit = next_check if exited_at is not None else min(deadline, next_watch, now + 0.1)
                    sel.select(max(0.0, limit - now))
                continue
            if not n:
                break
            streaming = True
            cap.feed(view[:n])
    proc.stdout.close()
    while True:  # a command may close its output and keep running: deadline and watch still hold
        step = min(deadline, next_watch) - time.monotonic()
        try:
            code = proc.wait(timeout=None if step == float("inf") else max(0.0, step))
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                timed_out = True
            elif not (killed_for := watch()):
                next_watch = time.monotonic() + watch_every
                continue
            kill_group(proc)
            code = proc.wait()
            break
    return code, cap, timed_out, killed_for, time.monotonic() - start


# --------------------------------------------------------------------------- framing


def send_frame(fd: int, header: dict, body: bytes = b"") -> None:
    data = memoryview(_FRAME.pack(len(h := json.dumps(header).encode()), len(body)) + h + body)
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, _CHUNK))
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
    """What ``python3 -I -S -c`` runs as a sandbox's exec server."""
    with open(__file__, encoding="utf-8") as f:
        return f.read() + "\n\nserve(sys.argv[1:])\n"


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
        timeout=req["timeout"], max_output=req["max_output"], on_start=started, watch=watch, watch_every=_TICK,
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
