"""Request inputs under tensorrtllm_backend's names -> a validated generation request.

Inputs arrive as numpy arrays (Triton gives `[1, ...]` with the batch dimension; any leading 1s are
ignored). Every error is an InvalidRequestError that names the field. Conventions:
- `end_id` replaces the model's EOS as the token that ends generation (TensorRT-LLM); `pad_id` is
  accepted and unused (outputs are never padded).
- `stop_words` are strings matched on the generated text, also across token boundaries; generation
  ends on the token that completes one, and that token's text is part of the output.
- `bad_words` are strings; each is banned as tokenized with and without a leading space.
- `min_length` is accepted as an alias of `min_tokens` (genai-perf sends it).
- `exclude_input_in_output` defaults to true: Triton's OpenAI frontend never sends it and expects only
  the completion (tensorrtllm_backend sets it at deployment; genai-perf sends true).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from backend.engine.errors import InvalidRequestError
from backend.engine.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 16


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    stop: bool = False  # TensorRT-LLM's cancel: stop the earlier request with the same request id
    priority: int = 0
    tenant: str | None = None
    stop_strings: list[str] = field(default_factory=list)
    exclude_input_in_output: bool = True
    return_log_probs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_finish_reason: bool = False


def _scalar(inputs: Mapping[str, np.ndarray | None], name: str, kind: type, default):
    arr = inputs.get(name)
    if arr is None:
        return default
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise InvalidRequestError(name, f"expected one value, got shape {list(np.shape(arr))}")
    value = flat[0]
    if kind is bool:
        return bool(value)
    if kind is str:
        return _text(name, value)
    if not np.isfinite(value):
        raise InvalidRequestError(name, "must be finite")
    return kind(value)


def _text(name: str, value) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidRequestError(name, f"not valid UTF-8 ({err.reason} at byte {err.start})") from None
    return str(value)


def _strings(inputs: Mapping[str, np.ndarray | None], name: str) -> list[str]:
    arr = inputs.get(name)
    if arr is None:
        return []
    return [s for s in (_text(name, v) for v in np.asarray(arr).reshape(-1)) if s]


def parse_request(inputs: Mapping[str, np.ndarray | None], tokenizer, eos_token_ids: tuple[int, ...]) -> GenerationRequest:
    """Build a GenerationRequest from the llm model's inputs (`input_ids` plus optional fields)."""
    ids = inputs.get("input_ids")
    if ids is None:
        raise InvalidRequestError("input_ids", "missing")
    prompt = [int(t) for t in np.asarray(ids).reshape(-1)]
    if not prompt and not _scalar(inputs, "stop", bool, False):
        raise InvalidRequestError("input_ids", "the prompt is empty")

    stop_ids: list[int] = []
    end_id = _scalar(inputs, "end_id", int, None)
    ignore_eos = _scalar(inputs, "ignore_eos", bool, False)
    if end_id is not None:
        stop_ids.append(end_id)
    elif not ignore_eos:
        stop_ids.extend(eos_token_ids)
    bad_words = []
    for word in _strings(inputs, "bad_words"):
        for variant in {word, " " + word.lstrip(" ")}:
            bad_words.append(tuple(tokenizer.encode(variant, add_special_tokens=False)))
    min_tokens = _scalar(inputs, "min_tokens", int, None)
    if min_tokens is None:
        min_tokens = _scalar(inputs, "min_length", int, 0)

    params = SamplingParams(
        max_tokens=_scalar(inputs, "max_tokens", int, DEFAULT_MAX_TOKENS),
        min_tokens=min_tokens,
        temperature=_scalar(inputs, "temperature", float, 0.0),
        top_k=_scalar(inputs, "top_k", int, 0),
        top_p=_scalar(inputs, "top_p", float, 1.0),
        seed=_scalar(inputs, "seed", int, None),
        repetition_penalty=_scalar(inputs, "repetition_penalty", float, 1.0),
        presence_penalty=_scalar(inputs, "presence_penalty", float, 0.0),
        frequency_penalty=_scalar(inputs, "frequency_penalty", float, 0.0),
        stop_token_ids=tuple(stop_ids),
        bad_words_ids=tuple(w for w in bad_words if w),
        ignore_eos=True,  # EOS is handled through stop_token_ids above, so end_id can replace it
        logprobs=_scalar(inputs, "return_log_probs", bool, False),
    )
    tenant = _scalar(inputs, "tenant", str, "") or None
    return GenerationRequest(
        prompt_token_ids=prompt,
        params=params,
        stream=_scalar(inputs, "stream", bool, False),
        stop=_scalar(inputs, "stop", bool, False),
        priority=_scalar(inputs, "priority", int, 0),
        tenant=tenant,
        stop_strings=_strings(inputs, "stop_words"),
        exclude_input_in_output=_scalar(inputs, "exclude_input_in_output", bool, True),
        return_log_probs=params.logprobs,
        return_num_input_tokens=_scalar(inputs, "return_num_input_tokens", bool, False),
        return_num_output_tokens=_scalar(inputs, "return_num_output_tokens", bool, False),
        return_finish_reason=_scalar(inputs, "return_finish_reason", bool, False),
    )


def parse_text(text_input: np.ndarray | None, allow_empty: bool = False) -> str:
    """The `text_input` string of a request: present, valid UTF-8, not empty (unless the request is a `stop`)."""
    if text_input is None:
        raise InvalidRequestError("text_input", "missing")
    flat = np.asarray(text_input).reshape(-1)
    if flat.size != 1:
        raise InvalidRequestError("text_input", f"expected one string, got shape {list(np.shape(text_input))}")
    text = _text("text_input", flat[0])
    if not text and not allow_empty:
        raise InvalidRequestError("text_input", "the text is empty")
    return text
