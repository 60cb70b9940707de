"""``OraclePolicy``: a scripted developer that solves a task from its gold patch, through the tools.

It proves a task is solvable in the harness (every tool it needs works, the gold patch
applies from what the agent can see) and yields demonstration trajectories. It only
uses ordinary tool calls and decides from the observations it gets back:

1. ``list_dir .``, then ``search`` for the feature's symbol, then ``read_file`` around
   the first hunk of each file;
2. per hunk, ``edit_file`` with the hunk's old side (context + removed lines) as ``old``
   and its new side as ``new``;
3. if an edit fails (text not unique, or empty), it reads ``WIDEN`` lines around the hunk
   and retries with them as extra context; if that fails too, it reads the whole file
   (page by page, as a model would), applies the remaining hunks to that text with
   ``patch.apply_hunks`` and writes the result with ``write_file``;
4. an import check (or a quick pytest) with ``run``, then ``submit``.

Where the agent is offered ``replace_lines`` and not ``edit_file`` (``AgentConfig.edit_tools``;
the oracle reads the tool list it is given, or takes ``edit_with``), step 2-3 go by line
numbers instead: per hunk, it makes sure it has seen the hunk's lines numbered (the read
before, or the last edit's answer, else it reads them), checks they are the hunk's old side,
and replaces only the lines that change (the hunk's context trimmed), so a model learns to
copy numbers, not text. Lines that do not match send it to step 3's whole-file rewrite
(``write_file``, or ``replace_lines`` over every line when ``write_file`` is not offered).

``grounded=True`` (``[sft] grounded_oracle``): every location it goes to is one the agent was shown. The
search is for the symbol's definition in its file (``def name`` / ``class name``, and the class of a
method), and the first read starts at the definition line that search printed (up to ``ABOVE_DEFINITION``
lines above it where the hunk's context begins there), going on with "read further" while the first hunk
is not in view, instead of a window centred on the hunk (which only the gold
patch knows). A model imitating it learns to find the function, then the gap; imitating a read "around
line N" teaches it to name line numbers it has no way to know. Where the definition is not found, or the
hunk lies more than ``GROUNDED_SPAN`` lines below it, it reads around the hunk as before. Where the agent
is offered ``lint`` (``AgentConfig.lint_tool``), it lints the file with the search, and when the first finding
at or below the definition has the first hunk within ``LINT_WINDOW`` lines (a deleted line often leaves a name
undefined below it, or a variable unused above it), it reads around that finding instead and says why.

The script is a generator that receives each turn's observations: that is its whole
state, and it restarts when a conversation starts over. Asked for a summary
(``harness/summarize.py``), it lists its calls so far and keeps the pending observation,
so the script goes on in the next segment as if the context had never been cleared.

Test: ``pytest tests/unit/policies/test_oracle.py``; on real tasks: ``pytest tests/integration/test_oracle_by_lines.py``.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from typing import Any, Generator, Literal

from opencomposer.models.codec import format_assistant
from opencomposer.harness.fs_tools import LINE_CUT, numbered_lines
from opencomposer.harness.lint import Finding, shown_findings
from opencomposer.harness.patch import FilePatch, Hunk, PatchError, apply_hunks, parse_patch, split_lines
from opencomposer.harness.summarize import is_summary_request, summary_of
from opencomposer.protocols import Message, PolicyOutput, ToolCall

# A turn the script proposes: (prose, calls). It makes one call per turn and gets back its observation.
Turn = tuple[str, list[ToolCall]]
Script = Generator[Turn, str, None]
_READ_FURTHER = re.compile(r"start_line=(\d+) to read further")
WIDEN = 8  # lines of extra context on each side when a hunk's text is not unique
GROUNDED_SPAN = 200  # grounded: the first hunk at most this many lines below the definition, else read around it
ABOVE_DEFINITION = 3  # grounded: a read may start this many lines above the definition (the hunk's context)
GROUNDED_READS = 4  # grounded: reads from the definition on (the first, then "read further") before giving up
LINT_WINDOW = 8  # grounded with lint: the read around a finding spans this many lines on each side


class OraclePolicy:
    """Solves ``task`` (a ``tasks.format.Task``) by replaying its gold patch as tool calls."""

    def __init__(self, task: Any, check_timeout: float = 60.0, compact: bool = False,
                 edit_with: Literal["edit_file", "replace_lines"] | None = None, grounded: bool = False):
        self.task = task
        self.grounded = grounded  # go only to locations the observations showed (module docstring)
        self._definition: int | None = None  # grounded: the symbol's definition line its search printed
        self._findings: list[Finding] = []  # grounded with lint: what the lint printed of the feature's file
        # None: edit_file when the tools it is given include it, else replace_lines when they do
        self.edit_with = edit_with
        self._offered: set[str] = set()  # the tool names of the last act() (empty: the default tools)
        # compact: independent calls share a turn (list_dir + search; run + submit), as a
        # good agent batches them: 4 turns for a one-hunk task instead of 6
        self.compact = compact
        self.patches: list[FilePatch] = parse_patch(task.gold_patch)
        self.check_timeout = check_timeout
        self.name = f"oracle:{task.id}"
        self._script: Script | None = None
        self._n = 0
        self._done: list[str] = []  # one line per call made, for summaries
        self._pending = ""  # the observation the script was owed when the context was cleared

    def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> PolicyOutput:
        self._offered = {t["function"]["name"] for t in tools}
        if messages and is_summary_request(messages[-1]):
            self._pending = _last_observation(messages[:-1])
            return PolicyOutput(text=self._summary(), tool_calls=[])
        fresh = not any(m.role == "assistant" for m in messages)
        if self._script is None or (fresh and summary_of(messages) is None):
            self._script, self._n, self._done = self._plan(), 0, []
            prose, calls = next(self._script)
        else:
            try:
                observation = self._pending if fresh else _last_observation(messages)
                prose, calls = self._script.send(observation)
            except StopIteration:  # the script already submitted; say so again
                prose, calls = "Done.", [self._call("submit", message="Done.")]
        return PolicyOutput(text=format_assistant(prose, calls), tool_calls=calls)

    # ------------------------------------------------------------------ the script

    def _offers(self, name: str) -> bool:
        return not self._offered or name in self._offered

    def _edit_tool(self) -> str:
        if self.edit_with:
            return self.edit_with
        return "replace_lines" if not self._offers("edit_file") and self._offers("replace_lines") else "edit_file"

    def _call(self, name: str, **args: Any) -> ToolCall:
        self._n += 1
        shown = ", ".join(f"{k}={str(v)[:60]!r}" for k, v in args.items() if k not in ("content", "new"))
        self._done.append(f"{name}({shown})")
        return ToolCall(name, args, f"oracle_{self._n}")

    def _summary(self) -> str:
        f = self.task.meta.feature
        done = "\n".join(f"- {d}" for d in self._done[-12:])
        return (f"Task: implement `{f.symbol}` in {f.file}; the change follows the code around it.\n"
                f"Calls so far ({len(self._done)}, latest last):\n{done}\n"
                f"Next: finish the remaining edits, check the code loads, submit.")

    def _plan(self) -> Script:
        feature = self.task.meta.feature
        symbol = feature.symbol.split(".")[-1]
        suffix = feature.file.rsplit(".", 1)[-1] if "." in feature.file.rsplit("/", 1)[-1] else ""
        search = {"pattern": rf"\b{re.escape(symbol)}\b", **({"glob": f"*.{suffix}"} if suffix else {})}
        names = _definition_names(feature.symbol)
        grounded = self.grounded and suffix == "py" and names is not None and any(
            fp.path == feature.file and not fp.is_new for fp in self.patches)
        if grounded:
            search = {"pattern": _definition_pattern(*names), "path": feature.file}
        lint = grounded and "lint" in self._offered
        self._definition, self._findings = None, []
        if self.compact:
            found = yield f"Let me look at the layout, find `{symbol}`{' and lint its file' if lint else ''}.", [
                self._call("list_dir", path="."), self._call("search", **search)] + (
                [self._call("lint", path=feature.file)] if lint else [])
        else:
            yield "Let me look at the repository layout.", [self._call("list_dir", path=".")]
            found = yield f"Where is `{symbol}` defined{'' if grounded else ' and used'}?", [
                self._call("search", **search)]
            if lint:
                found += "\n" + (yield f"What does lint say about {feature.file}?", [
                    self._call("lint", path=feature.file)])
        if grounded:
            self._definition = _definition_line(found, feature.file, *names)
        if lint:
            self._findings = shown_findings(found, feature.file)
        problems: list[str] = []
        for fp in self.patches:
            problem = yield from self._patch_file(fp)
            if problem:
                problems.append(problem)
        if problems:
            message = "I could not apply every change: " + "; ".join(problems)
        else:
            files = ", ".join(fp.path for fp in self.patches)
            message = f"Implemented `{feature.symbol}` in {files}."
        if self.compact:
            yield "Check that the code loads, and finish.", [
                self._call("run", **self._check()), self._call("submit", message=message)]
        else:
            yield "Quick check that the code still loads.", [self._call("run", **self._check())]
            yield "Done.", [self._call("submit", message=message)]

    def _patch_file(self, fp: FilePatch) -> Generator[Turn, str, str]:
        """Apply one file's hunks; returns a problem description, or "" on success."""
        if fp.is_new:
            content = apply_hunks("", fp.hunks, fp.path)
            if not self._offers("write_file"):  # an empty file first, then its lines
                parent = posixpath.dirname(fp.path) or "."
                yield f"Create {fp.path}.", [self._call(
                    "run", command=f"mkdir -p -- {shlex.quote(parent)} && touch -- {shlex.quote(fp.path)}")]
                yield f"Write {fp.path}.", [self._call("replace_lines", path=fp.path, start_line=1, end_line=0,
                                                       new=content)]
                return ""
            yield f"Create {fp.path}.", [self._call("write_file", path=fp.path, content=content)]
            return ""
        if fp.is_delete:
            yield f"Remove {fp.path}.", [self._call("run", command=f"rm -- {shlex.quote(fp.path)}")]
            return ""
        first = fp.hunks[0]
        seen = None
        if fp.path == self.task.meta.feature.file and self._findings:
            seen = yield from self._read_around_finding(fp.path, first)
        if seen is None and fp.path == self.task.meta.feature.file and self._definition is not None:
            seen = yield from self._read_from_definition(fp.path, first)
        if seen is None:
            lo, hi = max(1, first.old_start - 5), first.old_start + first.old_len + 5
            seen = yield f"Read {fp.path} around line {first.old_start}.", [
                self._call("read_file", path=fp.path, start_line=lo, end_line=hi)
            ]
        if self._edit_tool() == "replace_lines":
            return (yield from self._patch_by_lines(fp, seen))
        grown = 0  # lines earlier hunks of this file added (so later ones moved down)
        for k, hunk in enumerate(fp.hunks):
            done = False
            if hunk.old_text:
                obs = yield f"Edit {fp.path}.", [
                    self._call("edit_file", path=fp.path, old=hunk.old_text, new=hunk.new_text)
                ]
                done = not obs.startswith("Error")
            if not done:
                done = yield from self._widened_edit(fp.path, hunk, hunk.old_start + grown)
            if not done:  # still not unique (or not found): compute the whole file instead
                return (yield from self._rewrite_whole(fp, k))
            grown += hunk.new_len - hunk.old_len
        return ""

    def _read_from_definition(self, path: str, hunk: Hunk) -> Generator[Turn, str, str | None]:
        """Grounded: read ``path`` from the definition line its search showed, on with "read further"
        until the hunk's old lines are in view; the observations together, or None (too far, not shown)."""
        defined = self._definition
        if defined is None or not defined - ABOVE_DEFINITION <= hunk.old_start <= defined + GROUNDED_SPAN:
            return None
        # a hunk whose context begins above the definition (a change near the top of the body; decorators)
        start = min(defined, hunk.old_start)
        want = range(hunk.old_start, hunk.old_start + max(hunk.old_len, 1))
        where = "where it is defined" if start == defined else f"just above its definition at line {defined}"
        obs = yield f"Read {path} from line {start}, {where}.", [
            self._call("read_file", path=path, start_line=start)]
        shown = [obs]
        for _ in range(GROUNDED_READS - 1):
            further = _READ_FURTHER.search(obs)
            if further is None or set(want) <= _rows_seen("\n".join(shown)).keys():
                break
            obs = yield f"Read on from line {further.group(1)}.", [
                self._call("read_file", path=path, start_line=int(further.group(1)))]
            shown.append(obs)
        return "\n".join(shown)

    def _read_around_finding(self, path: str, hunk: Hunk) -> Generator[Turn, str, str | None]:
        """Grounded with lint: the first finding the lint printed at or below the definition (the
        symbol's body), read ``LINT_WINDOW`` lines around it when that window holds the hunk's old
        lines; None (nothing read) otherwise, and the definition's read goes on as without lint."""
        below = [f for f in self._findings if self._definition is None or f.row >= self._definition]
        if not below:
            return None
        row, what = below[0].row, f"{below[0].code} {below[0].message}"
        lo, hi = max(1, row - LINT_WINDOW), row + LINT_WINDOW
        if not (lo <= hunk.old_start and hunk.old_start + max(hunk.old_len, 1) - 1 <= hi):
            return None
        symbol = self.task.meta.feature.symbol.split(".")[-1]
        return (yield f"lint flags line {row}, in `{symbol}`: {what}. The missing code is near it; "
                      f"read around line {row}.", [self._call("read_file", path=path, start_line=lo, end_line=hi)])

    def _patch_by_lines(self, fp: FilePatch, observation: str) -> Generator[Turn, str, str]:
        """Apply one file's hunks with replace_lines, from the numbered lines it has seen
        (``observation``: the read around the first hunk)."""
        seen = _rows_seen(observation)
        grown = 0
        for k, hunk in enumerate(fp.hunks):
            line = hunk.old_start + grown  # where the hunk's old side is now
            old, new = hunk.old_lines, hunk.new_lines
            if not old:  # nothing to find it by
                return (yield from self._rewrite_whole(fp, k))
            if any(line + i not in seen for i in range(len(old))):  # not seen yet (a mismatch is final)
                obs = yield f"Read {fp.path} around line {line}.", [self._call(
                    "read_file", path=fp.path, start_line=max(1, line - 3), end_line=line + len(old) + 2)]
                seen = _rows_seen(obs)
            if not _shows(seen, line, old):
                return (yield from self._rewrite_whole(fp, k))
            keep_head = _common_head(old, new)
            keep_tail = _common_head(old[keep_head:][::-1], new[keep_head:][::-1])
            start = line + keep_head
            obs = yield f"Edit {fp.path} at line {start}.", [self._call(
                "replace_lines", path=fp.path, start_line=start, end_line=line + len(old) - keep_tail - 1,
                new="".join(new[keep_head : len(new) - keep_tail]))]
            if obs.startswith("Error"):
                return (yield from self._rewrite_whole(fp, k))
            seen = _rows_seen(obs)
            grown += len(new) - len(old)
        return ""

    def _rewrite_whole(self, fp: FilePatch, k: int) -> Generator[Turn, str, str]:
        """Read the whole file, apply hunks ``k``... to it and write the result back."""
        content = yield from self._read_whole(fp.path)
        if content is None:
            return f"could not read {fp.path} in full"
        try:
            patched = apply_hunks(content, fp.hunks[k:], fp.path)
        except PatchError as e:
            return str(e)
        if self._offers("write_file") or not self._offers("replace_lines"):
            call = self._call("write_file", path=fp.path, content=patched)
        else:  # every line replaced: the one whole-file write replace_lines can make
            call = self._call("replace_lines", path=fp.path, start_line=1, end_line=len(split_lines(content)),
                              new=patched)
        yield f"Rewrite {fp.path} with the change.", [call]
        return ""

    def _widened_edit(self, path: str, hunk: Hunk, line: int) -> Generator[Turn, str, bool]:
        """Read the lines around ``line`` and retry the edit with them as extra context."""
        lo, hi = max(1, line - WIDEN), line + hunk.old_len + WIDEN
        obs = yield "Read more context around the change.", [
            self._call("read_file", path=path, start_line=lo, end_line=hi)
        ]
        rows, no_newline = numbered_lines(obs)
        if obs.startswith("Error") or not rows or LINE_CUT in obs:
            return False
        first = min(rows)
        lines = [rows[i] + "\n" for i in range(first, first + len(rows))] if len(rows) == max(rows) - first + 1 else []
        if no_newline and lines:
            lines[-1] = lines[-1][:-1]
        # Only where the patch says: the text occurs elsewhere too, so "nearest" could be wrong.
        pos = line - first
        if pos < 0 or lines[pos : pos + hunk.old_len] != hunk.old_lines:
            return False
        before, after = "".join(lines[:pos]), "".join(lines[pos + hunk.old_len :])
        if not before and not after:
            return False
        obs = yield f"Edit {path} with more context.", [
            self._call("edit_file", path=path, old=before + hunk.old_text + after, new=before + hunk.new_text + after)
        ]
        return not obs.startswith("Error")

    def _read_whole(self, path: str) -> Generator[Turn, str, str | None]:
        """Read ``path`` page by page through read_file; None if it cannot be read."""
        rows: dict[int, str] = {}
        start, no_newline = 1, False
        while True:
            obs = yield f"Read all of {path}.", [self._call("read_file", path=path, start_line=start)]
            if obs.startswith("Error"):
                return None
            if obs.startswith("(") and obs.endswith("is empty)"):
                return ""
            if LINE_CUT in obs:
                return None  # a line too long to show: the file cannot be rebuilt from what we saw
            got, no_newline = numbered_lines(obs)
            rows.update(got)
            more = _READ_FURTHER.search(obs)
            if not more:
                break
            start = int(more.group(1))
        if sorted(rows) != list(range(1, len(rows) + 1)):
            return None  # a gap means a line was cut; the text cannot be rebuilt
        text = "\n".join(rows[i] for i in range(1, len(rows) + 1))
        return text if no_newline else text + "\n"

    def _check(self) -> dict[str, Any]:
        package = self.task.meta.source.package
        if package:
            return {"command": f"python -c {shlex.quote('import ' + package)}", "timeout": self.check_timeout}
        return {"command": "python -m pytest -x -q 2>&1 | tail -n 20", "timeout": self.check_timeout}


