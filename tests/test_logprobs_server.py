"""Top logprobs through the real tritonserver (tiny model): `top_logprobs` N on every text door, streamed and not,
gives `output_top_logprob_ids` / `output_top_logprobs` with N entries per new token (flattened), the offline
engine's; a request without it gets neither output."""

from __future__ import annotations

import numpy as np
import pytest

from backend.engine import EngineConfig, LLMEngine
from backend.engine.sampling import SamplingParams
from backend.serving.tokenizer import encode, load_tokenizer
from client.client import LLMClient
from tests.test_server import TEXT_DOORS, wait_until_idle

PROMPT = "The capital of France is"
N, MAX_TOKENS = 5, 6
TOP = ("output_top_logprob_ids", "output_top_logprobs")


@pytest.fixture(scope="module")
def offline(tiny_model_dir) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The offline engine's greedy tokens of PROMPT (no chat template), with each step's N likeliest ids and logprobs."""
    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir)))
    engine.add_request("r", encode(load_tokenizer(tiny_model_dir), PROMPT, apply_chat_template=False),
                       SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, top_logprobs=N))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    tops = [top for out in outputs for top in out.new_top_logprobs]
    return ([t for out in outputs for t in out.new_token_ids],
            np.array([[t for t, _ in top] for top in tops]), np.array([[lp for _, lp in top] for top in tops]))


@pytest.mark.parametrize("model", TEXT_DOORS)
@pytest.mark.parametrize("stream", [True, False])
def test_top_logprobs_on_every_door_are_the_offline_engines(server, offline, model, stream):
    tokens, ids, logprobs = offline
    with LLMClient(server.url_grpc, model) as client:
        chunks = list(client.stream(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, stream=stream,
                                    apply_chat_template=False, top_logprobs=N, return_log_probs=True))
        plain = client.generate(PROMPT, max_tokens=2, apply_chat_template=False, return_log_probs=True)
    got = {name: np.concatenate([c.outputs[name].reshape(-1) for c in chunks if name in c.outputs]) for name in TOP}
    sent = [c.outputs["output_top_logprob_ids"].size for c in chunks if "output_top_logprob_ids" in c.outputs]
    assert sent == ([N] * MAX_TOKENS if stream else [N * MAX_TOKENS])  # N per new token, in each response
    assert got["output_top_logprob_ids"].dtype == np.int32 and got["output_top_logprobs"].dtype == np.float32
    np.testing.assert_array_equal(got["output_top_logprob_ids"].reshape(MAX_TOKENS, N), ids)
    np.testing.assert_allclose(got["output_top_logprobs"].reshape(MAX_TOKENS, N), logprobs, atol=1e-4, rtol=0)
    greedy_logprobs = np.concatenate([c.outputs["output_log_probs"].reshape(-1) for c in chunks
                                      if "output_log_probs" in c.outputs])
    np.testing.assert_allclose(greedy_logprobs, logprobs[:, 0], atol=1e-4, rtol=0)  # greedy: the likeliest
    assert ids[:, 0].tolist() == tokens
    assert "output_log_probs" in plain.outputs and not set(TOP) & set(plain.outputs)
    wait_until_idle(server)
