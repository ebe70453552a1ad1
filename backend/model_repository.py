"""Copy a model repository with some config.pbtxt `parameters` changed (tests, benchmarks, engine builds)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"


def set_parameters(pbtxt: str, values: dict[str, str]) -> str:
    """Set `parameters { key: K value: { string_value: V } }` entries, adding the missing ones."""
    for key, value in values.items():
        line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        pattern = re.compile(r'parameters\s*\{\s*key:\s*"' + re.escape(key) + r'"\s*value:\s*\{[^}]*\}\s*\}')
        pbtxt, found = pattern.subn(lambda _: line, pbtxt)
        if not found:
            pbtxt = pbtxt.rstrip("\n") + "\n" + line + "\n"
    return pbtxt


def configure_repository(dst: Path, parameters: dict[str, dict[str, str]], src: Path = REPOSITORY,
                         models: list[str] | None = None) -> Path:
    """Copy `models` (default: all) from `src` to `dst`, then apply `parameters[model]` to each config."""
    dst.mkdir(parents=True, exist_ok=True)
    for model_dir in sorted(p for p in src.iterdir() if (p / "config.pbtxt").is_file()):
        if models is not None and model_dir.name not in models:
            continue
        shutil.copytree(model_dir, dst / model_dir.name, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        config = dst / model_dir.name / "config.pbtxt"
        config.write_text(set_parameters(config.read_text(), parameters.get(model_dir.name, {})))
    return dst
