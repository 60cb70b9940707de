"""Each policy version's full weights as a safetensors model directory, for engines that load
new weights from disk (vLLM's ``reload_weights``, SGLang's ``/update_weights_from_disk``).

    out = WeightsDir("runs/rl/engine_weights", config=model.config)
    path = out.write(trainer_state_dict, version=3)      # runs/rl/engine_weights/v3/model.safetensors

The directory must be one the engine's host can read (a shared filesystem when it runs
elsewhere). A version is written beside its final name and renamed into place
(``paths.staged_dir``), so an engine never reads half of one; the newest ``keep`` versions
written are kept (an engine may still be loading the one before), other version directories
(an earlier run's) removed. A weight tied to another (``lm_head`` = ``embed_tokens``) is written
once, as ``save_pretrained`` does.

Test: ``pytest tests/unit/policies/test_external_engines.py -k weights_dir``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from opencomposer.paths import remove_stale_temps, staged_dir


class WeightsDir:
    def __init__(self, root: str | Path, config: Any = None, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest version must stay")
        self.root, self.config, self.keep = Path(root), config, keep
        self.written: list[int] = []  # versions written by this object, in order

    def path(self, version: int) -> Path:
        return self.root / f"v{int(version)}"

    def write(self, state: dict[str, Any], version: int) -> Path:
        """``state`` (HF names) as ``<root>/v<version>/model.safetensors`` (+ ``config.json``
        when a config was given); returns the directory."""
        from safetensors.torch import save_file

        if not state:
            raise ValueError(f"no weights to write for version {version} (an empty state dict)")
        self.root.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.root)
        final = self.path(version)
        with staged_dir(final) as tmp:
            save_file(_untied(state), str(tmp / "model.safetensors"), metadata={"format": "pt",
                                                                               "version": str(int(version))})
            if self.config is not None:
                self.config.to_json_file(str(tmp / "config.json"))
        self._prune(int(version))
        return final

    def _prune(self, newest: int) -> None:
        """Keep the newest ``keep`` versions this object wrote; any other (an earlier run's, which
        a restarted run may number the same) goes."""
        self.written = [v for v in self.written if v != newest] + [newest]
        kept = {f"v{v}" for v in self.written[-self.keep:]}
        for p in self.root.glob("v*"):
            if p.is_dir() and p.name[1:].isdigit() and p.name not in kept:
                shutil.rmtree(p, ignore_errors=True)

def _untied(state: dict[str, Any]) -> dict[str, Any]:
    """Contiguous CPU tensors, each storage once (the first name that holds it)."""
    out, seen = {}, set()
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        out[name] = t.detach().to("cpu").contiguous()
    return out
