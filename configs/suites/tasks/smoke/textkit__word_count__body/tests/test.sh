#!/bin/sh
# copy tests/files over the workspace first; run from the workspace root
exec python -m pytest -p no:cacheprovider -o addopts= -rA --tb=no -q --color=no -W ignore::DeprecationWarning tests/test_strings.py::test_word_count tests/test_strings.py::test_slugify tests/test_strings.py::test_initials
