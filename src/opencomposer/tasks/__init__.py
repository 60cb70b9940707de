"""Tasks: real libraries turned into feature-deletion tasks, imported from other formats, and checked.

    opencomposer tasks make --source pypi:toolz==1.0.0 --out tasks/   # make.py: a library -> tasks
    opencomposer tasks import swebench rows.jsonl --out tasks/         # sources/: SWE-bench, Harbor, HumanEval
    opencomposer tasks export harbor tasks/ --out harbor-tasks/        # export.py
    opencomposer tasks check tasks/ --sandbox namespace                # grading/check.py validates them

``format.py`` is the task directory format (what the agent sees kept apart from what it must never
see); ``deletion/`` cuts a feature out of a library; ``leakage.py`` makes sure no copy survives.

Test: ``pytest tests/unit/tasks tests/unit/tasks/sources tests/unit/tasks/test_task_format.py -q``.
"""
