"""Streaming gRPC client for the text front doors: `llm` (text in, text out in one hop; the default),
`ensemble` and `llm_bls` (tensorrtllm_backend's I/O names).

Cancelling sends TensorRT-LLM's `stop` (same request id), which works through the ensemble too. A stream is
closed only after its last final response: cancelling a gRPC stream that the server is still writing to
deadlocked Triton 2.51's stream handler (docs/reliability.md).
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend.serving.protocol import ENSEMBLE, inputs_of, outputs_of

# The ensemble's inputs and outputs; llm_bls has the same, and the llm takes and gives them all too
# (backend/serving/protocol.py).
INPUT_TYPES = {t.name: t.client_dtype for t in inputs_of(ENSEMBLE)}
NUMPY = {"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_, "BYTES": np.object_}
OUTPUTS = tuple(t.name for t in outputs_of(ENSEMBLE))
STOP_WAIT_S = 10.0  # for an abandoned request's final responses after its `stop`; then its stream is cancelled


def _is_final(result: grpcclient.InferResult) -> bool:
    """The request's last response (the stream's requests ask for an empty final one)."""
    return result.get_response().parameters["triton_final_response"].bool_param


def _tensor(name: str, datatype: str, value) -> grpcclient.InferInput:
    values = value if isinstance(value, (list, tuple)) else [value]
    if datatype == "BYTES":
        values = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
    arr = np.array([values], dtype=NUMPY[datatype])
    tensor = grpcclient.InferInput(name, list(arr.shape), datatype)
    tensor.set_data_from_numpy(arr)
    return tensor


def build_inputs(prompt: str | bytes, **options) -> list[grpcclient.InferInput]:
    """[1, 1]-shaped tensors (lists for stop_words/bad_words); options left None are not sent."""
    inputs = [_tensor("text_input", INPUT_TYPES["text_input"], prompt)]
    for name, value in options.items():
        if value is None:
            continue
        if name not in INPUT_TYPES or name == "text_input":
            raise ValueError(f"unknown input {name!r}")
        inputs.append(_tensor(name, INPUT_TYPES[name], value))
    return inputs


@dataclass
class Chunk:
    text: str
    final: bool
    time: float  # time.monotonic() on arrival
    outputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class GenerationResult:
    text: str
    start: float
    chunk_times: list[float]
    outputs: dict[str, np.ndarray]  # the optional outputs of the last response that had each

    @property
    def ttft(self) -> float | None:
        times = self.chunk_times
        return times[0] - self.start if times else None

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def finish_reason(self) -> str | None:
        reason = self.outputs.get("finish_reason")
        return reason.reshape(-1)[0].decode() if reason is not None else None


class LLMClient:
    """One request at a time per client, each on its own gRPC stream (tritonclient's stream errors carry
    no request id, so requests sharing a stream could not tell their errors apart). Use one client per
    concurrent request."""

    def __init__(self, url: str = "localhost:8001", model: str = "llm"):
        self.model = model
        self._grpc = grpcclient.InferenceServerClient(url)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._active_id: str | None = None
        self._finals_due = 0

    def stream(self, prompt: str, request_id: str | None = None, timeout: float = 300.0,
               **options) -> Iterator[Chunk]:
        """Send one request and yield its text chunks; the last one has final=True."""
        if self._active_id is not None:
            raise RuntimeError("this client is busy: use one LLMClient per concurrent request")
        self._active_id = request_id or uuid.uuid4().hex
        self._finals_due = 1
        self._queue = queue.SimpleQueue()
        q = self._queue
        self._grpc.start_stream(callback=lambda result, error: q.put(error if error is not None else result))
        done = False
        try:
            self._grpc.async_stream_infer(self.model, build_inputs(prompt, **options), request_id=self._active_id,
                                          outputs=[grpcclient.InferRequestedOutput(n) for n in OUTPUTS],
                                          enable_empty_final_response=True)
            while not done:
                item = q.get(timeout=timeout)
                if isinstance(item, InferenceServerException):
                    done = True
                    raise item
                self._finals_due -= _is_final(item)
                done = self._finals_due == 0  # after cancel(), the stop request's final comes too
                outputs = {n: v for n in OUTPUTS if (v := item.as_numpy(n)) is not None}
                text = outputs.pop("text_output", None)
                yield Chunk(b"".join(text.reshape(-1)).decode("utf-8") if text is not None else "", done,
                            time.monotonic(), outputs)
        finally:
            if not done:  # abandoned mid-stream: stop the generation (ensembles miss stream cancels)
                done = self._stop_and_drain(q)
            self._grpc.stop_stream(cancel_requests=not done)
            self._active_id = None

    def _stop_and_drain(self, q: queue.SimpleQueue) -> bool:
        """Stop the request in flight and read its stream until every final response came (an error is one);
        False if they did not within STOP_WAIT_S."""
        self.cancel()
        deadline = time.monotonic() + STOP_WAIT_S
        while self._finals_due > 0:
            try:
                item = q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            self._finals_due -= isinstance(item, InferenceServerException) or _is_final(item)
        return True

    def generate(self, prompt: str, **options) -> GenerationResult:
        start = time.monotonic()
        pieces, times, outputs = [], [], {}
        for chunk in self.stream(prompt, **options):
            if chunk.text:
                pieces.append(chunk.text)
                times.append(chunk.time)
            outputs.update(chunk.outputs)
        return GenerationResult("".join(pieces), start, times, outputs)

    def cancel(self) -> None:
        """Cancel the request in flight: TensorRT-LLM's `stop` with the same request id, on its stream."""
        if self._active_id is None:
            return
        self._finals_due += 1
        try:
            self._grpc.async_stream_infer(self.model, build_inputs("", stop=True, max_tokens=1),
                                          request_id=self._active_id, enable_empty_final_response=True)
        except InferenceServerException as err:  # its stream was closed with cancel_requests: nothing left to stop
            self._finals_due -= 1
            if "stream not available" not in str(err):
                raise

    def close(self) -> None:
        self._grpc.close()

    def __enter__(self) -> "LLMClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
