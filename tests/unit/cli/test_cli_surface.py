"""The CLI surface is frozen: every ``opencomposer`` command with its options, as a user types them.

A redesign moves code, not the commands people have in their scripts (issue 29). The surface
(commands, option names, which are required, flags, arguments) is compared with
``cli_surface.json``; a deliberate change rewrites it with

    python tests/unit/cli/test_cli_surface.py --write

and the diff shows in review. Run: ``pytest tests/unit/cli/test_cli_surface.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

SNAPSHOT = Path(__file__).with_name("cli_surface.json")


def surface() -> dict[str, list[dict]]:
    """Command path ("tasks make") -> its parameters, in declaration order."""
    from opencomposer.cli import app

    out: dict[str, list[dict]] = {}

    def walk(cmd, path: str) -> None:  # typer's own (vendored) click: duck-typed
        params = params_of(cmd)
        if hasattr(cmd, "commands"):
            if params:  # a group run by itself (``opencomposer eval --suite ...``)
                out[path or "(root)"] = params
            for name, sub in sorted(cmd.commands.items()):
                walk(sub, f"{path} {name}".strip())
            return
        out[path] = params

    def params_of(cmd) -> list[dict]:
        return [{"name": p.name, "opts": sorted(p.opts + p.secondary_opts), "required": p.required,
                      "kind": p.param_type_name if p.param_type_name == "argument"
                      else ("flag" if getattr(p, "is_flag", False) else "option"),
                      "multiple": bool(getattr(p, "multiple", False))}
                     for p in cmd.params if p.name not in ("install_completion", "show_completion", "help")]

    walk(typer.main.get_command(app), "")
    return out


def test_the_cli_surface_is_unchanged() -> None:
    want = json.loads(SNAPSHOT.read_text())
    got = surface()
    gone, new = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not gone and not new, f"commands removed: {gone}; added: {new} (rewrite {SNAPSHOT.name} if deliberate)"
    changed = {c: {"was": want[c], "now": got[c]} for c in want if want[c] != got[c]}
    assert not changed, f"options changed in {sorted(changed)}: {json.dumps(changed, indent=1)[:3000]}"


if __name__ == "__main__":
    if "--write" in sys.argv:
        SNAPSHOT.write_text(json.dumps(surface(), indent=1, sort_keys=True) + "\n")
    s = surface()
    print(json.dumps({"check": "cli_surface", "commands": len(s), "options": sum(map(len, s.values())),
                      "snapshot": str(SNAPSHOT)}))
