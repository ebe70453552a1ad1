"""Shared fixtures: the converted SmolLM2 folder and a tiny random Llama that uses its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.serving.model_store import prepare_default_model
from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted on first use, about a minute)."""
    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded 2-layer random Llama with SmolLM2's tokenizer (see tests/tiny_model.py)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


SERVED_MODELS = ("preprocessing", "llm", "postprocessing", "ensemble", "llm_bls")
# Small enough to make the overload test cheap: 48 running + 16 waiting beyond that are accepted at once.
LLM_TEST_SETTINGS = {"max_num_seqs": "48", "max_waiting": "16", "kv_cache_memory_gb": "0.25"}


def start_server(repo_dir: Path, model_dir: Path, llm_settings: dict[str, str]):
    """A real tritonserver on a copy of model_repository pointed at `model_dir`."""
    from backend.triton.launcher import TritonServer
    from backend.triton.repository import configure_repository

    params = {m: {"model": str(model_dir)} for m in SERVED_MODELS}
    params["llm"].update(llm_settings)
    repo = configure_repository(repo_dir, params, models=list(SERVED_MODELS))
    return TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0,
                        extra_args=["--disable-auto-complete-config"])


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    with start_server(tmp_path_factory.mktemp("repo"), tiny_model_dir, LLM_TEST_SETTINGS) as srv:
        srv.wait_ready(300)
        yield srv
