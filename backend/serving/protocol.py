"""The request inputs and response outputs of the served models: one table, the source for everything else.

Names follow tensorrtllm_backend, so its clients (genai-perf, Triton's OpenAI frontend) work unchanged.
Each model_repository/*/config.pbtxt, client/client.py and backend/serving/request.py's `parse_request`
follow this table; tests/test_protocol.py checks that the configs agree with it. Defaults are not here:
they live in SamplingParams (backend/engine/sampling.py) and GenerationRequest (backend/serving/request.py),
and an input left out of a request takes them.

Stdlib only: the client imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

LLM, ENSEMBLE, LLM_BLS, PREPROCESSING = "llm", "ensemble", "llm_bls", "preprocessing"
MODELS = (LLM, ENSEMBLE, LLM_BLS, PREPROCESSING)

# config.pbtxt data_type -> (the client's datatype, as tritonclient spells it; the Python type of one value)
DTYPES: dict[str, tuple[str, type]] = {
    "TYPE_BOOL": ("BOOL", bool),
    "TYPE_INT32": ("INT32", int),
    "TYPE_UINT64": ("UINT64", int),
    "TYPE_FP32": ("FP32", float),
    "TYPE_STRING": ("BYTES", str),
}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as config.pbtxt declares it (dims without the batch dimension)."""

    name: str
    dtype: str  # config.pbtxt data_type, e.g. "TYPE_INT32"
    dims: tuple[int, ...]  # (1,): one value; (-1,): a list
    models: frozenset[str]  # the models whose config.pbtxt declares it
    meaning: str
    optional: bool = False  # may a request leave it out (`optional: true`); outputs: False
    # models whose config.pbtxt declares this required input `optional: true` all the same, so that the
    # parser, not Triton, refuses a request without it (see text_input)
    parser_checked_in: frozenset[str] = frozenset()

    @property
    def client_dtype(self) -> str:
        """The datatype as tritonclient writes it: "INT32", "BYTES" for TYPE_STRING."""
        return DTYPES[self.dtype][0]

    @property
    def python_type(self) -> type:
        return DTYPES[self.dtype][1]

    @property
    def is_list(self) -> bool:
        return self.dims == (-1,)

    def declared_optional(self, model: str) -> bool:
        """Whether `model`'s config.pbtxt declares it `optional: true`."""
        return self.optional or model in self.parser_checked_in


_TEXT = frozenset({LLM, ENSEMBLE, LLM_BLS, PREPROCESSING})  # text in: the llm tokenizes it itself (one hop)
_ALL = frozenset({LLM, ENSEMBLE, LLM_BLS})  # passed on to the llm as they are
# The prompt as text: the llm takes it in place of input_ids (the default front door: one hop, no BLS); the
# ensemble's preprocessing and llm_bls tokenize it and hand the llm input_ids.
TEXT_PROMPT = ("text_input", "apply_chat_template")


def _input(name: str, dtype: str, dims: tuple[int, ...], meaning: str, models: frozenset[str] = _ALL,
           optional: bool = True, parser_checked_in: frozenset[str] = frozenset()) -> TensorSpec:
    return TensorSpec(name, dtype, dims, models, meaning, optional, parser_checked_in)


