"""Dynamo's preprocessed request -> GenerationRequest: every OpenAI option reaches SamplingParams or is refused
by name (backend/dynamo/request.py; no Dynamo import needed)."""

import json

import pytest

from backend.dynamo.request import generation_request
from backend.engine.errors import InvalidRequestError
from backend.engine.guided_decoding import Guide

EOS = (2,)


def _request(sampling=None, stop=None, output=None, tokens=(5, 6, 7)):
    return {"token_ids": list(tokens), "sampling_options": sampling or {}, "stop_conditions": stop or {},
            "output_options": output or {}}


def test_the_model_names_the_base_model_or_a_loaded_adapter():
    request = {**_request(), "model": "sql"}
    assert generation_request(request, EOS, 100, adapters=("sql",), served="base").lora_name == "sql"
    assert generation_request({**request, "model": "base"}, EOS, 100, ("sql",), "base").lora_name is None
    with pytest.raises(InvalidRequestError, match="^model: 'sql' is neither 'base' nor a LoRA adapter loaded"):
        generation_request(request, EOS, 100, adapters=(), served="base")


def test_every_supported_option_reaches_sampling_params():
    req = generation_request(_request(
        sampling={"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3, "repetition_penalty": 1.1,
                  "presence_penalty": 0.5, "frequency_penalty": 0.25, "n": 1, "min_p": None},
        stop={"max_tokens": 20, "min_tokens": 2, "stop": ["\n\n"], "stop_token_ids": [9],
              "stop_token_ids_hidden": [2]},
        output={"logprobs": 0}), EOS, max_model_len=100)
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.7, 0.9, 40, 3)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.1, 0.5, 0.25)
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (20, 2, True)
    assert p.stop_token_ids == (2, 9) and p.ignore_eos  # EOS travels as a stop token, as in the Triton door
    assert req.stop_strings == ["\n\n"] and req.prompt_token_ids == [5, 6, 7]


def test_defaults_fill_the_context_and_ignore_eos_drops_eos():
    req = generation_request(_request(stop={"ignore_eos": True}, sampling={"top_k": -1}), EOS, max_model_len=100)
    assert req.params.max_tokens == 97 and req.params.stop_token_ids == () and req.params.top_k == 0
    assert not req.params.logprobs


@pytest.mark.parametrize("logprobs, expected", [(None, (False, 0)), (0, (True, 0)), (5, (True, 5)), (20, (True, 20))])
def test_logprobs_n_asks_for_the_n_likeliest_tokens(logprobs, expected):
    """output_options.logprobs: chat's top_logprobs (with logprobs true), the completions API's logprobs."""
    p = generation_request(_request(output={"logprobs": logprobs}), EOS, max_model_len=100).params
    assert (p.logprobs, p.top_logprobs) == expected


@pytest.mark.parametrize("prompt_logprobs, expected", [(None, None), (0, 0), (3, 3)])
def test_prompt_logprobs_n_asks_for_the_prompts_logprobs(prompt_logprobs, expected):
    p = generation_request(_request(output={"logprobs": 5, "prompt_logprobs": prompt_logprobs}), EOS,
                           max_model_len=100).params
    assert (p.top_logprobs, p.prompt_logprobs) == (5, expected)


@pytest.mark.parametrize("field, request_", [
    ("n", _request(sampling={"n": 3})),
    ("best_of", _request(sampling={"best_of": 2})),
    ("use_beam_search", _request(sampling={"use_beam_search": True})),
    ("length_penalty", _request(sampling={"length_penalty": 0.5})),
    ("guided_decoding", _request(sampling={"guided_decoding": {"structural_tag": {"begin": "<a>"}}})),
    ("guided_decoding", _request(sampling={"guided_decoding": {"json": {}, "regex": "a+"}})),
    ("max_thinking_tokens", _request(stop={"max_thinking_tokens": 10})),
    ("prompt", _request(tokens=())),
])
def test_unsupported_options_are_refused_by_name(field, request_):
    with pytest.raises(InvalidRequestError) as err:
        generation_request(request_, EOS, max_model_len=100)
    assert err.value.field == field


@pytest.mark.parametrize("guided, guide", [
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
     Guide("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))),
    ({"json": '{"type": "object"}'}, Guide("json_schema", '{"type": "object"}')),
    ({"regex": "[0-9]+", "choice": None}, Guide("regex", "[0-9]+")),
    ({"choice": ["yes", "no"]}, Guide("choice", '["yes", "no"]')),
    ({"grammar": 'root ::= "x"', "backend": "xgrammar"}, Guide("ebnf_grammar", 'root ::= "x"')),
])
def test_guided_decoding_and_min_p_reach_sampling_params(guided, guide):
    """Dynamo's frontend turns response_format and vLLM's guided_* fields into sampling_options.guided_decoding."""
    p = generation_request(_request(sampling={"guided_decoding": guided, "min_p": 0.05}), EOS, max_model_len=100).params
    assert p.guided == guide and p.min_p == 0.05


def test_the_cache_salt_comes_from_the_routing_hints():
    """Dynamo's frontend puts OpenAI's nvext.cache_salt into `routing` (its KV router hashes with it too)."""
    req = generation_request({**_request(), "routing": {"dp_rank": 0, "cache_salt": "tenant-a"}}, EOS, max_model_len=100)
    assert req.cache_salt == "tenant-a" and generation_request(_request(), EOS, max_model_len=100).cache_salt is None
