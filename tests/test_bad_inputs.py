"""Every input of every front door (ensemble, llm_bls, llm), enumerated from backend/serving/protocol.py:
left out, of the wrong datatype or shape, out of range, NaN or infinite, not UTF-8, absurdly large. Each gets
one final error that names the input and what is allowed, with INVALID_ARG (HTTP 400), and the door serves the
next request; odd but valid values are served.

How the error code is seen. A gRPC stream carries an error as text only. The `triton_grpc_error` header would
end the stream with the error's status, but Triton 2.51 segfaults on such streams (a use-after-free, fixed
upstream): within a few dozen errors to requests with no input data (`input_ids` []), within a few hundred
ensemble errors (`text_input: the text is empty`), so no test here may use it. So: every error of the project
has the form that error_response gives InvalidRequestError, which it sends as INVALID_ARG ("<input>[ (note)]:
what is allowed"; the codes of error_response and of llm_bls's forwarding are tested without a server below),
and HTTP generate answers 400. Errors Triton raises before the model (wrong datatype or shape, no inputs) name
the input in Triton's words and have no code on a stream; HTTP generate cannot send those (JSON has no
datatypes).
"""

from __future__ import annotations

import json
import math
import queue
import re
import urllib.error
import urllib.request
from dataclasses import dataclass

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend.engine.errors import InvalidRequestError, QueueFullError
from backend.serving.protocol import ENSEMBLE, INPUTS, LLM, LLM_BLS, TEXT_PROMPT, TensorSpec, inputs_of
from backend.serving.request import MAX_CHARS, MAX_ENTRIES
from backend.triton import glue

DOORS = (ENSEMBLE, LLM_BLS, LLM)
NUMPY = {"BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32,
         "FP64": np.float64, "BYTES": np.object_}
MAX_TOKENS = 2  # of every request here: cheap, and min_tokens 3 is out of range
# A datatype clients send by mistake, per declared datatype, and a value of it.
WRONG_DATATYPE = {"INT32": ("FP32", 1.0), "UINT64": ("INT64", 1), "FP32": ("FP64", 0.5), "BOOL": ("INT32", 1),
                  "BYTES": ("INT32", 1)}
# Values outside what the parser and the engine allow, per numeric input (lists for list inputs) ...
OUT_OF_RANGE = {
    "input_ids": ([-1], [2**31 - 1]),  # token ids in [0, vocab)
    "max_tokens": (0, -1),
    "min_tokens": (-1, MAX_TOKENS + 1),  # in [0, max_tokens]
    "min_length": (-1, MAX_TOKENS + 1),
    "end_id": (-1, 2**31 - 1),
    "top_k": (-1,),
    "top_p": (0.0, -0.5, 1.5),  # in (0, 1]
    "temperature": (-0.5,),
    "repetition_penalty": (0.0, -1.0),  # > 0
    "timeout_ms": (-1,),
    "min_p": (-0.1, 1.5),  # in [0, 1]
    "num_return_sequences": (0, 17),  # in [1, 16]
    "top_logprobs": (-1, 21),  # in [0, 20]
    "prompt_logprobs": (-1, 21),  # in [0, 20]
    "stream_interval": (-1, 257),  # in [0, 256]
    "lora_task_id": (0, 7),  # the test server loads no adapter: no task id names one
}
# ... and the numeric inputs that take any value of their datatype (finite, for FP32).
ANY_VALUE = {"pad_id", "priority", "seed", "presence_penalty", "frequency_penalty"}
TOO_LONG = "hello " * 1100  # 1101 tokens; the tiny model's context is 1024
ABSURD = {
    "max_tokens": {"2^31-1": 2**31 - 1},
    "input_ids": {"100k-tokens": [1] * 100_000},
    "text_input": {"10MB": "x" * 10_000_000, "past-the-context": TOO_LONG},
    "stop_words": {"100k-words": ["w"] * 100_000, "long-word": ["w" * (MAX_CHARS["stop_words"] + 1)]},
    "bad_words": {"100k-words": ["w"] * 100_000, "long-word": ["w" * (MAX_CHARS["bad_words"] + 1)]},
    "tenant": {"long": "t" * (MAX_CHARS["tenant"] + 1)},
    "lora_name": {"unknown": "nope", "long": "l" * (MAX_CHARS["lora_name"] + 1)},
    "guided_decoding_guide": {"long": "a" * (MAX_CHARS["guided_decoding_guide"] + 1)},
}
ODD_BUT_VALID = (
    {"seed": 2**64 - 1, "temperature": 1.0},
    {"stop_words": [""]},
    {"stop_words": []},
    {"stop_words": [f"w{i}" for i in range(MAX_ENTRIES["stop_words"])]},
    {"bad_words": [""]},
    {"tenant": "t" * 1000},
    {"tenant": ""},
    {"temperature": 0.0, "top_p": 1.0, "max_tokens": 1},
    {"min_tokens": MAX_TOKENS, "min_length": MAX_TOKENS},
    {"priority": -2**31, "timeout_ms": 2**31 - 1, "pad_id": -1, "top_k": 2**31 - 1},
    {"presence_penalty": -1e30, "frequency_penalty": 1e30, "repetition_penalty": 1e30},
    {"guided_decoding_guide_type": "json", "guided_decoding_guide": ""},  # any JSON object: no guide needed
    {"min_p": 1.0, "temperature": 1.0},
    {"top_logprobs": 20, "return_log_probs": False},
    {"stop": True},  # a cancel of nothing: ends at once
)


