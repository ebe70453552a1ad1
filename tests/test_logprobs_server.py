"""Top logprobs through the real tritonserver (tiny model): `top_logprobs` N on every text door, streamed and not,
gives `output_top_logprob_ids` / `output_top_logprobs` with N entries per new token (flattened), the offline
engine's; a request without it gets neither output. `prompt_logprobs` N gives the prompt's logprobs (and N likeliest
per position) once, in the first response with tokens, the offline engine's; out of range is INVALID_ARG naming it.
The client CLI prints both."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from backend.engine import EngineConfig, LLMEngine
from backend.engine.sampling import SamplingParams
from backend.serving.tokenizer import encode, load_tokenizer
from client.client import LLMClient
from tests.test_server import TEXT_DOORS, wait_until_idle

PROMPT = "The capital of France is"
N, MAX_TOKENS = 5, 6
TOP = ("output_top_logprob_ids", "output_top_logprobs")
PROMPT_OUTPUTS = ("output_prompt_logprobs", "output_prompt_top_logprob_ids", "output_prompt_top_logprobs")


def offline_outputs(model_dir, params: SamplingParams) -> list:
    """The offline engine's outputs for PROMPT (no chat template)."""
    engine = LLMEngine(EngineConfig.create(model=str(model_dir)))
    engine.add_request("r", encode(load_tokenizer(model_dir), PROMPT, apply_chat_template=False), params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


@pytest.fixture(scope="module")
def offline(tiny_model_dir) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The offline engine's greedy tokens of PROMPT (no chat template), with each step's N likeliest ids and logprobs."""
    outputs = offline_outputs(tiny_model_dir, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, top_logprobs=N))
    tops = [top for out in outputs for top in out.new_top_logprobs]
    return ([t for out in outputs for t in out.new_token_ids],
            np.array([[t for t, _ in top] for top in tops]), np.array([[lp for _, lp in top] for top in tops]))


@pytest.fixture(scope="module")
def offline_prompt(tiny_model_dir) -> dict[str, np.ndarray]:
    """The offline engine's prompt logprobs of PROMPT, with N likeliest per position, as the outputs lay them out."""
    [entries] = [out.prompt_logprobs for out in offline_outputs(
        tiny_model_dir, SamplingParams(max_tokens=2, prompt_logprobs=N)) if out.prompt_logprobs is not None]
    return {"output_prompt_logprobs": np.array([e.logprob for e in entries]),
            "output_prompt_top_logprob_ids": np.array([[t for t, _ in e.top_logprobs] for e in entries]),
            "output_prompt_top_logprobs": np.array([[lp for _, lp in e.top_logprobs] for e in entries])}


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


@pytest.mark.parametrize("model", TEXT_DOORS)
@pytest.mark.parametrize("stream", [True, False])
def test_prompt_logprobs_on_every_door_are_the_offline_engines_sent_once(server, offline_prompt, model, stream):
    with LLMClient(server.url_grpc, model) as client:
        chunks = list(client.stream(PROMPT, max_tokens=3, ignore_eos=True, stream=stream, apply_chat_template=False,
                                    prompt_logprobs=N))
        plain = client.generate(PROMPT, max_tokens=2, apply_chat_template=False, top_logprobs=1)
    carrying = [i for i, c in enumerate(chunks) if "output_prompt_logprobs" in c.outputs]
    first_with_text = next(i for i, c in enumerate(chunks) if c.text)
    assert carrying == [first_with_text]  # streamed: with the first token; else in the one response with text
    got = chunks[carrying[0]].outputs
    positions = len(offline_prompt["output_prompt_logprobs"])
    np.testing.assert_allclose(got["output_prompt_logprobs"].reshape(-1), offline_prompt["output_prompt_logprobs"],
                               atol=1e-4, rtol=0)
    np.testing.assert_array_equal(got["output_prompt_top_logprob_ids"].reshape(positions, N),
                                  offline_prompt["output_prompt_top_logprob_ids"])
    np.testing.assert_allclose(got["output_prompt_top_logprobs"].reshape(positions, N),
                               offline_prompt["output_prompt_top_logprobs"], atol=1e-4, rtol=0)
    assert not set(PROMPT_OUTPUTS) & set(plain.outputs)
    wait_until_idle(server)


@pytest.mark.parametrize("model", TEXT_DOORS)
def test_prompt_logprobs_out_of_range_are_invalid_arg_naming_them(server, model):
    with LLMClient(server.url_grpc, model) as client:
        with pytest.raises(InferenceServerException) as err:
            client.generate(PROMPT, max_tokens=2, prompt_logprobs=21)
        assert "prompt_logprobs" in err.value.message() and "[0, 20]" in err.value.message(), err.value.message()
        assert client.generate(PROMPT, max_tokens=2, ignore_eos=True).text
    wait_until_idle(server)


def test_the_client_cli_prints_logprobs(server, offline, offline_prompt):
    proc = subprocess.run([sys.executable, "-m", "client", PROMPT, "--url", server.url_grpc, "--no-chat-template",
                           "--max-tokens", str(MAX_TOKENS), "--top-logprobs", "2", "--prompt-logprobs", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    prompt_lines = [line for line in lines if line.startswith("prompt token ")]
    token_lines = [line for line in lines if line.startswith("token ")]
    assert len(prompt_lines) == len(offline_prompt["output_prompt_logprobs"]) and len(token_lines) == MAX_TOKENS
    _, ids, logprobs = offline
    top = token_lines[0].split(" | ")[1].split()
    assert [int(pair.split(":")[0]) for pair in top] == ids[0, :2].tolist()
    assert float(token_lines[0].split(": ")[1].split(" |")[0]) == pytest.approx(logprobs[0, 0], abs=1e-3)
    assert prompt_lines[0].startswith("prompt token 2: ")
