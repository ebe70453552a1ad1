"""Shared fixtures: the converted SmolLM2 folder and a tiny random Llama that uses its tokenizer."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the GPU kernels run on CPU tensors under Triton's interpreter (read at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from backend.serving.model_store import prepare_default_model
from tests.tiny_model import TINY_LLAMA, make_tiny_llama, save_random_llama


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted on first use, about a minute)."""
    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded 2-layer random Llama with SmolLM2's tokenizer (see tests/tiny_model.py)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama exported for ONNX Runtime (float32)."""
    from build_engine.export_onnx import OPSETS, export_engine_dir

    engine_dir = tmp_path_factory.mktemp("tiny_onnx") / "engine"
    export_engine_dir(tiny_model_dir, engine_dir, "float32", OPSETS["onnxruntime"])
    return engine_dir


@pytest.fixture(scope="session")
def random_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's shapes with a 1,000-token vocabulary and no tokenizer (runs where SmolLM2 is not: GPU hosts)."""
    from transformers import LlamaConfig

    return save_random_llama(tmp_path_factory.mktemp("random_llama"),
                             LlamaConfig(vocab_size=1000, bos_token_id=1, eos_token_id=2, **TINY_LLAMA))


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


@pytest.fixture(autouse=True)
def _stream_door_answers(request: pytest.FixtureRequest) -> None:
    """Before each test on the session's server, a new gRPC stream is answered, or the server is restarted with a
    warning, as the launcher's supervisor would: Triton 2.51's stream deadlock (docs/reliability.md) once left every
    later test of a run waiting out its client timeouts."""
    if "server" not in request.fixturenames:
        return
    from backend.triton.supervisor import stream_answers

    srv = request.getfixturevalue("server")
    if not stream_answers(srv.url_grpc, 30):
        warnings.warn(f"the session's tritonserver left a new gRPC stream unanswered for 30 s (before "
                      f"{request.node.name}): restarted; its log: {srv.log_path}", stacklevel=1)
        srv.stop()
        srv.start()
        srv.wait_ready(300)


@pytest.fixture
def cancelling_server(tmp_path: Path, tiny_model_dir: Path):
    """A server of one test's own, for a test that cancels live gRPC streams: that can deadlock Triton 2.51's
    stream handler (docs/reliability.md), which must not take the session's server down with it."""
    with start_server(tmp_path / "repo", tiny_model_dir, LLM_TEST_SETTINGS) as srv:
        yield srv