def _prompt(door: str, under_test: str = "") -> dict:
    """A valid prompt: ids for the llm, text for the others, and for the llm when its text prompt is under test."""
    return {"input_ids": [1, 2, 3]} if door == LLM and under_test not in TEXT_PROMPT else {"text_input": "Hi"}


def _array(datatype: str, value) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    values = value if isinstance(value, list) else [value]
    if datatype == "BYTES":
        values = [v.encode() if isinstance(v, str) else v for v in values]
    return np.array([values], dtype=NUMPY[datatype]).reshape(1, len(values))


def _tensors(door: str, options: dict, datatypes: dict | None = None) -> list[grpcclient.InferInput]:
    declared = {t.name: t.client_dtype for t in inputs_of(door)}
    out = []
    for name, value in options.items():
        datatype = (datatypes or {}).get(name, declared[name])
        arr = _array(datatype, value)
        tensor = grpcclient.InferInput(name, list(arr.shape), datatype)
        tensor.set_data_from_numpy(arr)
        out.append(tensor)
    return out


@dataclass(frozen=True)
class Case:
    door: str
    name: str  # the input
    kind: str
    options: dict  # the request's inputs (the input under test replaced or removed)
    datatype: str | None = None  # sent in place of the declared one
    before_model: bool = False  # Triton refuses it before the model, in its own words
    triton_words: str = ""  # ... words that name no input, where Triton has none to name
    json: bool = True  # HTTP generate can send it

    @property
    def id(self) -> str:
        return f"{self.door}-{self.name}-{self.kind}"


def _bad_cases(door: str):
    """The bad requests for each input of `door`, by the input's row of the table."""
    def case(spec: TensorSpec, kind: str, value, **kw) -> Case:
        options = {k: v for k, v in {**_prompt(door, spec.name), "max_tokens": MAX_TOKENS}.items() if k != spec.name}
        if value is not None:
            options[spec.name] = value
        return Case(door, spec.name, kind, options, **kw)

    required = next(t for t in inputs_of(door) if not t.optional)
    if door != LLM:  # the ensemble declares text_input optional and names it itself; llm_bls leaves it to Triton
        yield Case(door, required.name, "no-inputs", {}, before_model=not required.declared_optional(door))
    else:
        # It declares both prompts optional, and Triton reads a batching model's batch size from the first
        # input before the model: a request with no input at all is refused in Triton's words, naming none.
        yield Case(door, required.name, "no-inputs", {}, before_model=True, triton_words="request has 0 inputs")
        # its prompt is ids or text, not both; the chat template is for text
        ids = {"input_ids": [1, 2, 3], "max_tokens": MAX_TOKENS}
        yield Case(door, "text_input", "beside-input_ids", {**ids, "text_input": "Hi"})
        yield Case(door, "apply_chat_template", "beside-input_ids", {**ids, "apply_chat_template": True})
    for spec in inputs_of(door):
        base = {**_prompt(door, spec.name), "max_tokens": MAX_TOKENS}
        datatype = spec.client_dtype
        sample = base.get(spec.name, {"BYTES": "x", "BOOL": True}.get(datatype, 1))
        if not spec.optional:
            yield case(spec, "missing", None)
            yield case(spec, "empty", [] if spec.is_list else "")
            # two prompts in one request, alone (beside [1, 1] inputs, Triton refuses the batch sizes)
            yield Case(door, spec.name, "batch-of-2", {spec.name: np.array([sample, sample], NUMPY[datatype])
                                                       .reshape(2, -1)}, json=False)
        wrong, value = WRONG_DATATYPE[datatype]
        yield case(spec, f"datatype-{wrong}", value, datatype=wrong, before_model=True, json=False)
        yield case(spec, "shape-1x1x1", _array(datatype, sample).reshape(1, 1, -1)[:, :, :1],
                   before_model=True, json=False)
        if not spec.is_list:
            yield case(spec, "two-values", [sample, sample], before_model=True, json=False)
        for value in OUT_OF_RANGE.get(spec.name, ()):
            yield case(spec, f"value-{value}", value)
        if datatype == "FP32":
            yield case(spec, "nan", math.nan, json=False)
            yield case(spec, "inf", math.inf)
            yield case(spec, "-inf", -math.inf)
        if datatype == "BYTES":
            yield case(spec, "not-utf8", [b"\xff\xfe"] if spec.is_list else b"\xff\xfe", json=False)
        for label, value in ABSURD.get(spec.name, {}).items():
            yield case(spec, f"absurd-{label}", value)


