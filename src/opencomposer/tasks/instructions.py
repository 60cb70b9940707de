"""Instructions: the terse request an agent gets for a deleted feature, as a developer writes one.

An instruction names the missing behaviour (symbol, file, and a one-line summary taken from
the first sentence of the docstring) and never the solution: no code from the deleted body.
Several phrasings, picked by ``rng``, so a policy cannot learn to key on one template::

    make_instruction(cand, "body", function_source, random.Random(0))
    # "`chunked` in more_itertools/more.py raises NotImplementedError. Implement it so it
    #  behaves as its docstring and the rest of the library expect."

Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_instructions.py``.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap

from opencomposer import pyparse
from opencomposer.tasks.deletion import LEVELS, Candidate

MAX_SUMMARY = 140  # characters of docstring summary; keeps the median instruction short

# {sym}: `name` or `Class.method`; {file}: workspace path; {what}: the docstring summary.
BODY = [
    "{sym} in {file} raises NotImplementedError. Implement it so it behaves as the rest of "
    "the library expects.",
    "{sym} ({file}) is only a stub that raises NotImplementedError. Write the real body.",
    "The body of {sym} in {file} is missing. Implement it so the library works again.",
    "{file}: {sym} is unimplemented. Fill it in.",
]
BODY_WHAT = [
    "{sym} in {file} raises NotImplementedError. Implement it so it behaves as its docstring "
    "and the rest of the library expect.",
    "{sym} in {file} raises NotImplementedError. Implement it: {what}",
    "Implement {sym} in {file} (it currently raises NotImplementedError). "
    "Its docstring says: {what}",
    "{file}: {sym} is a stub. It should do what its docstring says: {what}",
]
FUNCTION = [
    "{file} lost {sym}; callers still use it. Add it back.",
    "{sym} was removed from {file}, but the rest of the library still uses it. Restore it.",
    "Add the missing {sym} to {file} so its callers work again.",
]
FUNCTION_WHAT = [
    "{file} lost {sym}; callers still use it. Add it back. It should: {what}",
    "Restore {sym} in {file}; the library still uses it. What it did: {what}",
    "{sym} is missing from {file} and callers break. Bring it back: {what}",
]
METHOD = [  # "method" would be wrong for a property, so the wording avoids it
    "Class `{cls}` in {file} lost `{name}`; callers still use it. Add it back.",
    "{sym} was removed from {file}, but the library still uses it. Restore it.",
]
METHOD_WHAT = [
    "Class `{cls}` in {file} lost `{name}`, which callers still use. Add it back: {what}",
    "Restore {sym} in {file}; it is still used. What it did: {what}",
]
LINE = [  # one line: the easiest rung, for a small model's first RL steps
    "One line was deleted from {sym} in {file}. Put it back.",
    "{sym} ({file}) is missing a single line and no longer behaves as the library expects. Restore it.",
    "{file}: a line of {sym} was removed. Find where and add it back.",
]
LINE_WHAT = [
    "One line was deleted from {sym} in {file}. Put it back. It should: {what}",
    "{sym} ({file}) is missing a single line. Restore it so it does what its docstring says: {what}",
]
BLOCK = [  # a block: the agent must find what is missing inside a body that still runs
    "{sym} in {file} is missing part of its logic ({n} lines were removed). Restore them.",
    "Something was cut out of {sym} ({file}); it no longer behaves as the library expects. Fix it.",
    "{file}: a {n}-line piece of {sym} was deleted. Put the missing logic back.",
]
BLOCK_WHAT = [
    "{sym} in {file} is missing part of its logic ({n} lines were removed). It should: {what}",
    "Something was cut out of {sym} ({file}). Restore it so it does what its docstring says: {what}",
]
CLASS = [
    "Class {sym} in {file} is an empty shell: its methods and attributes are gone. Implement it.",
    "{file}: class {sym} lost its whole body, and the code that uses it breaks. Write it.",
    "Implement class {sym} in {file}; only its name and docstring are left.",
]
FEATURE = [  # several bodies at once, possibly across files
    "{sym} in {file} and the functions it relies on ({others}) raise NotImplementedError. "
    "Implement all of them.",
    "A feature is missing: {sym} ({file}) and its helpers {others} are stubs. Implement them.",
    "Implement {sym} in {file} together with {others}; all of them are unimplemented.",
]


def make_instruction(
    cand: Candidate, level: str, source_text_of_function: str, rng: random.Random,
    members: tuple[Candidate, ...] = (),
) -> str:
    """A one- or two-sentence instruction for deleting ``cand`` at ``level`` (see
    ``deletion.LEVELS``); ``members`` are the other functions of a ``feature`` deletion.

    ``source_text_of_function`` is the original definition (decorators optional); only its
    docstring is read.
    """
    what = docstring_summary(source_text_of_function, cand.name)
    if level == "body":
        templates = BODY_WHAT if what else BODY
    elif level == "function":
        is_method = "." in cand.qualname
        templates = (METHOD_WHAT if what else METHOD) if is_method else (
            FUNCTION_WHAT if what else FUNCTION)
    elif level == "line":
        templates = LINE_WHAT if what else LINE
    elif level == "block":
        templates = BLOCK_WHAT if what else BLOCK
    elif level == "class":
        templates = CLASS
    elif level == "feature":
        templates = FEATURE
    else:
        raise ValueError(f"{cand.id}: unknown deletion level {level!r}; use one of {LEVELS}")
    cls, _, name = cand.qualname.rpartition(".")
    others = ", ".join(f"`{m.qualname}`" + ("" if m.file == cand.file else f" ({m.file})")
                       for m in members if m is not cand)
    n = cand.block[1] - cand.block[0] + 1 if cand.block else 0
    return rng.choice(templates).format(
        sym=f"`{cand.qualname}`", file=cand.file, what=what, cls=cls, name=name, others=others, n=n
    )


def docstring_summary(source_text_of_function: str, name: str = "") -> str:
    """The docstring's first sentence, one line, at most MAX_SUMMARY characters; "" if none.

    Skips a leading repeated signature and doctest/reST lines.
    """
    doc = _docstring(source_text_of_function)
    if not doc:
        return ""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc) if p.strip()]
    for para in paragraphs:
        if name:  # drop a repeated signature: "_split(text : string) -> [string]"
            para = re.sub(rf"^{re.escape(name)}\(.*?\)(\s*->\s*\S+)?[\s.:-]*", "", para)
        if not para or para.startswith((">>>", "..", ":")):
            continue
        return _truncate(re.split(r"(?<=[.!?])\s+(?=[A-Z(`\"'])", para, maxsplit=1)[0])
    return ""


def _docstring(source: str) -> str | None:
    """The first definition's docstring; tolerant of indentation (methods come indented)."""
    text = textwrap.dedent(source)
    for attempt in (text, "class _:\n" + text):
        try:
            tree = pyparse.parse(attempt)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return ast.get_docstring(node)
    return None


def _truncate(text: str) -> str:
    if len(text) <= MAX_SUMMARY:
        return text
    cut = text[: MAX_SUMMARY - 3].rsplit(" ", 1)[0]
    return cut.rstrip(",;:") + "..."
