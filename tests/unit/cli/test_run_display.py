"""``opencomposer run``'s per-step display: every figure whole, whatever the console's width."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from opencomposer.cli.run import STEP_COLUMNS, WIDE_TABLE, _cell, step_line

ROW = {"step": 2, "reward_mean": 0.0, "pass@1": 0.0, "mean_completion_tokens": 209.25, "tool_calls": 0.5,
       "invalid_calls": 0.5, "loss": -0.012345, "kl": 0.0, "grad_norm": 0.0012345, "time_rollout": 127.4,
       "time_train": 198.0, "pass@2": 0.0}


def test_step_line_has_every_figure_whole():
    line = step_line(ROW)
    assert line == ("RL step 2: reward 0 | pass@1 0 | tokens 209 | tool calls 0.5 | invalid calls 0.5 | "
                    "loss -0.0123 | kl 0 | grad norm 0.00123 | rollout 127 s | train 198 s")
    assert step_line({"step": 1, "loss": 0.5}) == "RL step 1: loss 0.5"  # figures a run did not log are left out


def test_the_table_fits_whole_from_its_width():
    # what the 80-column log used to show: headers cut to "rew…"; from WIDE_TABLE columns nothing is cut
    buf = io.StringIO()
    t = Table(*STEP_COLUMNS, title="RL step 2", title_justify="left")
    t.add_row(*(_cell(ROW.get(c)) for c in STEP_COLUMNS))
    Console(file=buf, width=WIDE_TABLE).print(t)
    text = buf.getvalue()
    assert "…" not in text and all(c in text for c in STEP_COLUMNS) and "-0.0123" in text
