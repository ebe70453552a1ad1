"""Point the `llm` Triton model at a built engine: set string parameters in its config.pbtxt text.

Only the matched `parameters { key: "..." value: { string_value: "..." } }` entries change (the rest
of the file, comments and layout included, stays as written); a missing key is added after the last
parameters entry, or at the end.
"""

from __future__ import annotations

import re
from pathlib import Path

_ENTRY = (r'(parameters\s*:?\s*\{{\s*key\s*:\s*"{key}"\s*value\s*:?\s*\{{\s*string_value\s*:\s*)'
          r'"(?:[^"\\]|\\.)*"(\s*\}}\s*\}})')
_ANY_ENTRY = re.compile(_ENTRY.format(key=r'[^"]*'))


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def set_string_parameters(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        entry = re.compile(_ENTRY.format(key=re.escape(key)))
        if entry.search(text):
            text = entry.sub(lambda m: m.group(1) + _quote(value) + m.group(2), text)
            continue
        line = f"parameters {{ key: {_quote(key)} value: {{ string_value: {_quote(value)} }} }}"
        entries = list(_ANY_ENTRY.finditer(text))
        if entries:
            end = entries[-1].end()
            text = text[:end] + "\n" + line + text[end:]
        else:
            text = text.rstrip("\n") + "\n" + line + "\n"
    return text


def update_llm_config(config_path: str | Path, runtime: str, engine_dir: str | Path, dtype: str) -> None:
    path = Path(config_path)
    values = {"runtime": runtime, "engine_dir": str(Path(engine_dir).resolve()), "dtype": dtype}
    path.write_text(set_string_parameters(path.read_text(), values))
