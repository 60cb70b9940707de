#!/bin/sh
# copy tests/files over the workspace first; run from the workspace root
exec python -m pytest -p no:cacheprovider -o addopts= -rA --tb=no -q --color=no -W ignore::DeprecationWarning tests/test_numbers.py::test_clamp tests/test_numbers.py::test_mean
