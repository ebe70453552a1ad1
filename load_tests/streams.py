"""One timed, streamed generation over each protocol the load tests speak.

  grpc_stream        Triton gRPC streaming through client.LLMClient (ensemble, or any model with its I/O)
  triton_sse_stream  Triton HTTP `/v2/models/<m>/generate_stream`: errors arrive inside the stream with
                     status 200, and no event says "final": the event with a finish_reason is the last one
  openai_sse_stream  an OpenAI-compatible `/v1/completions` with `stream: true` (vLLM)

Each returns a StreamRecord with the same clock (time.monotonic) or raises StreamError with a message:
a server error, a timeout, or a stream that ended without its final response.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import requests
from tritonclient.utils import InferenceServerException

from client.client import LLMClient


class StreamError(Exception):
    """A request that failed; the message says how."""


@dataclass
class StreamRecord:
    start: float  # when the request was sent
    end: float  # when the final response arrived
    output_tokens: int
    chunk_times: list[float] = field(default_factory=list)  # arrival of each response that carried text (gRPC: tokens)

    @property
    def ttft(self) -> float:
        return (self.chunk_times[0] if self.chunk_times else self.end) - self.start

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunks: over gRPC the responses that add tokens (one an engine step, so one
        token), over SSE those that carry text (one a step too, except when the detokenizer holds back an incomplete
        UTF-8 character for a step)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT); None for a single token."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def tok_s(self) -> float:
        """Output tokens over the request's end-to-end time."""
        return self.output_tokens / self.e2e if self.e2e > 0 else 0.0


def grpc_stream(client: LLMClient, prompt: str, max_tokens: int, chat: bool = False, ignore_eos: bool = True,
                timeout: float = 120.0) -> StreamRecord:
    """`timeout`: the longest wait for any one response."""
    start = time.monotonic()
    times: list[float] = []
    tokens, end = 0, None
    try:
        for chunk in client.stream(prompt, timeout=timeout, max_tokens=max_tokens, stream=True,
                                   ignore_eos=ignore_eos, apply_chat_template=chat or None,
                                   return_num_output_tokens=True):
            if (count := chunk.outputs.get("num_output_tokens")) is not None:
                if int(count.reshape(-1)[0]) > tokens:  # tokens, with or without text (a random model's often
                    times.append(chunk.time)  # have none: ids past its tokenizer's vocabulary)
                tokens = int(count.reshape(-1)[0])
            if chunk.final:
                end = chunk.time
    except InferenceServerException as err:
        raise StreamError(f"server error: {err.message()}") from None
    except queue.Empty:
        raise StreamError(f"timeout: no response for {timeout:.0f} s") from None
    assert end is not None  # LLMClient.stream returns only after the final response; a lost stream errors
    return StreamRecord(start, end, tokens, times)


def iter_sse(lines: Iterable[bytes | str]) -> Iterator[dict]:
    """The JSON payload of each `data:` event, up to an OpenAI-style `data: [DONE]`."""
    for line in lines:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        if not text.startswith("data:"):
            continue
        payload = text[len("data:"):].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def _post_stream(session: requests.Session, url: str, body: dict, timeout: float) -> requests.Response:
    try:
        response = session.post(url, json=body, stream=True, timeout=timeout)
    except requests.RequestException as err:
        raise StreamError(f"connection error: {err}") from None
    if response.status_code != 200:
        raise StreamError(f"HTTP {response.status_code}: {response.text[:300]}")
    return response


def _read_events(response: requests.Response, timeout: float) -> Iterator[tuple[float, dict]]:
    """(arrival time, payload) per event; `chunk_size=None` hands over each piece as it arrives."""
    try:
        with response:
            for event in iter_sse(response.iter_lines(chunk_size=None)):
                if "error" in event:
                    raise StreamError(f"server error: {event['error']}")
                yield time.monotonic(), event
    except requests.RequestException as err:  # read timeouts and dropped connections
        raise StreamError(f"timeout or connection error ({timeout:.0f} s limit): {err}") from None
    except ValueError as err:  # an event that is not JSON
        raise StreamError(f"bad event: {err}") from None


def triton_sse_stream(session: requests.Session, base_url: str, model: str, prompt: str, max_tokens: int,
                      chat: bool = False, ignore_eos: bool = True, timeout: float = 120.0) -> StreamRecord:
    body = {"text_input": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": ignore_eos,
            "return_num_output_tokens": True, "return_finish_reason": True}
    if chat:
        body["apply_chat_template"] = True
    start = time.monotonic()
    response = _post_stream(session, f"{base_url}/v2/models/{model}/generate_stream", body, timeout)
    times: list[float] = []
    tokens, end = 0, None
    for now, event in _read_events(response, timeout):
        if (count := event.get("num_output_tokens", tokens)) > tokens:  # timed as grpc_stream times them
            times.append(now)
        tokens = count
        if event.get("finish_reason"):
            end = now
    if end is None:
        raise StreamError("stream ended without a final response")
    return StreamRecord(start, end, tokens, times)


def openai_sse_stream(session: requests.Session, base_url: str, model: str, prompt: str, max_tokens: int,
                      ignore_eos: bool = True, timeout: float = 120.0) -> StreamRecord:
    """Greedy, like the Triton paths; the token count comes from the usage chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": ignore_eos, "temperature": 0.0, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    response = _post_stream(session, f"{base_url}/v1/completions", body, timeout)
    times: list[float] = []
    tokens, end = 0, None
    for now, event in _read_events(response, timeout):
        for choice in event.get("choices") or []:
            if choice.get("text"):
                times.append(now)
            if choice.get("finish_reason"):
                end = now
        if usage := event.get("usage"):
            tokens = usage["completion_tokens"]
    if end is None:
        raise StreamError("stream ended without a final response")
    return StreamRecord(start, end, tokens, times)
