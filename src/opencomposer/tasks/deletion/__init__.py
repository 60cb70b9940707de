"""Feature deletion: pick code worth deleting, delete it at a chosen level, write the gold patch.

Levels, from the least to the most code removed (``LEVELS``):

- ``line``: one simple statement (a ``return``, an assignment, a call) on a line of its own.
- ``block``: one compound statement (``if``/``for``/``with``/...) inside a function body.
- ``body``: the body becomes ``raise NotImplementedError``; signature and docstring stay.
- ``function``: the whole definition goes; offered only when library code still calls it.
- ``class``: a class's whole body goes (its ``class`` line and docstring stay); offered only
  when library code still uses the class.
- ``feature``: the bodies of a function and of the library functions it calls, across files.

Modules: ``candidates`` (what may be deleted and at which levels), ``edit`` (one deletion),
``feature`` (multi-function deletions), ``lines`` (line geometry), ``patch`` (gold patches).
Edits are made on lines, never via ``ast.unparse``, so every untouched byte stays as it was::

    c = find_candidates(repo, ["more_itertools"])[0]
    d = delete(read_source(repo / c.file), c, "body")   # d.after, d.removed, d.patch
    delete_in_repo(repo, c, "function")                 # the same, written to the file

Only UTF-8 sources without a BOM are candidates, so str edits are byte-exact on disk.
Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_deletion.py tests/unit/tasks``.
"""

from opencomposer.tasks.deletion.candidates import (
    FUNCTION_LEVELS,
    LEVELS,
    Candidate,
    find_candidates,
    iter_source_files,
    names_used,
    walk_defs,
)
from opencomposer.tasks.deletion.edit import (
    STUB,
    Deletion,
    apply_deletion,
    definition_text,
    delete,
    delete_in_repo,
)
from opencomposer.tasks.deletion.feature import (
    Feature,
    FeatureDeletion,
    delete_feature,
    find_features,
)
from opencomposer.tasks.deletion.lines import DeletionError, read_source
from opencomposer.tasks.deletion.patch import NO_NEWLINE, make_patch

__all__ = [
    "FUNCTION_LEVELS", "LEVELS", "NO_NEWLINE", "STUB", "Candidate", "Deletion", "DeletionError",
    "Feature", "FeatureDeletion", "apply_deletion", "definition_text", "delete", "delete_feature",
    "delete_in_repo", "find_candidates", "find_features", "iter_source_files", "make_patch",
    "names_used", "read_source", "walk_defs",
]
