"""The request-input table (backend/serving/protocol.py) against the configs, the ensemble's wiring, the
llm's parser and the text front ends: an input added to one config.pbtxt and not the table fails here."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from backend.engine.errors import InvalidRequestError
from backend.engine.sampling import SamplingParams
from backend.serving.protocol import (DTYPES, ENSEMBLE, INPUTS, LLM, LLM_BLS, MODELS, OUTPUTS, PREPROCESSING,
                                      TEXT_PROMPT, inputs_of, outputs_of)
from backend.serving.request import (ENGINE_FIELD_INPUTS, MAX_CHARS, MAX_ENTRIES, GenerationRequest,
                                     input_error, parse_request, parse_text_prompt)

REPO = Path(__file__).resolve().parents[1]
MODEL_REPO = REPO / "model_repository"
KNOWN_KEYS = {"name", "data_type", "dims", "optional", "allow_ragged_batch"}


def _config(model: str) -> str:
    return re.sub(r"#[^\n]*", "", (MODEL_REPO / model / "config.pbtxt").read_text())


def _block(text: str, key: str) -> str:
    """The text inside the top-level `key [ ... ]` (brackets balanced)."""
    match = re.search(rf"^{key}\s*\[", text, re.MULTILINE)
    assert match, f"no top-level {key} block"
    depth, start = 1, match.end()
    for i in range(start, len(text)):
        depth += {"[": 1, "]": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    raise AssertionError(f"unbalanced {key} block")


def _entries(text: str, key: str) -> dict[str, dict[str, str]]:
    """name -> fields of each entry of an `input` / `output` block."""
    out = {}
    for entry in re.findall(r"\{([^{}]*)\}", _block(text, key)):
        fields = dict(re.findall(r"(\w+)\s*:\s*(\"[^\"]*\"|\[[^\]]*\]|\S+)", entry))
        assert set(fields) <= KNOWN_KEYS, f"{key} entry with fields this test does not know: {entry}"
        assert all(fields.get(flag, "true") == "true" for flag in ("optional", "allow_ragged_batch")), entry
        name = fields["name"].strip('"')
        assert name not in out, f"{name} declared twice"
        out[name] = fields
    return out


def _tensors(text: str, key: str) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """name -> (data_type, dims, optional) of each entry of an `input` / `output` block; dims without the
    batch dimension, which an unbatched model (max_batch_size 0) writes first, as -1."""
    unbatched = re.search(r"^max_batch_size\s*:\s*0\s*$", text, re.MULTILINE) is not None
    out = {}
    for name, f in _entries(text, key).items():
        dims = tuple(int(d) for d in f["dims"].strip("[]").replace(",", " ").split())
        if unbatched:
            assert dims[0] == -1, f"{name}: an unbatched model's dims start with the batch dimension, -1"
            dims = dims[1:]
        out[name] = (f["data_type"], dims, "optional" in f)
    return out


def _table(rows, model: str) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    return {t.name: (t.dtype, t.dims, t.declared_optional(model)) for t in rows}


def _steps(text: str) -> Iterator[tuple[str, dict[str, str], dict[str, str]]]:
    """(model_name, input_map, output_map) of each ensemble step."""
    for step in re.split(r"model_name\s*:", text.split("ensemble_scheduling", 1)[1])[1:]:
        maps = {kind: dict(re.findall(rf'{kind}\s*\{{\s*key:\s*"([^"]+)"\s*value:\s*"([^"]+)"\s*\}}', step))
                for kind in ("input_map", "output_map")}
        yield re.match(r'\s*"([^"]+)"', step).group(1), maps["input_map"], maps["output_map"]


def test_the_table_is_well_formed():
    for rows in (INPUTS, OUTPUTS):
        assert len({t.name for t in rows}) == len(rows)
        for t in rows:
            assert t.dtype in DTYPES and t.dims in ((1,), (-1,)) and t.models and set(t.models) <= set(MODELS)
            assert t.meaning and "\n" not in t.meaning
            assert not t.parser_checked_in or (not t.optional and t.parser_checked_in <= t.models), t.name
    assert {t.client_dtype for t in INPUTS} <= {"BOOL", "INT32", "UINT64", "FP32", "BYTES"}
    assert next(t for t in INPUTS if t.name == "tenant").client_dtype == "BYTES"


@pytest.mark.parametrize("model", MODELS)
def test_config_inputs_are_the_table(model):
    assert _tensors(_config(model), "input") == _table(inputs_of(model), model)


@pytest.mark.parametrize("model", MODELS)
def test_only_the_llms_list_inputs_are_ragged(model):
    """A batch of llm requests may mix lengths of these; the other models take inputs of the llm's shapes."""
    entries = _entries(_config(model), "input")
    ragged = {name for name, entry in entries.items() if "allow_ragged_batch" in entry}
    assert ragged == ({t.name for t in inputs_of(model) if t.is_list} if model == LLM else set())