BAD = [c for door in DOORS for c in _bad_cases(door)]


def test_every_numeric_input_has_its_range_decided():
    """A numeric input added to the table fails here until its bad values (or none) are written above."""
    numeric = {t.name for t in INPUTS if t.client_dtype in ("INT32", "UINT64", "FP32")}
    assert numeric == set(OUT_OF_RANGE) | ANY_VALUE
    assert not set(OUT_OF_RANGE) & ANY_VALUE


class Door:
    """One gRPC connection to a front door; each exchange on a stream of its own."""

    def __init__(self, url: str, model: str):
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)

    def exchange(self, requests: list[tuple[str, list]]) -> list:
        """Send each (request id, tensors) after the previous one's final response (or error) on one stream;
        the items received, each an InferResult or an InferenceServerException."""
        received: queue.SimpleQueue = queue.SimpleQueue()
        client = self.client
        client.start_stream(callback=lambda result, error: received.put(error if error is not None else result))
        items = []
        try:
            for request_id, tensors in requests:
                try:
                    client.async_stream_infer(self.model, tensors, request_id=request_id,
                                              enable_empty_final_response=True)
                except InferenceServerException as err:  # the stream ended: say what it got before
                    while not received.empty():
                        items.append(received.get())
                    raise AssertionError(f"{self.model}: stream ended before {request_id}: {items}") from err
                while True:
                    item = received.get(timeout=60)
                    items.append(item)
                    if isinstance(item, InferenceServerException) or _final(item):
                        break
        finally:
            client.stop_stream()
        return items

    def valid(self) -> list[tuple[str, list]]:
        return [("ok", _tensors(self.model, {**_prompt(self.model), "max_tokens": 1}))]


def _final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def _served(items: list, request_id: str) -> bool:
    return (bool(items) and not any(isinstance(i, InferenceServerException) for i in items)
            and all(i.get_response().id == request_id for i in items) and _final(items[-1]))


@pytest.fixture(scope="module")
def doors(server):
    doors = {door: Door(server.url_grpc, door) for door in DOORS}
    yield doors
    for door in doors.values():
        door.client.close()