def _definition_names(symbol: str) -> tuple[str, str | None] | None:
    """``(name, class)`` of a dotted symbol (``mod.Class.method`` -> ``("method", "Class")``; a module
    function -> ``(name, None)``), None when the last part is not an identifier."""
    parts = symbol.split(".")
    if not parts[-1].isidentifier():
        return None
    owner = parts[-2] if len(parts) > 1 and parts[-2][:1].isupper() and parts[-2].isidentifier() else None
    return parts[-1], owner


def _definition_pattern(name: str, owner: str | None) -> str:
    """A search for ``def name`` / ``class name`` lines (and ``class owner``), as the search tool takes it."""
    alts = [rf"^\s*(async\s+)?def {re.escape(name)}\b", rf"^\s*class {re.escape(name)}\b"]
    if owner:
        alts.append(rf"^\s*class {re.escape(owner)}\b")
    return "|".join(alts)


def _definition_line(observation: str, path: str, name: str, owner: str | None) -> int | None:
    """The line a search observation shows ``name`` defined on (the first after ``class owner`` for a
    method; an unindented one first for a module-level name), None when it shows none."""
    rows = []
    for line in observation.splitlines():
        m = re.match(rf"{re.escape(path)}:(\d+):(.*)$", line)
        if m:
            rows.append((int(m.group(1)), m.group(2)))
    defines = re.compile(rf"\s*(async\s+)?(def|class) {re.escape(name)}\b")
    after = 0
    if owner:
        owners = [n for n, text in rows if re.match(rf"\s*class {re.escape(owner)}\b", text)]
        if not owners:
            return None
        after = owners[0]
    found = [(n, text) for n, text in rows if n > after and defines.match(text)]
    if not owner:
        found.sort(key=lambda r: (r[1][:1].isspace(), r[0]))  # an unindented definition first
    return found[0][0] if found else None


def _rows_seen(observation: str) -> dict[int, str]:
    """The numbered lines an observation shows (none from an error)."""
    return {} if observation.startswith("Error") else numbered_lines(observation)[0]


def _shows(rows: dict[int, str], line: int, old: list[str]) -> bool:
    """Whether ``rows`` show ``old`` (lines with their newline) from ``line`` on, uncut."""
    return all(rows.get(line + i) == text.removesuffix("\n") for i, text in enumerate(old))


def _common_head(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _last_observation(messages: list[Message]) -> str:
    """The tool messages that answer the last assistant turn, in call order, one after another
    ("" if there are none)."""
    answers: list[str] = []
    for m in reversed(messages):
        if m.role == "assistant":
            break
        if m.role == "tool":
            answers.append(m.content)
    return "\n".join(reversed(answers))
