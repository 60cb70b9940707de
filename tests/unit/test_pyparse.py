"""pyparse.parse: the shared parse keeps the code's own warnings out of the log."""

from __future__ import annotations

import ast
import warnings

import pytest

from opencomposer.pyparse import parse


def test_an_invalid_escape_parses_without_a_warning_even_when_warnings_are_errors():
    source = 'PATTERN = "\\w+"\n'  # the file holds a backslash then w: an invalid escape in a plain string
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tree = parse(source)
    (assign,) = tree.body
    assert isinstance(assign.value, ast.Constant) and assign.value.value == "\\w+"


def test_a_syntax_error_still_raises_naming_the_file():
    with pytest.raises(SyntaxError) as e:
        parse("def f(:\n", "pkg/mod.py")
    assert e.value.filename == "pkg/mod.py" and e.value.lineno == 1
