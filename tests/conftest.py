"""Shared fixtures: the converted SmolLM2 folder and a tiny random Llama that uses its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from build_engine.prepare_model import prepare_default_model
from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted on first use, about a minute)."""
    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded 2-layer random Llama with SmolLM2's tokenizer (see tests/tiny_model.py)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
