"""Request inputs (the llm's, as listed in backend/serving/protocol.py) -> a validated generation request.

Inputs arrive as numpy arrays (Triton gives `[1, ...]` with the batch dimension; any leading 1s are
ignored, a batch of more is refused). Every error is an InvalidRequestError that names the input and what
is allowed; the engine's own errors name its fields, which `input_error` turns back into inputs. Conventions:
- `end_id` replaces the model's EOS as the token that ends generation (TensorRT-LLM); `pad_id` is
  accepted and unused (outputs are never padded).
- `stop_words` are strings matched on the generated text, also across token boundaries; generation
  ends on the token that completes one, and that token's text is part of the output.
- `bad_words` are strings; each is banned as tokenized with and without a leading space.
- `min_length` is accepted as an alias of `min_tokens` (genai-perf sends it).
- `guided_decoding_guide_type` / `guided_decoding_guide` (tensorrtllm_backend's names) hold the output to a JSON
  schema, any JSON object, a regex, a choice list or an EBNF grammar (backend/engine/guided_decoding.py).
- `exclude_input_in_output` defaults to true: Triton's OpenAI frontend never sends it and expects only
  the completion (tensorrtllm_backend sets it at deployment; genai-perf sends true).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import numpy as np

from backend.engine.errors import InvalidRequestError
from backend.engine.guided_decoding import Guide
from backend.engine.kv_transfer import ExportedKV
from backend.engine.sampling import SamplingParams
from backend.serving.protocol import LLM, PREPROCESSING, TensorSpec, inputs_of
from backend.serving.tokenizer import encode

LLM_INPUTS = inputs_of(LLM)
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
# Past these a request is refused, naming the input, rather than tokenized, matched at every step or kept
# at the cost of every other request: the most entries of a list input and the most characters of one string
# (1 Mi characters of text_input is some 250k tokens of English, more than any context served here).
MAX_ENTRIES = {"stop_words": 256, "bad_words": 256}
MAX_CHARS = {"text_input": 1 << 20, "stop_words": 1024, "bad_words": 1024, "tenant": 4096, "cache_salt": 4096,
             "lora_name": 256,
             "guided_decoding_guide": 1 << 18}
MAX_STREAM_INTERVAL = 256
# The fields the engine names in its errors (LLMEngine.add_request, SamplingParams.validate) -> the inputs
# that set them in parse_request, so that an error names what the client sent, on every front door.
ENGINE_FIELD_INPUTS = {"prompt_token_ids": "input_ids (text_input once tokenized)",
                       "stop_token_ids": "end_id", "bad_words_ids": "bad_words",
                       "min_tokens": "min_tokens (or min_length)", "n": "num_return_sequences"}


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    stop: bool = False  # TensorRT-LLM's cancel: stop the earlier request with the same request id
    priority: int = 0
    tenant: str | None = None
    cache_salt: str | None = None  # only requests with the same salt (and tenant) share cached prompt blocks
    lora_name: str | None = None  # the LoRA adapter it runs with (or lora_task_id: tensorrtllm_backend's)
    lora_task_id: int | None = None
    stop_strings: list[str] = field(default_factory=list)
    exclude_input_in_output: bool = True
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_finish_reason: bool = False
    timeout_ms: int = 0  # end the request this long after its submission (finish reason "timeout"); 0: never
    stream_interval: int = 0  # outputs after the first merged N steps at a time (engine_thread.py); 0: the server's
    as_text: bool = False  # the prompt came as text_input: the responses carry text_output too
    kv: ExportedKV | None = None  # a remote prefill's blocks for this prompt (Dynamo decode worker)


def _read(tensor: TensorSpec, arr: np.ndarray):
    """One input's value, typed by its row of the table: a list for dims [-1] (empty strings dropped)."""
    name, kind = tensor.name, tensor.python_type
    flat, shape = np.asarray(arr).reshape(-1), list(np.shape(arr))
    if tensor.is_list:
        if np.prod(shape[:-1], dtype=np.int64) != 1:  # a batch of lists is not one request's list
            raise InvalidRequestError(name, f"expected one list (shape [1, n]), got shape {shape}")
        if flat.size > MAX_ENTRIES.get(name, flat.size):
            raise InvalidRequestError(name, f"at most {MAX_ENTRIES[name]} entries, got {flat.size}")
        if kind is str:
            return [s for s in (_text(name, v) for v in flat) if s]
        return [kind(v) for v in flat]
    if flat.size != 1:
        raise InvalidRequestError(name, f"expected one value, got shape {shape}")
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
            text = bytes(value).decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidRequestError(name, f"not valid UTF-8 ({err.reason} at byte {err.start})") from None
    else:
        text = str(value)
    if len(text) > MAX_CHARS.get(name, len(text)):
        raise InvalidRequestError(name, f"at most {MAX_CHARS[name]} characters, got {len(text)}")
    return text


def input_error(err: InvalidRequestError) -> InvalidRequestError:
    """`err` naming the request input that set the engine field it names (ENGINE_FIELD_INPUTS)."""
    name = ENGINE_FIELD_INPUTS.get(err.field)
    return err if name is None else InvalidRequestError(name, err.reason)