@pytest.mark.parametrize("model", (LLM, ENSEMBLE, LLM_BLS))
def test_config_outputs_are_the_table(model):
    assert _tensors(_config(model), "output") == _table(outputs_of(model), model)


def test_llm_bls_has_the_ensembles_exact_io():
    assert inputs_of(LLM_BLS) == inputs_of(ENSEMBLE) and outputs_of(LLM_BLS) == outputs_of(ENSEMBLE)


def test_static_hf_baseline_takes_a_subset_of_the_ensembles_inputs():
    text = re.sub(r"#[^\n]*", "", (REPO / "load_tests/static_hf/config.pbtxt").read_text())
    ensemble = {t.name: (t.dtype, t.dims, t.optional) for t in inputs_of(ENSEMBLE)}  # what a request may omit
    assert {n: ensemble.get(n) for n in _tensors(text, "input")} == _tensors(text, "input")
    assert _tensors(text, "output") == _table(outputs_of(ENSEMBLE), ENSEMBLE)


def test_ensemble_passes_each_input_to_the_models_that_take_it():
    ensemble = {t.name for t in inputs_of(ENSEMBLE)}
    produced: set[str] = set()
    used: set[str] = set()
    for model, input_map, output_map in _steps(_config(ENSEMBLE)):
        declared = _tensors(_config(model), "input")
        assert set(input_map) <= set(declared), f"{model}: maps inputs it does not declare"
        assert {n for n, (_, _, optional) in declared.items() if not optional} <= set(input_map), model
        assert set(input_map.values()) <= ensemble | produced, f"{model}: reads a tensor nothing made yet"
        passed = {key for key, value in input_map.items() if value in ensemble}
        assert all(input_map[key] == key for key in passed), f"{model}: renames an ensemble input"
        if model in (LLM, PREPROCESSING):
            taken = {t.name for t in inputs_of(ENSEMBLE) if model in t.models}
            if model == LLM:  # the llm takes text too, but through the ensemble preprocessing tokenizes it
                taken -= set(TEXT_PROMPT)
            assert passed == taken, model
        used |= set(input_map.values())
        produced |= set(output_map.values())
    assert ensemble <= used, f"ensemble inputs no step reads: {ensemble - used}"
    assert {t.name for t in outputs_of(ENSEMBLE)} <= produced


class Recording(dict):
    """The inputs, remembering which names the parser asked for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)


class CharTokenizer:
    """One id per character; the chat template wraps a user turn in ids 1 and 2."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool, return_dict: bool) -> list[int]:
        return [1, *self.encode(messages[0]["content"]), 2]


EXAMPLE = {"TYPE_BOOL": True, "TYPE_INT32": 3, "TYPE_UINT64": 7, "TYPE_FP32": 0.5, "TYPE_STRING": "x"}
NUMPY = {"TYPE_BOOL": np.bool_, "TYPE_INT32": np.int32, "TYPE_UINT64": np.uint64, "TYPE_FP32": np.float32,
         "TYPE_STRING": np.object_}


def _array(tensor, value) -> np.ndarray:
    values = value if isinstance(value, list) else [value]
    if tensor.dtype == "TYPE_STRING":
        values = [v.encode() for v in values]
    return np.array([values], dtype=NUMPY[tensor.dtype])


def _parse(**values) -> GenerationRequest:
    rows = {t.name: t for t in inputs_of(LLM)}
    values.setdefault("input_ids", [5, 6])
    return parse_request({n: _array(rows[n], v) for n, v in values.items()}, CharTokenizer(), (2,))


def test_every_input_is_parsed_by_the_llm():
    """Every llm input reaches the parser (the prompt as ids, or as text), and the text front doors read the
    text prompt with the same parser."""
    rows = {t.name: t for t in inputs_of(LLM)}
    for prompt in ("input_ids", "text_input"):
        inputs = Recording({t.name: _array(t, [1, 2] if t.name == "input_ids" else EXAMPLE[t.dtype])
                            for t in inputs_of(LLM) if t.name not in {"input_ids", "text_input"} - {prompt}})
        if prompt == "input_ids":
            del inputs["apply_chat_template"]  # text only
        del inputs["lora_task_id"]  # an adapter by name or by task id, not both
        req = parse_request(inputs, CharTokenizer(), (2,))
        assert inputs.asked >= set(rows) - {"apply_chat_template"}, prompt
        assert req.stop_strings == ["x"] and req.tenant == "x" and req.params.seed == 7
        assert req.as_text == (prompt == "text_input")
    assert set(TEXT_PROMPT) == {t.name for t in INPUTS if PREPROCESSING in t.models} - {"stop"}
    assert all(LLM_BLS in t.models and LLM in t.models for t in INPUTS if t.name in TEXT_PROMPT)
    for model in (PREPROCESSING, LLM_BLS):
        assert "parse_text_prompt(" in (MODEL_REPO / model / "1" / "model.py").read_text(), model