def _http_generate(server, door: str, options: dict) -> tuple[int, str]:
    infinite = {k: math.copysign(1e39, v) for k, v in options.items()
                if isinstance(v, float) and math.isinf(v)}
    body = json.dumps({**options, **infinite})  # JSON has no inf; 1e39 is inf as FP32
    request = urllib.request.Request(f"{server.url_http}/v2/models/{door}/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _names(message: str, case: Case) -> bool:
    """The message names the input: the project's errors as "<input>[ (note)]: what is allowed" (after the
    ensemble's "in ensemble 'ensemble', "), Triton's own as "... input 'name' ..."."""
    if case.before_model:
        return (case.triton_words or f"'{case.name}'") in message
    label = re.search(r"(?:^|, )([\w ()]+?): .", message)
    return label is not None and re.search(rf"\b{case.name}\b", label.group(1)) is not None


@pytest.mark.parametrize("case", BAD, ids=lambda c: c.id)
def test_bad_input_gets_one_error_naming_it_and_the_door_serves_on(server, doors, case: Case):
    door = doors[case.door]
    bad = ("bad", _tensors(case.door, case.options, {case.name: case.datatype} if case.datatype else None))
    items = door.exchange([bad] + door.valid())
    error, rest = items[0], items[1:]
    assert isinstance(error, InferenceServerException), f"served: {items[:2]}"
    assert _names(error.message(), case), error.message()
    assert _served(rest, "ok"), f"after the error: {rest[:3]}"  # nothing more for the bad one; next served
    if case.json:
        status, body = _http_generate(server, case.door, case.options)
        assert status == 400 and _names(json.loads(body)["error"], case), (status, body[:300])


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("options", ODD_BUT_VALID, ids=lambda o: ",".join(o))
def test_odd_but_valid_values_are_served(doors, door: str, options: dict):
    options = {**_prompt(door), "max_tokens": MAX_TOKENS, **options}
    if options.get("stop") and door != LLM:
        del options["text_input"]  # a cancel needs no text
    items = doors[door].exchange([("odd", _tensors(door, options))])
    assert _served(items, "odd"), items[:2]
    if door != LLM:
        assert items[-1].as_numpy("text_output") is not None


def test_the_ensemble_without_text_input_names_it(server, doors):
    """Before: an empty success (Triton checks only the number of inputs; preprocessing's step never ran)."""
    items = doors[ENSEMBLE].exchange([("bad", _tensors(ENSEMBLE, {"max_tokens": 4}))])
    assert len(items) == 1 and isinstance(items[0], InferenceServerException)
    assert items[0].message() == "in ensemble 'ensemble', text_input: missing"
    for endpoint in ("generate", "generate_stream"):
        request = urllib.request.Request(f"{server.url_http}/v2/models/ensemble/{endpoint}",
                                         data=b'{"max_tokens": 4}')
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=30)
        assert err.value.code == 400 and "text_input: missing" in err.value.read().decode()


class FakeTritonError:
    """pb_utils.TritonError's interface, as glue uses it."""

    INTERNAL, INVALID_ARG, UNAVAILABLE = "INTERNAL", "INVALID_ARG", "UNAVAILABLE"

    def __init__(self, message: str, code: str = "INTERNAL"):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> str:
        return self._code


class FakePbUtils:
    TritonError = FakeTritonError

    class InferenceResponse:
        def __init__(self, error):
            self.error = error

    class Logger:
        @staticmethod
        def log_error(message: str) -> None: ...


@pytest.mark.parametrize("err, code, message", [
    (InvalidRequestError("top_p", "must be in (0, 1], got 1.5"), "INVALID_ARG",
     "top_p: must be in (0, 1], got 1.5"),
    (InvalidRequestError("stop_token_ids", "token ids outside [0, 9): [-1]"), "INVALID_ARG",
     "end_id: token ids outside [0, 9): [-1]"),
    (QueueFullError("overloaded: 16 requests waiting"), "UNAVAILABLE", "overloaded: 16 requests waiting"),
    (RuntimeError("boom"), "INTERNAL", "boom"),
])
def test_error_response_codes(err, code, message):
    error = glue.error_response(FakePbUtils, err).error
    assert (error.code(), error.message()) == (code, message)


def test_llm_bls_forwards_the_llms_input_errors_as_invalid_arg():
    """Before: every error llm_bls forwarded from the llm left as INTERNAL (Triton 2.51's BLS drops codes)."""
    for message in ("top_p: must be in (0, 1], got 1.5",
                    "min_tokens (or min_length): must be in [0, max_tokens], got 3",
                    "input_ids (text_input once tokenized): the prompt has 1101 tokens"):
        forwarded = glue.forwarded_error(FakePbUtils, FakeTritonError(message))
        assert (forwarded.code(), forwarded.message()) == ("INVALID_ARG", message)
    other = FakeTritonError("overloaded: 16 requests waiting", "INTERNAL")
    assert glue.forwarded_error(FakePbUtils, other) is other
