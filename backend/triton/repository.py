"""Edit config.pbtxt `parameters`, and copy a model repository with some of them changed (tests, benchmarks,
`python -m build_engine --llm-config`).

Only the matched `parameters { key: "..." value: { string_value: "..." } }` entries change (the rest of the
file, comments and layout included, stays as written); a missing key is added after the last parameters
entry, or at the end."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"

_ENTRY = (r'(?P<head>parameters\s*:?\s*\{{\s*key\s*:\s*"{key}"\s*value\s*:?\s*\{{\s*string_value\s*:\s*)'
          r'"(?P<value>(?:[^"\\]|\\.)*)"(?P<tail>\s*\}}\s*\}})')
_ANY_ENTRY = re.compile(_ENTRY.format(key=r'(?P<key>[^"]*)'))


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def set_string_parameters(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        entry = re.compile(_ENTRY.format(key=re.escape(key)))
        if entry.search(text):
            text = entry.sub(lambda m: m["head"] + _quote(value) + m["tail"], text)
            continue
        line = f"parameters {{ key: {_quote(key)} value: {{ string_value: {_quote(value)} }} }}"
        entries = list(_ANY_ENTRY.finditer(text))
        if entries:
            end = entries[-1].end()
            text = text[:end] + "\n" + line + text[end:]
        else:
            text = text.rstrip("\n") + "\n" + line + "\n"
    return text


def string_parameters(text: str) -> dict[str, str]:
    """A config.pbtxt's string `parameters`, by key (what the model's `initialize` reads)."""
    return {m["key"]: re.sub(r"\\(.)", r"\1", m["value"]) for m in _ANY_ENTRY.finditer(text)}


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
        config.write_text(set_string_parameters(config.read_text(), parameters.get(model_dir.name, {})))
    return dst