def test_the_prompt_is_input_ids_or_text_input():
    rows = {t.name: t for t in inputs_of(LLM)}
    ids, text, chat = (_array(rows["input_ids"], [5, 6]), _array(rows["text_input"], "ab"),
                       _array(rows["apply_chat_template"], True))
    assert parse_request({"text_input": text}, CharTokenizer(), (2,)).prompt_token_ids == [97, 98]
    templated = parse_request({"text_input": text, "apply_chat_template": chat}, CharTokenizer(), (2,))
    assert templated.prompt_token_ids == [1, 97, 98, 2] and templated.as_text
    cancel = {"text_input": _array(rows["text_input"], ""), "stop": _array(rows["stop"], True)}
    assert parse_request(cancel, CharTokenizer(), (2,)).stop
    for inputs, message in (({"input_ids": ids, "text_input": text}, "input_ids or text_input: give one of them"),
                            ({}, r"input_ids or text_input: missing \(give one of them\)"),
                            ({"input_ids": ids, "apply_chat_template": chat}, "apply_chat_template: applies to text"),
                            ({"text_input": _array(rows["text_input"], "")}, "text_input: the text is empty")):
        with pytest.raises(InvalidRequestError, match=f"^{message}"):
            parse_request(inputs, CharTokenizer(), (2,))


def test_an_adapter_by_name_or_by_task_id_not_both():
    rows = {t.name: t for t in inputs_of(LLM)}
    name, task = _array(rows["lora_name"], "sql"), _array(rows["lora_task_id"], 1)
    ids = _array(rows["input_ids"], [5, 6])
    assert parse_request({"input_ids": ids, "lora_name": name}, CharTokenizer(), (2,)).lora_name == "sql"
    assert parse_request({"input_ids": ids, "lora_task_id": task}, CharTokenizer(), (2,)).lora_task_id == 1
    assert parse_request({"input_ids": ids, "lora_name": _array(rows["lora_name"], "")}, CharTokenizer(),
                         (2,)).lora_name is None  # empty: the base model
    with pytest.raises(InvalidRequestError, match="^lora_name or lora_task_id: give one of them"):
        parse_request({"input_ids": ids, "lora_name": name, "lora_task_id": task}, CharTokenizer(), (2,))


def test_absent_inputs_take_the_dataclass_defaults():
    req = _parse()
    defaults = SamplingParams()
    assert req.params == SamplingParams(stop_token_ids=(2,), ignore_eos=True)
    assert req.params.max_tokens == defaults.max_tokens
    assert req == GenerationRequest(prompt_token_ids=[5, 6], params=req.params)


def test_sampling_inputs_set_the_fields_of_their_name():
    req = _parse(max_tokens=9, temperature=0.5, top_k=4, top_p=0.5, seed=11, repetition_penalty=1.5,
                 presence_penalty=0.5, frequency_penalty=0.25, min_tokens=2, return_log_probs=True)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (9, 0.5, 4, 0.5, 11)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.5, 0.5, 0.25)
    assert p.min_tokens == 2
    assert p.logprobs


def test_request_inputs():
    req = _parse(stream=True, priority=-1, tenant="", stop_words=["ab", ""], exclude_input_in_output=False,
                 return_num_input_tokens=True, return_num_output_tokens=True, return_finish_reason=True)
    assert (req.stream, req.priority, req.tenant, req.stop_strings) == (True, -1, None, ["ab"])
    assert not req.exclude_input_in_output
    assert req.return_num_input_tokens and req.return_num_output_tokens and req.return_finish_reason


def test_min_length_is_an_alias_of_min_tokens():
    assert _parse(min_length=3).params.min_tokens == 3
    assert _parse(min_length=3, min_tokens=1).params.min_tokens == 1


def test_end_id_and_ignore_eos():
    assert _parse(end_id=9).params.stop_token_ids == (9,)
    assert _parse(end_id=9, ignore_eos=True).params.stop_token_ids == (9,)
    assert _parse(ignore_eos=True).params.stop_token_ids == ()
    assert _parse(ignore_eos=False).params.stop_token_ids == (2,)
    assert _parse(pad_id=0).params.ignore_eos  # EOS goes through stop_token_ids


def test_bad_words_are_banned_with_and_without_a_leading_space():
    assert sorted(_parse(bad_words=["ab", ""]).params.bad_words_ids) == [(32, 97, 98), (97, 98)]
    assert _parse(bad_words=[" ab"]).params.bad_words_ids == ((32, 97, 98),)