INPUTS: tuple[TensorSpec, ...] = (
    # The llm takes input_ids or text_input: it declares both optional and its parser asks for one.
    _input("input_ids", "TYPE_INT32", (-1,), "the prompt's token ids (preprocessing makes them)",
           frozenset({LLM}), optional=False, parser_checked_in=frozenset({LLM})),
    # The ensemble and preprocessing (and the llm, see input_ids) declare it optional: Triton checks only the
    # number of inputs, so a request with others but not this one passed, its step never ran and the ensemble
    # answered with an empty success; now preprocessing's parser names it. llm_bls keeps it required: Triton
    # then refuses a request with no input at all before the model (Triton 2.51 crashes on a model's error to
    # one over a gRPC stream with `triton_grpc_error`).
    _input("text_input", "TYPE_STRING", (1,), "the prompt, UTF-8; may be empty or left out in a `stop`",
           _TEXT, optional=False, parser_checked_in=frozenset({LLM, ENSEMBLE, PREPROCESSING})),
    _input("apply_chat_template", "TYPE_BOOL", (1,), "wrap text_input as one user turn of the chat template",
           _TEXT),
    _input("max_tokens", "TYPE_INT32", (1,), "most tokens to generate"),
    _input("stream", "TYPE_BOOL", (1,), "send each step's tokens as they come, else one response at the end"),
    _input("stop", "TYPE_BOOL", (1,), "cancel the earlier request with this request id (TensorRT-LLM's)",
           _ALL | {PREPROCESSING}),
    _input("end_id", "TYPE_INT32", (1,), "the token that ends generation, in place of the model's EOS"),
    _input("pad_id", "TYPE_INT32", (1,), "accepted and unused: outputs are never padded"),
    _input("stop_words", "TYPE_STRING", (-1,), "strings that end generation, matched on the text"),
    _input("bad_words", "TYPE_STRING", (-1,), "strings never generated, with and without a leading space"),
    _input("top_k", "TYPE_INT32", (1,), "sample among the k likeliest tokens; 0: off"),
    _input("top_p", "TYPE_FP32", (1,), "nucleus sampling, in (0, 1]; 1: off"),
    _input("temperature", "TYPE_FP32", (1,), "0: greedy"),
    _input("repetition_penalty", "TYPE_FP32", (1,), "HF's, over prompt and output; 1: off"),
    _input("presence_penalty", "TYPE_FP32", (1,), "OpenAI's, over the output; 0: off"),
    _input("frequency_penalty", "TYPE_FP32", (1,), "OpenAI's, over the output; 0: off"),
    _input("min_tokens", "TYPE_INT32", (1,), "fewest tokens to generate before EOS or end_id may end it"),
    _input("min_length", "TYPE_INT32", (1,), "alias of min_tokens (genai-perf sends it); min_tokens wins"),
    _input("seed", "TYPE_UINT64", (1,), "same seed, same tokens, whatever the batch"),
    _input("ignore_eos", "TYPE_BOOL", (1,), "do not stop at the model's EOS (end_id still stops)"),
    _input("return_log_probs", "TYPE_BOOL", (1,), "send output_log_probs and cum_log_probs"),
    _input("num_return_sequences", "TYPE_INT32", (1,), "samples of the prompt (OpenAI's n), in [1, 16]: each response "
           "says its sequence_index; the prompt is computed once"),
    _input("top_logprobs", "TYPE_INT32", (1,), "send the N likeliest tokens of each step and their logprobs "
                                               "(output_top_logprob_ids, output_top_logprobs), N in [0, 20]; 0: off"),
    _input("prompt_logprobs", "TYPE_INT32", (1,), "send each prompt token's logprob given the tokens before it "
           "(output_prompt_logprobs) and the N likeliest there (output_prompt_top_logprob*), N in [0, 20] "
           "(vLLM's); left out: off. The prompt is then computed whole, never taken from the prefix cache"),
    _input("exclude_input_in_output", "TYPE_BOOL", (1,), "leave the prompt out of a non-streamed output"),
    _input("return_num_input_tokens", "TYPE_BOOL", (1,), "send num_input_tokens"),
    _input("return_num_output_tokens", "TYPE_BOOL", (1,), "send num_output_tokens"),
    _input("return_finish_reason", "TYPE_BOOL", (1,), "send finish_reason"),
    _input("priority", "TYPE_INT32", (1,), "lower is served first"),
    _input("tenant", "TYPE_STRING", (1,), "the tenant whose quota the request counts against; empty: none"),
    _input("cache_salt", "TYPE_STRING", (1,), "only requests with the same salt (and tenant) share cached prompt "
                                              "blocks (vLLM's); empty: none"),
    _input("lora_name", "TYPE_STRING", (1,), "the LoRA adapter to run with, by the name the llm loaded it under "
                                             "(its lora_modules); empty: the base model"),
    _input("lora_task_id", "TYPE_UINT64", (1,), "tensorrtllm_backend's: the adapter by its task id (1, 2, ... in "
                                                "the order of the llm's lora_modules); lora_weights and lora_config "
                                                "are not taken: adapters load from their folders"),
    _input("timeout_ms", "TYPE_INT32", (1,), "end the request this long after it arrived, finish reason "
                                             "`timeout`, with what it generated so far; 0: no deadline"),
    _input("stream_interval", "TYPE_INT32", (1,), "after the first, send the tokens of N engine steps in one "
                                                  "response (the last at once); 0: the llm's stream_interval"),
    _input("min_p", "TYPE_FP32", (1,), "drop tokens below min_p x the likeliest token's probability, in [0, 1]; "
                                       "0: off"),
    _input("guided_decoding_guide_type", "TYPE_STRING", (1,), "hold the output to a guide: json (any object), "
           "json_schema, regex, choice, ebnf_grammar (tensorrtllm_backend's names, plus choice)"),
    _input("guided_decoding_guide", "TYPE_STRING", (1,), "the JSON schema, regex, choices (a JSON list of strings) "
                                                         "or EBNF grammar; none for json"),
)

