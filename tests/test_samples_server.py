"""n samples through the real tritonserver (tiny model): tensorrtllm_backend's `num_return_sequences` in, each
response's `sequence_index` out, on every text door, streamed and not; each sample's text equals the offline
engine's; one final response; every KV block free after; a bad count is an INVALID_ARG naming the input."""

from __future__ import annotations

import pytest
from tritonclient.utils import InferenceServerException

from backend.engine import EngineConfig, LLMEngine
from backend.engine.sampling import SamplingParams
from backend.serving.detokenize import decode_text
from backend.serving.tokenizer import encode, load_tokenizer
from client.client import LLMClient
from tests.test_server import TEXT_DOORS, wait_until_idle

PROMPT = "Three ways to say hello:"
N, MAX_TOKENS, SEED = 3, 8, 5


@pytest.fixture(scope="module")
def offline(tiny_model_dir) -> dict[int, str]:
    """Each sample's text from the offline engine."""
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir)))
    engine.add_request("r", encode(tokenizer, PROMPT, apply_chat_template=False),
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED, n=N, ignore_eos=True))
    ids: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            ids.setdefault(out.index, []).extend(out.new_token_ids)
    return {i: decode_text(tokenizer, tokens) for i, tokens in ids.items()}


@pytest.mark.parametrize("model", TEXT_DOORS)
@pytest.mark.parametrize("stream", [True, False])
def test_each_sample_arrives_with_its_index_and_the_offline_text(server, offline, model, stream):
    with LLMClient(server.url_grpc, model) as client:
        texts: dict[int, str] = {}
        finals = 0
        for chunk in client.stream(PROMPT, max_tokens=MAX_TOKENS, stream=stream, apply_chat_template=False,
                                   temperature=1.0, seed=SEED, num_return_sequences=N, ignore_eos=True):
            finals += chunk.final
            if "sequence_index" in chunk.outputs:
                index = int(chunk.outputs["sequence_index"].reshape(-1)[0])
                texts[index] = texts.get(index, "") + chunk.text
        assert texts == offline and finals == 1
        assert len(set(texts.values())) == N
    wait_until_idle(server)


@pytest.mark.parametrize("model", TEXT_DOORS)
def test_a_bad_count_is_invalid_arg_naming_the_input(server, model):
    with LLMClient(server.url_grpc, model) as client:
        with pytest.raises(InferenceServerException, match=r"num_return_sequences: must be in \[1, 16\]"):
            client.generate(PROMPT, max_tokens=2, num_return_sequences=17)
        assert client.generate(PROMPT, max_tokens=2, ignore_eos=True).text


def test_the_client_cli_prints_each_sample(server):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "client", PROMPT, "--url", server.url_grpc, "--max-tokens", "6",
                           "-n", "2", "--temperature", "1", "--seed", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [line[:4] for line in proc.stdout.splitlines() if line.startswith("[")] == ["[0] ", "[1] "], proc.stdout
