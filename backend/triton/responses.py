"""Engine outputs -> the llm model's response tensors, per request.

Each response carries the ids not yet sent (`output_ids`), up to CONTEXT_TOKENS ids before them
(`context_ids`) and `is_final`, which is all the stateless postprocessing needs for exact text
(backend/serving/detokenize.py). A request that came as text_input gets `text_output` in place of
`context_ids`, decoded here by one incremental detokenizer per request (the output thread sends each
request's outputs in order). Streaming sends every step's tokens; otherwise one response at the end, holding
the prompt too when `exclude_input_in_output` is false; a prompt's logprobs go in the first response with
tokens. Optional outputs are present only when their
`return_*` input asked for them. A request of n > 1 samples (`num_return_sequences`) has one builder per sample
(`Responses`), each response says its `sequence_index`, and only the last sample's last response is final.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from transformers import PreTrainedTokenizerBase

from backend.serving.detokenize import IncrementalDetokenizer, context_before
from backend.engine.engine import RequestOutput
from backend.engine.sampling import Sampled
from backend.serving.request import GenerationRequest


def _row(values, dtype) -> np.ndarray:
    return np.asarray(values, dtype=dtype).reshape(1, -1)


def _text(text: str) -> np.ndarray:
    return _row([text.encode("utf-8")], np.object_)


def _prompt_logprobs(entries: list[Sampled]) -> dict[str, np.ndarray]:
    """The prompt_logprobs outputs: each prompt token's logprob after the first, then the likeliest ones, flattened."""
    return {"output_prompt_logprobs": _row([e.logprob for e in entries], np.float32),
            "output_prompt_top_logprobs": _row([lp for e in entries for _, lp in e.top_logprobs], np.float32),
            "output_prompt_top_logprob_ids": _row([t for e in entries for t, _ in e.top_logprobs], np.int32)}


@dataclass
class ResponseBuilder:
    request: GenerationRequest
    tokenizer: PreTrainedTokenizerBase | None = None  # for text_output (requests that came as text)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: dict[str, np.ndarray] = field(default_factory=dict)  # held for the next response sent
    sent: int = 0
    detokenizer: IncrementalDetokenizer | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.request.as_text:
            self.detokenizer = IncrementalDetokenizer(self.tokenizer)

    def build(self, out: RequestOutput) -> dict[str, np.ndarray] | None:
        """Tensors for the response to send now, or None when this output is held (not streaming)."""
        self.output_ids += out.new_token_ids
        self.logprobs += [lp if lp is not None else 0.0 for lp in out.new_logprobs]
        self.top_logprobs += out.new_top_logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = _prompt_logprobs(out.prompt_logprobs)
        req = self.request
        if not req.stream and not out.finished:
            return None
        new, context = self.output_ids[self.sent:], context_before(self.output_ids, self.sent)
        new_logprobs, new_top = self.logprobs[self.sent:], self.top_logprobs[self.sent:]
        self.sent = len(self.output_ids)
        if not req.stream and not req.exclude_input_in_output:
            new, context = req.prompt_token_ids + new, []
        tensors = self._tokens(new, context, out.finished)
        if req.params.logprobs:
            tensors["output_log_probs"] = _row(new_logprobs, np.float32)
            tensors["cum_log_probs"] = _row([sum(self.logprobs)], np.float32)
        if req.params.top_logprobs:  # top_logprobs entries per new token, flattened
            tensors["output_top_logprobs"] = _row([lp for top in new_top for _, lp in top], np.float32)
            tensors["output_top_logprob_ids"] = _row([t for top in new_top for t, _ in top], np.int32)
        tensors |= self.prompt_logprobs
        self.prompt_logprobs = {}
        if req.return_num_input_tokens:
            tensors["num_input_tokens"] = _row([out.num_prompt_tokens], np.int32)
        if req.return_num_output_tokens:
            tensors["num_output_tokens"] = _row([out.num_output_tokens], np.int32)
        if req.return_finish_reason:
            tensors["finish_reason"] = _text(out.finish_reason or "")
        if req.params.n > 1:
            tensors["sequence_index"] = _row([out.index], np.int32)
        return tensors

    def final_empty(self) -> dict[str, np.ndarray]:
        """The final response of a request that produced nothing (e.g. a `stop` request)."""
        return self._tokens([], [], True)

    def _tokens(self, new: list[int], context: list[int], final: bool) -> dict[str, np.ndarray]:
        """The ids and `is_final`, then `context_ids` for the postprocessing model, or the text they add."""
        tensors = {"output_ids": _row(new, np.int32), "is_final": _row([final], np.bool_)}
        if self.detokenizer is None:
            tensors["context_ids"] = _row(context, np.int32)
        else:
            tensors["text_output"] = _text(self.detokenizer.push(new, final=final))
        return tensors


@dataclass
class Responses:
    """A request's builders, one per sample: `build` as ResponseBuilder's, for the sample the output is of."""

    first: ResponseBuilder
    samples: dict[int, ResponseBuilder] = field(default_factory=dict)

    def build(self, out: RequestOutput) -> dict[str, np.ndarray] | None:
        if out.index not in self.samples:
            self.samples[out.index] = self.first if not self.samples else ResponseBuilder(self.first.request,
                                                                                          self.first.tokenizer)
        return self.samples[out.index].build(out)
