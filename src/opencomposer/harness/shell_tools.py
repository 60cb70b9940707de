"""Command tools: list_dir, search and run, through ``sandbox.exec``.

They run POSIX ``sh``, GNU ``find``, ``grep`` and ``awk`` inside the sandbox, so they see
exactly what the agent's own commands see. Listings and matches are capped inside the
sandbox by a small awk filter (a huge repository never floods the harness) that also
reports how many entries it left out, so every cut comes with a notice saying how to
narrow the request. ``run`` uses ``bash -c`` rather than ``bash -lc``: a login shell
re-reads /etc/profile, which resets PATH and would hide the task's Python environment.

Test: ``pytest tests/unit/harness/test_tools.py``.
"""

from __future__ import annotations

from typing import Any

from opencomposer.config import AgentConfig
from opencomposer.harness.fs_tools import ToolError
from opencomposer.protocols import ExecResult, Sandbox

LINE_WIDTH = 300  # one search hit or listing entry longer than this is cut
LOOKUP_TIMEOUT = 60.0

# Caps the lines it prints at `maxn` entries and `maxc` characters; counts what it hid.
_AWK = (
    '/^__RC__ /{rc=$2; next} /^grep: /{print "__ERR__ " $0; next} '
    "{n++; line=substr($0,1,w); if (n<=maxn && c+length(line)+1<=maxc) {print line; c+=length(line)+1; shown++}} "
    'END{print "__END__ " n-shown " " rc+0}'
)


def cap_middle(text: str, limit: int, hint: str = "") -> str:
    """Keep the head and the (usually more telling) tail of ``text``, with a notice between."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 5
    tail = limit - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} chars cut from the middle of the output{hint} ...]\n{text[-tail:]}"


def _capped(sandbox: Sandbox, producer: str, args: list[str], cfg: AgentConfig, max_entries: int):
    """Run ``producer`` (sh code using "$@") piped through the cap filter.

    Returns (entries, hidden count, exit status of the producer, error lines).
    """
    script = f"{{ {producer} ; echo \"__RC__ $?\"; }} 2>&1 | awk -v maxn={max_entries} " \
        f"-v maxc={cfg.max_output_chars - 300} -v w={LINE_WIDTH} '{_AWK}'"
    res: ExecResult = sandbox.exec(
        ["sh", "-c", script, "tool", *args],
        timeout=min(LOOKUP_TIMEOUT, cfg.command_timeout),
        max_output=cfg.max_output_chars * 2,
    )
    if res.timed_out:
        raise ToolError(f"gave up after {min(LOOKUP_TIMEOUT, cfg.command_timeout):g}s; narrow the path")
    entries, errors, hidden, rc = [], [], 0, res.exit_code
    for line in res.output.splitlines():
        if line.startswith("__END__ "):
            _, h, r = line.split()
            hidden, rc = int(h), int(r)
        elif line.startswith("__ERR__ "):
            errors.append(line[8:])
        else:
            entries.append(line)
    return entries, hidden, rc, errors


def _relative(line: str) -> str:
    return line[2:] if line.startswith("./") else line


def list_dir(sandbox: Sandbox, args: dict[str, Any], cfg: AgentConfig) -> str:
    path, depth = args.get("path", "."), args.get("depth", 2)
    if not 1 <= depth <= 5:
        raise ToolError(f"depth must be between 1 and 5, got {depth}")
    producer = (
        '[ -e "$1" ] || { echo __MISSING__; exit 0; }; [ -d "$1" ] || { echo __NOTDIR__; exit 0; }; '
        "find \"$1\" -mindepth 1 -maxdepth \"$2\" \\( -name .git -o -name __pycache__ \\) -prune "
        "-o -type d -printf '%p/\\n' -o -printf '%p\\n' 2>/dev/null | LC_ALL=C sort"
    )
    entries, hidden, _, _ = _capped(sandbox, producer, [path, str(depth)], cfg, max_entries=10**9)
    if entries[:1] == ["__MISSING__"]:
        raise ToolError(f"no such directory: {path}")
    if entries[:1] == ["__NOTDIR__"]:
        raise ToolError(f"{path} is a file, not a directory; use read_file")
    if not entries:
        return f"({path} is empty)"
    out = "\n".join(_relative(e) for e in entries)
    if hidden:
        out += f"\n[{hidden} more entries not shown; list a subdirectory or use a smaller depth]"
    return out


def search(sandbox: Sandbox, args: dict[str, Any], cfg: AgentConfig) -> str:
    pattern, path, glob = args["pattern"], args.get("path", "."), args.get("glob")
    if not pattern:
        raise ToolError("pattern is empty")
    where = f"{path}" + (f" (files matching {glob})" if glob else "")
    for mode in ("-P", "-E"):  # some grep builds lack PCRE; extended regexps are the fallback
        grep = ["grep", "-rnHI", mode, "--exclude-dir=.git", *([f"--include={glob}"] if glob else [])]
        entries, hidden, rc, errors = _capped(
            sandbox, '"$@"', [*grep, "-e", pattern, "--", path], cfg, cfg.search_max_results
        )
        if not (rc == 2 and any("-P" in e for e in errors)):
            break
    if rc == 2 and not entries:
        raise ToolError(f"search failed: {'; '.join(errors) or 'grep exited with status 2'}")
    if not entries:
        return f"No matches for /{pattern}/ in {where}."
    out = "\n".join(_relative(e) for e in entries)
    if hidden:
        out += f"\n[{hidden} more matches not shown; narrow the pattern, path or glob]"
    return out


def run(sandbox: Sandbox, args: dict[str, Any], cfg: AgentConfig) -> str:
    command = args["command"]
    if not command.strip():
        raise ToolError("command is empty")
    asked = float(args.get("timeout", cfg.command_timeout))
    if asked <= 0:
        raise ToolError(f"timeout must be a positive number of seconds, got {asked:g}")
    timeout = min(asked, cfg.command_timeout)
    limit = max(cfg.max_output_chars - 300, cfg.max_output_chars // 2)  # room for notices
    res = sandbox.exec(["bash", "-c", command], timeout=timeout, max_output=limit)
    if res.timed_out:
        status = f"timed out after {timeout:g}s: the command was killed"
    else:
        status = f"exit code {res.exit_code}"
    notes = [f"{res.seconds:.1f}s"] + ([f"timeout capped at {timeout:g}s"] if asked > timeout else [])
    hint = "; to see all of it, redirect it to a file and use search or read_file, or pipe through head/tail"
    body = res.output or "(no output)"
    if len(body) > limit + 400:  # the sandbox keeps head and tail itself; this is for a backend that doesn't
        body = cap_middle(body, limit, hint)
    if res.truncated:
        body += f"\n[the output was cut{hint}]"
    return f"{status} ({'; '.join(notes)})\n{body}"
