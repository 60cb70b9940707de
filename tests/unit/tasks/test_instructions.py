"""Instructions: short, varied, naming the missing behaviour and never quoting the deleted code;
checked over every candidate of real stdlib modules."""

from __future__ import annotations

import random
import statistics
import sysconfig
from pathlib import Path

import pytest

from opencomposer.tasks.deletion import (
    Candidate,
    definition_text,
    find_candidates,
    read_source,
)
from opencomposer.tasks.instructions import docstring_summary, make_instruction
from opencomposer.tasks.leakage import distinctive_lines

STDLIB = Path(sysconfig.get_paths()["stdlib"])

CHUNKED = '''\
    def chunked(self, iterable, n):
        """Break *iterable* into lists of length *n*. The last list may be shorter.

        >>> list(chunked([1, 2, 3], 2))
        """
        iterator = iter(iterable)
        return iter(lambda: list(islice(iterator, n)), [])
'''


def _cand(qualname: str = "chunked", file: str = "more_itertools/more.py") -> Candidate:
    return Candidate(file, qualname, qualname.rsplit(".", 1)[-1], 1, 7, 5, 3, "function", 1, 3,
                     True)


def test_docstring_summary() -> None:
    assert docstring_summary(CHUNKED, "chunked") == "Break *iterable* into lists of length *n*."
    assert docstring_summary("def f(x):\n    return x\n", "f") == ""
    old_style = 'def _split(self, text):\n    """_split(text : string) -> [string]\n\n' \
        '    Split the text to wrap into indivisible chunks.  Chunks are\n    not words.\n    """\n'
    summary = docstring_summary(old_style, "_split")
    assert summary == "Split the text to wrap into indivisible chunks."
    long = 'def f():\n    """' + "word " * 100 + '"""\n'
    summary = docstring_summary(long, "f")
    assert len(summary) <= 140 and summary.endswith("...")
    assert docstring_summary("not python at all (", "f") == ""


def test_templates_body_and_function() -> None:
    rng = random.Random(0)
    body = {make_instruction(_cand(), "body", CHUNKED, rng) for _ in range(50)}
    assert len(body) >= 3  # several phrasings
    for text in body:
        assert "`chunked`" in text and "more_itertools/more.py" in text
    assert any("Break *iterable* into lists of length *n*." in t for t in body)
    function = {make_instruction(_cand(), "function", CHUNKED, rng) for _ in range(50)}
    assert len(function) >= 2 and all("`chunked`" in t for t in function)
    plain = {make_instruction(_cand(), "function", "def chunked(x):\n    pass\n", rng)
             for _ in range(50)}
    assert "more_itertools/more.py lost `chunked`; callers still use it. Add it back." in plain
    method = {make_instruction(_cand("Chunker.chunked"), "function", CHUNKED, rng)
              for _ in range(50)}
    assert all("Chunker" in t and "chunked" in t for t in method)
    assert make_instruction(_cand(), "body", CHUNKED, random.Random(7)) == \
        make_instruction(_cand(), "body", CHUNKED, random.Random(7))  # rng decides, nothing else
    with pytest.raises(ValueError, match="unknown deletion level"):
        make_instruction(_cand(), "file", CHUNKED, rng)


@pytest.mark.parametrize("package", ["json", "textwrap.py", "email"])
def test_stdlib_instructions_short_and_free_of_code(package: str) -> None:
    rng = random.Random(0)
    lengths = []
    for cand in find_candidates(STDLIB, [package]):
        source = read_source(STDLIB / cand.file)
        for level in cand.levels:
            text = make_instruction(cand, level, definition_text(source, cand), rng)
            lengths.append(len(text))
            assert f"`{cand.name}`" in text or f"{cand.name}`" in text
            assert cand.file in text
            # every code line of the definition (docstrings are documentation, allowed)
            for line in distinctive_lines(definition_text(source, cand), 10, 10_000):
                if line.startswith(("def ", "async def ", "@")):
                    continue  # the signature names the function, as it must
                assert line not in text, (cand.id, level, line, text)
    assert len(lengths) >= 10
    assert statistics.median(lengths) < 400 and max(lengths) < 600