def test_a_stop_request_may_have_no_prompt():
    assert _parse(input_ids=[], stop=True).stop


@pytest.mark.parametrize("values, field, message", [
    ({"input_ids": None}, "input_ids or text_input", "missing (give one of them)"),
    ({"input_ids": []}, "input_ids", "the prompt is empty"),
    ({"temperature": float("nan")}, "temperature", "must be finite"),
    ({"top_p": float("inf")}, "top_p", "must be finite"),
    ({"max_tokens": [1, 2]}, "max_tokens", "expected one value, got shape [1, 2]"),
])
def test_errors_name_the_field(values, field, message):
    rows = {t.name: t for t in inputs_of(LLM)}
    inputs = {n: _array(rows[n], v) for n, v in {"input_ids": [5], **values}.items() if v is not None}
    with pytest.raises(InvalidRequestError) as err:
        parse_request(inputs, CharTokenizer(), (2,))
    assert str(err.value) == f"{field}: {message}"


def test_a_batch_of_lists_is_not_one_list():
    """Triton lets [2, n] through a batching model; flattened, it was served as one prompt of 2n tokens."""
    with pytest.raises(InvalidRequestError, match=r"^input_ids: expected one list \(shape \[1, n\]\), got "
                                                  r"shape \[2, 2\]"):
        parse_request({"input_ids": np.array([[5, 6], [7, 8]], np.int32)}, CharTokenizer(), (2,))


def test_sizes_past_the_limits_are_refused_by_name():
    for name, limit in MAX_ENTRIES.items():
        _parse(**{name: ["ab"] * limit})
        with pytest.raises(InvalidRequestError, match=rf"^{name}: at most {limit} entries, got {limit + 1}$"):
            _parse(**{name: ["ab"] * (limit + 1)})
    for name, limit in MAX_CHARS.items():
        if name == "text_input":
            assert parse_text_prompt({"text_input": np.array([["é".encode() * limit]], dtype=np.object_)}).text
            inputs = {"text_input": np.array([["é".encode() * (limit + 1)]], dtype=np.object_)}
            with pytest.raises(InvalidRequestError, match=rf"^text_input: at most {limit} characters"):
                parse_text_prompt(inputs)
            continue
        value = "é" * limit  # characters, not bytes: 2 bytes each
        typed = {"guided_decoding_guide_type": "regex"} if name == "guided_decoding_guide" else {}
        _parse(**{name: [value] if name.endswith("_words") else value}, **typed)
        message = rf"^{name}: at most {limit} characters, got {limit + 1}$"
        with pytest.raises(InvalidRequestError, match=message):
            _parse(**{name: [value + "x"] if name.endswith("_words") else value + "x"}, **typed)


def test_engine_errors_name_the_input_that_set_the_field():
    """The engine names its own fields (prompt_token_ids, stop_token_ids, ...); the client sent inputs."""
    llm_inputs = {t.name for t in inputs_of(LLM)}
    for field, name in ENGINE_FIELD_INPUTS.items():
        assert name.split()[0] in llm_inputs, name
        renamed = input_error(InvalidRequestError(field, "why"))
        assert (str(renamed), renamed.field) == (f"{name}: why", name)
    err = InvalidRequestError("top_p", "must be in (0, 1], got 1.5")
    assert input_error(err) is err


def test_invalid_utf8_names_the_field():
    inputs = {"input_ids": np.array([[5]], np.int32), "stop_words": np.array([[b"\xff"]], dtype=np.object_)}
    with pytest.raises(InvalidRequestError, match="^stop_words: not valid UTF-8"):
        parse_request(inputs, CharTokenizer(), (2,))


def test_text_prompt_of_the_text_front_doors():
    """preprocessing and llm_bls read text_input, apply_chat_template and stop with one parser."""
    def arr(v):
        return np.array([[v]], dtype=np.object_ if isinstance(v, bytes) else None)

    prompt = parse_text_prompt({"text_input": arr(b"hi"), "apply_chat_template": arr(True)})
    assert (prompt.text, prompt.apply_chat_template, prompt.stop) == ("hi", True, False)
    assert parse_text_prompt({"stop": arr(True)}).stop  # a cancel needs no text
    assert parse_text_prompt({"text_input": arr(b""), "stop": arr(True)}).text == ""
    for inputs, message in (({}, "text_input: missing"), ({"text_input": arr(b"")}, "text_input: the text is empty"),
                            ({"text_input": arr(b"\xff")}, "text_input: not valid UTF-8"),
                            ({"text_input": np.array([[b"a", b"b"]], dtype=np.object_)}, "text_input: expected one")):
        with pytest.raises(InvalidRequestError, match=message):
            parse_text_prompt(inputs)
