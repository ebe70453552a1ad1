"""Point the `llm` Triton model at a built engine: set its runtime, engine_dir, dtype and quantization parameters."""

from __future__ import annotations

from pathlib import Path

from backend.triton.repository import set_string_parameters


def update_llm_config(config_path: str | Path, runtime: str, engine_dir: str | Path, dtype: str,
                      quantization: str = "none") -> None:
    path = Path(config_path)
    values = {"runtime": runtime, "engine_dir": str(Path(engine_dir).resolve()), "dtype": dtype,
              "quantization": quantization}
    path.write_text(set_string_parameters(path.read_text(), values))
