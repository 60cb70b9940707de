"""The agent harness: one loop, one tool set, one prompt for deployment, evaluation and RL.

    from opencomposer.harness import run_episode
    from opencomposer.policies import make_policy
    traj = run_episode(task.instruction, sandbox, make_policy("openai:m", base_url=url), AgentConfig())
    traj.save("runs/task.json")

Modules: ``loop`` (the episode), ``tools`` + ``fs_tools`` + ``shell_tools`` (what the
agent can do), ``prompt`` (what it is told), ``codec`` (tool calls inside local-model
text), ``trajectory`` (the JSON transcript), ``patch`` (unified diffs). The tool-call codec is
``models/codec.py``; the policies are in ``policies/``.

Test: ``pytest tests/unit/harness tests/unit/models/test_codec.py -q``.
"""

from opencomposer.harness.loop import Agent, LimitsExceeded, run_episode
from opencomposer.harness.prompt import SYSTEM_PROMPT, agent_tools, system_prompt
from opencomposer.harness.tools import TOOLS, Submitted, execute, tool_schemas
from opencomposer.harness.trajectory import EXIT_REASONS, Step, ToolEvent, Trajectory

__all__ = [
    "Agent", "EXIT_REASONS", "LimitsExceeded", "SYSTEM_PROMPT",
    "Step", "Submitted", "TOOLS", "ToolEvent", "Trajectory", "agent_tools",
    "execute", "run_episode", "system_prompt", "tool_schemas",
]