_IDS = frozenset({LLM})
_TEXT_OUT = frozenset({LLM, ENSEMBLE, LLM_BLS})
_BOTH = _IDS | _TEXT_OUT

OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("output_ids", "TYPE_INT32", (-1,), _IDS, "the token ids not sent before"),
    TensorSpec("context_ids", "TYPE_INT32", (-1,), _IDS, "ids before output_ids, for exact text"),
    TensorSpec("is_final", "TYPE_BOOL", (1,), _IDS, "the request's last response"),
    TensorSpec("text_output", "TYPE_STRING", (1,), _TEXT_OUT,
               "the text of output_ids, UTF-8 (from the llm: when the request gave text_input)"),
    TensorSpec("output_log_probs", "TYPE_FP32", (-1,), _BOTH, "logprob of each new token (return_log_probs)"),
    TensorSpec("cum_log_probs", "TYPE_FP32", (1,), _BOTH, "sum of the logprobs so far (return_log_probs)"),
    TensorSpec("sequence_index", "TYPE_INT32", (1,), _BOTH, "the sample a response is of (num_return_sequences > 1)"),
    TensorSpec("output_top_logprobs", "TYPE_FP32", (-1,), _BOTH,
               "top_logprobs logprobs per new token, likeliest first, flattened (top_logprobs)"),
    TensorSpec("output_top_logprob_ids", "TYPE_INT32", (-1,), _BOTH,
               "the token ids of output_top_logprobs (top_logprobs)"),
    TensorSpec("output_prompt_logprobs", "TYPE_FP32", (-1,), _BOTH,
               "the logprob of prompt tokens 2, 3, ... given those before, in the first response (prompt_logprobs)"),
    TensorSpec("output_prompt_top_logprobs", "TYPE_FP32", (-1,), _BOTH,
               "prompt_logprobs logprobs per prompt token after the first, likeliest first, flattened"),
    TensorSpec("output_prompt_top_logprob_ids", "TYPE_INT32", (-1,), _BOTH,
               "the token ids of output_prompt_top_logprobs (prompt_logprobs)"),
    TensorSpec("num_input_tokens", "TYPE_INT32", (1,), _BOTH, "prompt tokens (return_num_input_tokens)"),
    TensorSpec("num_output_tokens", "TYPE_INT32", (1,), _BOTH, "tokens generated (return_num_output_tokens)"),
    TensorSpec("finish_reason", "TYPE_STRING", (1,), _BOTH,
               "stop, length, cancelled, timeout (return_finish_reason)"),
)


def inputs_of(model: str) -> tuple[TensorSpec, ...]:
    """The inputs `model`'s config.pbtxt declares, in table order."""
    return tuple(t for t in INPUTS if model in t.models)


def outputs_of(model: str) -> tuple[TensorSpec, ...]:
    """The outputs of llm, ensemble or llm_bls, in table order."""
    return tuple(t for t in OUTPUTS if model in t.models)
