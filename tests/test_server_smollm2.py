"""The real default model behind the real server (slow set): exact streaming of real multilingual text."""

from __future__ import annotations

import pytest

from backend.serving.detokenize import decode_text
from backend.engine import EngineConfig, LLMEngine
from backend.engine.sampling import SamplingParams
from backend.serving.tokenizer import encode, load_tokenizer
from client.client import LLMClient
from tests.conftest import start_server

pytestmark = pytest.mark.slow

PROMPTS = ["Write 'good morning' in Chinese, Japanese and Korean, then add three emoji.",
           "Translate to French: The weather is nice today."]


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory, smollm2_dir):
    with start_server(tmp_path_factory.mktemp("repo_smol"), smollm2_dir, {}) as srv:
        srv.wait_ready(300)
        yield srv


@pytest.mark.parametrize("model", ["llm", "ensemble", "llm_bls"])
def test_smollm2_stream_equals_whole_equals_engine(smol_server, smollm2_dir, model):
    tokenizer = load_tokenizer(smollm2_dir)
    engine = LLMEngine(EngineConfig.create(model=str(smollm2_dir)))
    with LLMClient(smol_server.url_grpc, model) as client:
        for prompt in PROMPTS:
            ids = encode(tokenizer, prompt, apply_chat_template=True)
            expected = decode_text(tokenizer, engine.generate([ids], SamplingParams(max_tokens=48))[0])
            streamed = client.generate(prompt, max_tokens=48, stream=True, apply_chat_template=True)
            whole = client.generate(prompt, max_tokens=48, stream=False, apply_chat_template=True)
            assert streamed.text == whole.text == expected
