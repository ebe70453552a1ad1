"""Dynamo's preprocessed request (token ids + OpenAI sampling options) -> this engine's GenerationRequest.

The frontend tokenizes, applies the chat template and sends `sampling_options`, `stop_conditions` and
`output_options` (Dynamo's PreprocessedRequest). Each option either reaches SamplingParams or is refused
with an InvalidRequestError naming the OpenAI field; none is silently dropped. Stop strings go to the
engine thread, which ends generation on the token that completes one (the frontend also trims the text).
With `ignore_eos` the frontend sends no stop strings at all (a benchmark run to max_tokens).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from backend.engine.errors import InvalidRequestError
from backend.engine.guided_decoding import Guide
from backend.engine.sampling import SamplingParams
from backend.serving.request import GenerationRequest

# sampling_options key -> SamplingParams field
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
            "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "min_p": "min_p"}
# sampling options the engine does not implement, with the value that means "off"
REFUSED = {"n": 1, "best_of": 1, "use_beam_search": False, "length_penalty": 1.0}
# The engine serves n samples (the Triton doors' num_return_sequences), but Dynamo 1.6.1's frontend, given a
# token-in worker's chunks with several indices, ends the response at the first sample's finish_reason (seen).
REFUSED_WHY = {"n": "n > 1 is served on the Triton doors (num_return_sequences), not through Dynamo's frontend"}
# guided_decoding's keys (Dynamo's frontend fills them from response_format and vLLM's guided_* fields) -> Guide type
GUIDES = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf_grammar"}


def guide(options: Mapping[str, Any]) -> Guide | None:
    """The one guide of `sampling_options.guided_decoding`; a structural tag or several guides are refused."""
    given = {k: v for k, v in options.items() if v is not None and k not in ("backend", "whitespace_pattern")}
    if not given:
        return None
    if len(given) > 1 or (key := next(iter(given))) not in GUIDES:
        raise InvalidRequestError("guided_decoding", f"one of {list(GUIDES)} is supported, got {sorted(given)}")
    value = given[key]
    return Guide(GUIDES[key], value if isinstance(value, str) and key != "choice" else json.dumps(value))


def generation_request(request: Mapping[str, Any], eos_token_ids: tuple[int, ...], max_model_len: int,
                       adapters: Collection[str] = (), served: str | None = None) -> GenerationRequest:
    """`adapters`: the LoRA adapters' names, each registered by the worker as a model of its own; a request whose
    `model` is one of them runs with that adapter, one whose `model` is neither that nor `served` (the base model's
    name) is refused: the frontend may route an adapter loaded on another worker here, and the base model's output
    in its place would be silently wrong."""
    model = request.get("model")
    if served is not None and model not in (None, served, *adapters):
        raise InvalidRequestError("model", f"{model!r} is neither {served!r} nor a LoRA adapter loaded on this worker "
                                           f"(loaded: {sorted(adapters)}; load an adapter on every worker)")
    prompt = list(request.get("token_ids") or [])
    if not prompt:
        raise InvalidRequestError("prompt", "the prompt is empty")
    sampling = dict(request.get("sampling_options") or {})
    stop = dict(request.get("stop_conditions") or {})
    output = dict(request.get("output_options") or {})

    params: dict[str, Any] = {}
    for key, value in sampling.items():
        if value is None:
            continue
        if key == "guided_decoding":
            params["guided"] = guide(value)
        elif key in SAMPLING:
            params[SAMPLING[key]] = 0 if key == "top_k" and value == -1 else value  # -1: vLLM's "off"
        elif key in REFUSED:
            if value != REFUSED[key]:
                raise InvalidRequestError(key, REFUSED_WHY.get(key, "not supported by this engine") + f" (got {value!r})")
        # other keys (e.g. include_stop_str_in_output) concern the frontend's text, not the engine
    if stop.get("max_thinking_tokens") is not None:
        raise InvalidRequestError("max_thinking_tokens", "not supported by this engine")

    max_tokens = stop.get("max_tokens")
    params["max_tokens"] = max(1, max_model_len - len(prompt)) if max_tokens is None else max_tokens
    if stop.get("min_tokens") is not None:
        params["min_tokens"] = stop["min_tokens"]
    extra_stop_ids = [t for key in ("stop_token_ids", "stop_token_ids_visible", "stop_token_ids_hidden")
                      for t in stop.get(key) or ()]
    eos = () if stop.get("ignore_eos") else eos_token_ids
    params["stop_token_ids"] = tuple(dict.fromkeys([*eos, *extra_stop_ids]))

    # logprobs N: the sampled token's logprob and the N likeliest tokens' (chat's top_logprobs, completions' logprobs)
    # prompt_logprobs N: each prompt token's logprob and its N likeliest (vLLM's; the frontend's nvext.prompt_logprobs)
    logprobs = output.get("logprobs")
    params["logprobs"] = logprobs is not None
    params["top_logprobs"] = int(logprobs or 0)
    if output.get("prompt_logprobs") is not None:
        params["prompt_logprobs"] = int(output["prompt_logprobs"])

    # EOS is handled through stop_token_ids above (as the Triton door does), so the engine ignores its own
    return GenerationRequest(prompt_token_ids=prompt, params=SamplingParams(**params, ignore_eos=True),
                             stop_strings=[s for s in stop.get("stop") or () if s],
                             cache_salt=(request.get("routing") or {}).get("cache_salt") or None,  # nvext.cache_salt
                             lora_name=model if model in adapters else None)