def parse_request(inputs: Mapping[str, np.ndarray | None], tokenizer, eos_token_ids: tuple[int, ...]) -> GenerationRequest:
    """Build a GenerationRequest from the llm model's inputs: the prompt plus optional fields.

    The prompt is `input_ids`, or `text_input` (with `apply_chat_template`) tokenized here, in which case the
    responses carry its text as well (`as_text`). Walks the llm's inputs in backend/serving/protocol.py. An
    input left out is left out of the SamplingParams / GenerationRequest too, so their defaults apply. Inputs
    named like a SamplingParams or GenerationRequest field set it; the others are turned into fields here."""
    has_ids, has_text = inputs.get("input_ids") is not None, inputs.get("text_input") is not None
    if has_ids and has_text:
        raise InvalidRequestError("input_ids or text_input", "give one of them, not both")
    given = {t.name: _read(t, inputs[t.name]) for t in LLM_INPUTS
             if t.name != "text_input" and inputs.get(t.name) is not None}
    chat = given.pop("apply_chat_template", False)
    if has_text:
        text = parse_text_prompt(inputs)
        prompt = encode(tokenizer, text.text, chat) if text.text else []
        given["as_text"] = True
    elif chat:
        raise InvalidRequestError("apply_chat_template", "applies to text_input only")
    elif has_ids:
        prompt = given.pop("input_ids")
        if not prompt and not given.get("stop"):
            raise InvalidRequestError("input_ids", "the prompt is empty")
    elif given.get("stop"):
        prompt = []  # a cancel needs no prompt
    else:
        raise InvalidRequestError("input_ids or text_input", "missing (give one of them)")

    end_id, ignore_eos = given.pop("end_id", None), given.pop("ignore_eos", False)
    stop_ids = [end_id] if end_id is not None else [] if ignore_eos else list(eos_token_ids)
    bad_words = []
    for word in given.pop("bad_words", []):
        for variant in {word, " " + word.lstrip(" ")}:
            bad_words.append(tuple(tokenizer.encode(variant, add_special_tokens=False)))
    given.pop("pad_id", None)  # accepted, unused
    if "min_length" in given:
        given.setdefault("min_tokens", given.pop("min_length"))
    if "stop_words" in given:
        given["stop_strings"] = given.pop("stop_words")
    for name in ("tenant", "cache_salt", "lora_name"):
        if name in given:
            given[name] = given[name] or None
    if given.get("lora_name") is not None and "lora_task_id" in given:
        raise InvalidRequestError("lora_name or lora_task_id", "give one of them, not both")
    if given.get("timeout_ms", 0) < 0:
        raise InvalidRequestError("timeout_ms", f"must be >= 0 (0: no deadline), got {given['timeout_ms']}")
    if not 0 <= given.get("stream_interval", 0) <= MAX_STREAM_INTERVAL:
        raise InvalidRequestError("stream_interval", f"must be in [0, {MAX_STREAM_INTERVAL}] (0: the server's), got "
                                                     f"{given['stream_interval']}")
    guide_type, guide = given.pop("guided_decoding_guide_type", None), given.pop("guided_decoding_guide", "")
    if guide_type:
        given["guided"] = Guide(guide_type, guide)
    elif guide:
        raise InvalidRequestError("guided_decoding_guide_type", "missing (the type of guided_decoding_guide)")
    sampling = {name: given.pop(name) for name in SAMPLING_FIELDS if name in given}
    if "num_return_sequences" in given:
        sampling["n"] = given.pop("num_return_sequences")
    if "return_log_probs" in given:
        sampling["logprobs"] = given.pop("return_log_probs")

    params = SamplingParams(
        **sampling,
        stop_token_ids=tuple(stop_ids),
        bad_words_ids=tuple(w for w in bad_words if w),
        ignore_eos=True,  # EOS is handled through stop_token_ids above, so end_id can replace it
    )
    return GenerationRequest(prompt_token_ids=prompt, params=params, **given)


@dataclass(frozen=True)
class TextPrompt:
    """What the text front doors (llm, preprocessing, llm_bls) read: the prompt and two flags."""

    text: str
    apply_chat_template: bool = False
    stop: bool = False  # a TensorRT-LLM cancel: no text needed


TEXT_INPUTS = {t.name: t for t in inputs_of(PREPROCESSING)}


def parse_text_prompt(inputs: Mapping[str, np.ndarray | None]) -> TextPrompt:
    """`text_input` (present, one valid UTF-8 string, not empty unless the request is a `stop`) and the flags."""
    flags = {name: _read(TEXT_INPUTS[name], inputs[name]) for name in ("apply_chat_template", "stop")
             if inputs.get(name) is not None}
    if inputs.get("text_input") is None:
        if flags.get("stop"):
            return TextPrompt("", **flags)
        raise InvalidRequestError("text_input", "missing")
    text = _read(TEXT_INPUTS["text_input"], inputs["text_input"])
    if not text and not flags.get("stop"):
        raise InvalidRequestError("text_input", "the text is empty")
    return TextPrompt(text, **flags)
