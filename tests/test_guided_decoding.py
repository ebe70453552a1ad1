"""Guided decoding in the engine core (backend/engine/guided_decoding.py) on the tiny random Llama with SmolLM2's
tokenizer: every output of 20+ JSON schemas validates, greedy and sampled; regex, choice and grammar outputs
match; the mask never changes a greedy output that already satisfies it; unguided rows are unchanged beside guided
ones and do not wait for a grammar to compile; bad guides are refused by name and the engine serves on; KV free.

The tiny model's outputs are random text, so every string and array here is bounded (maxLength, maxItems,
patterns of bounded length): unbounded ones would run to max_tokens, which is allowed (finish reason length)
but proves nothing.
"""

from __future__ import annotations

import ast
import json
import re
import threading
from concurrent import futures

import jsonschema
import numpy as np
import pytest
from transformers import AutoTokenizer

from backend.engine import EngineConfig, LLMEngine
from backend.engine.errors import InvalidRequestError
from backend.engine.guided_decoding import GUIDE_FIELD, Guide, fill_bitmasks
from backend.engine.sampling import SamplingParams

PROMPT = [1, 504, 3303, 28, 253, 3937, 42]
NAME = {"type": "string", "maxLength": 6}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "active": {"type": "boolean"}}, "required": ["name", "age", "active"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tag": {"type": "string", "pattern": "^[a-z]{1,5}$"}}, "required": ["id", "tag"],
        "additionalProperties": False}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer"}}, "required": ["kind", "x"]},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": -1, "maximum": 1}}, "required": ["p"]},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": NAME}, "required": ["a"]},
    {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "integer", "minimum": 0, "maximum": 99}]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                      "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
     "required": ["from", "to"]},
    {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {"k": NAME}, "required": ["k"],
                                               "additionalProperties": False}},
    {"type": "boolean"},
    {"type": "null"},
    {"type": ["integer", "null"]},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}}, "required": ["ip"]},
    {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "score": {"type": "integer", "minimum": 0,
                                                                              "maximum": 10}},
     "required": ["level", "score"]},
    {"type": "object", "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 4}},
     "required": ["code"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["tags"]},
]
GRAMMAR = """root ::= expr
expr ::= term ("+" term){0,2}
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
"""


def closed(schema: dict) -> dict:
    """`schema` with additionalProperties false on every object that does not say otherwise: the random model
    would otherwise add keys without end."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig.create(model=str(tiny_model_dir), max_num_seqs=64, num_kv_blocks=512))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def run(engine: LLMEngine, params: list[SamplingParams], prompts: list[list[int]] | None = None,
        compiled_first: bool = False) -> list[tuple[list[int], str]]:
    """Each request's output ids and finish reason, all in flight at once (each prompt PROMPT unless given); with
    `compiled_first`, the first step waits for every guide to compile (so all are admitted together, however
    slowly a busy machine compiles)."""
    ids = [f"g{i}-{id(p)}" for i, p in enumerate(params)]
    for rid, p, prompt in zip(ids, params, prompts or [PROMPT] * len(params)):
        engine.add_request(rid, prompt, p)
    if compiled_first:
        futures.wait([engine.requests[rid].sampling_state.grammar.pending for rid in ids])
    got = {rid: ([], None) for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id] = (got[out.request_id][0] + out.new_token_ids, out.finish_reason)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [got[rid] for rid in ids]


def text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_json_schema_output_validates(engine, tokenizer, temperature):
    schemas = [closed(s) for s in SCHEMAS]
    params = [SamplingParams(max_tokens=200, temperature=temperature, seed=i,
                             guided=Guide("json_schema", json.dumps(s))) for i, s in enumerate(schemas)]
    for schema, (ids, reason) in zip(schemas, run(engine, params)):
        assert reason == "stop", (schema, text(tokenizer, ids))
        jsonschema.validate(json.loads(text(tokenizer, ids)), schema)


def test_any_json_object(engine, tokenizer):
    (ids, reason), = run(engine, [SamplingParams(max_tokens=300, temperature=1.0, seed=3, guided=Guide("json"))])
    assert reason in ("stop", "length")
    if reason == "stop":
        assert isinstance(json.loads(text(tokenizer, ids)), dict)
    else:  # an unbounded object may run on; what there is starts one
        assert text(tokenizer, ids).startswith("{")


def test_regex_choice_and_grammar_outputs_match(engine, tokenizer):
    regex, choices = r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)", ["yes", "no", "maybe later"]
    guides = [Guide("regex", regex), Guide("choice", json.dumps(choices)), Guide("ebnf_grammar", GRAMMAR)]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_tokens=60, temperature=temperature, seed=7, guided=g) for g in guides]
        (r, _), (c, _), (g, _) = run(engine, params)
        assert re.fullmatch(regex, text(tokenizer, r))
        assert text(tokenizer, c) in choices
        expr = text(tokenizer, g)
        assert re.fullmatch(r"[0-9+()]+", expr) and isinstance(ast.parse(expr, mode="eval").body, (ast.BinOp, ast.Constant))


def test_a_guide_the_greedy_output_satisfies_leaves_it_unchanged(engine, tokenizer):
    """The mask never removes the argmax it should keep: a regex of the unguided greedy text itself."""
    (free, _), = run(engine, [SamplingParams(max_tokens=12, ignore_eos=True)])
    guided = Guide("regex", re.escape(text(tokenizer, free)) + ".*")
    (held, reason), = run(engine, [SamplingParams(max_tokens=12, ignore_eos=True, guided=guided)])
    assert held == free and reason == "length"


def allowed_ids(matcher, vocab_size: int) -> set[int]:
    """The tokens llguidance's mask allows next (before the engine's own stop-id rule)."""
    bits = np.unpackbits(fill_bitmasks([matcher], vocab_size).view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:vocab_size]).tolist())


def test_every_sampled_token_was_inside_its_mask(engine):
    """Replayed through a fresh matcher, each output token is allowed by the mask of its step, and the last is a
    stop id, sampled where the guide was complete."""
    guide = Guide("json_schema", json.dumps(closed(SCHEMAS[0])))
    (ids, reason), = run(engine, [SamplingParams(max_tokens=100, temperature=1.0, seed=11, guided=guide)])
    matcher = engine.grammars.matcher(engine.grammars.compile(guide).result())
    for token in ids[:-1]:
        assert token in allowed_ids(matcher, engine.model_config.vocab_size), token
        assert matcher.consume_token(token)
    assert reason == "stop" and ids[-1] in engine.model_config.eos_token_ids and matcher.is_accepting()


def test_unguided_rows_are_unchanged_beside_guided_ones(engine):
    plain = [SamplingParams(max_tokens=16, ignore_eos=True), SamplingParams(max_tokens=16, temperature=0.8, seed=5)]
    alone = run(engine, plain)
    guided = [SamplingParams(max_tokens=40, guided=Guide("json_schema", json.dumps(closed(s)))) for s in SCHEMAS[:4]]
    beside = run(engine, [*guided[:2], *plain, *guided[2:]])
    assert beside[2:4] == alone


def test_a_request_waits_for_its_grammar_and_others_do_not(engine, tokenizer):
    """With the compiler held busy, the guided request stays waiting while an unguided one is served; once the
    compiler is free the guided one runs."""
    release = threading.Event()
    engine.grammars._pool.submit(release.wait)  # the compiler's one thread is busy until released
    try:
        guide = Guide("regex", r"held [0-9]{3}")
        engine.add_request("guided", PROMPT, SamplingParams(max_tokens=20, guided=guide))
        engine.add_request("plain", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
        plain: list[int] = []
        while "plain" in engine.requests:
            for out in engine.step():
                assert out.request_id == "plain"
                plain += out.new_token_ids
        assert len(plain) == 4 and engine.stats().num_waiting == 1
    finally:
        release.set()
    held: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            held += out.new_token_ids
    assert re.fullmatch(r"held [0-9]{3}", text(tokenizer, held))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_compiled_grammar_is_cached(engine):
    guide = Guide("json_schema", json.dumps(closed(SCHEMAS[1])))
    assert engine.grammars.compile(guide) is engine.grammars.compile(guide)


@pytest.mark.parametrize("guide, field, words", [
    (Guide("xml", "<a/>"), "guided_decoding_guide_type", "expected one of"),
    (Guide("json_schema", "{not json"), "guided_decoding_guide", "not a JSON schema"),
    (Guide("json_schema", ""), "guided_decoding_guide", "empty"),
    (Guide("regex", ""), "guided_decoding_guide", "empty"),
    (Guide("choice", '["a", 3]'), "guided_decoding_guide", "JSON list of non-empty strings"),
])
def test_a_bad_guide_is_refused_at_once_by_name(engine, guide, field, words):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", PROMPT, SamplingParams(guided=guide))
    assert err.value.field == field and words in err.value.reason
    assert "bad" not in engine.requests


@pytest.mark.parametrize("guide, words", [
    (Guide("regex", "(unclosed"), "unclosed group"),
    (Guide("ebnf_grammar", "root ::= missing_rule"), "missing_rule"),
    (Guide("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}})),
     "/$defs/nowhere"),
    # keywords that cannot be enforced are refused, not ignored
    (Guide("json_schema", json.dumps({"type": "array", "uniqueItems": True})), "uniqueItems"),
    (Guide("json_schema", json.dumps({"properties": {"a": {"not": {"type": "string"}}}})), "not"),
    (Guide("json_schema", json.dumps({"oneOf": [{"type": "integer"}, {"type": "number"}]})), "oneOf"),
])
def test_a_guide_that_does_not_compile_ends_its_request_with_an_error_and_the_next_is_served(engine, guide, words):
    engine.add_request("bad", PROMPT, SamplingParams(guided=guide))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outs] == [("bad", "error", [])]
    assert isinstance(outs[0].error, InvalidRequestError) and outs[0].error.field == "guided_decoding_guide"
    assert "does not compile" in outs[0].error.reason and words in outs[0].error.reason, outs[0].error.reason
    with pytest.raises(InvalidRequestError, match=f"^{GUIDE_FIELD}: the .* guide does not compile"):
        engine.add_request("again", PROMPT, SamplingParams(guided=guide))  # known bad: refused at once
    assert run(engine, [SamplingParams(max_tokens=3, ignore_eos=True)])[0][1] == "length"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_no_allowed_token_is_an_error_for_that_request_only(engine, temperature):
    """min_tokens past where the grammar must end: after "ok" only a stop id fits, and min_tokens bans it."""
    engine.add_request("dead", PROMPT, SamplingParams(max_tokens=10, min_tokens=8, temperature=temperature, top_p=0.9,
                                                      seed=1, guided=Guide("choice", '["ok"]')))
    engine.add_request("fine", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["dead"].finish_reason == "error" and finals["dead"].error.field == "guided_decoding_guide"
    assert "no token is allowed" in finals["dead"].error.reason
    assert finals["fine"].finish_reason == "length" and finals["fine"].num_output_tokens == 6
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_max_tokens_may_cut_a_guided_output_short(engine, tokenizer):
    (ids, reason), = run(engine, [SamplingParams(max_tokens=3, guided=Guide("json_schema", json.dumps(
        closed(SCHEMAS[0]))))])
    assert reason == "length" and len(ids) == 3 and text(tokenizer, ids).startswith("{")


def test_preemption_by_recompute_keeps_the_matcher_right(tiny_model_dir, tokenizer):
    """A pool too small for the batch preempts and recomputes; guided outputs are those of a roomy pool."""
    schemas = [closed(s) for s in SCHEMAS[:8]]
    params = [SamplingParams(max_tokens=60, guided=Guide("json_schema", json.dumps(s))) for s in schemas]
    prompts = [[100 + i] + PROMPT * 13 + [7] * 4 for i in range(len(params))]  # 6 full blocks each, none shared
    roomy = run(LLMEngine(EngineConfig.create(model=str(tiny_model_dir), num_kv_blocks=256)), params, prompts)
    small = LLMEngine(EngineConfig.create(model=str(tiny_model_dir), num_kv_blocks=37, block_size=16))
    tight = run(small, params, prompts, compiled_first=True)  # 6 admitted fill 36 of 37 blocks; each first output
    # token needs one more
    assert small.scheduler.num_preemptions > 0
    assert tight == roomy
    finished = [(schema, ids) for schema, (ids, reason) in zip(schemas, tight) if reason == "stop"]
    assert len(finished) >= 6  # the others ran to max_tokens (an unbounded integer)
    for schema, ids in finished:
        jsonschema.validate(json.loads(text(tokenizer, ids)), schema)


def test_min_p_one_keeps_only_the_likeliest_token(engine):
    (greedy, _), = run(engine, [SamplingParams(max_tokens=10, ignore_eos=True)])
    sampled = run(engine, [SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.5, min_p=1.0, seed=s)
                           for s in range(3)])
    assert all(ids == greedy for ids, _ in sampled)


@pytest.mark.parametrize("min_p", [-0.1, 1.5])
def test_min_p_out_of_range_is_refused(engine, min_p):
    with pytest.raises(InvalidRequestError, match="min_p: must be in"):
        engine.add_request("bad", PROMPT, SamplingParams(min_p=min_p))


@pytest.mark.parametrize("string", [{}, {"maxLength": 8}, {"minLength": 1}, {"minLength": 2, "maxLength": 4}])
def test_a_json_string_never_allows_a_raw_control_character_or_a_special_token(engine, tokenizer, string):
    """JSON forbids U+0000-U+001F unescaped in strings, and a special token (<|im_start|>) in one is no text.
    xgrammar 0.2.8 allowed both (control characters in strings with minLength or maxLength)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", **string}}, "required": ["s"],
              "additionalProperties": False}
    vocab = engine.model_config.vocab_size
    control = {i for i in range(len(tokenizer)) if any(ord(c) < 0x20 for c in tokenizer.decode([i]))}
    special = set(tokenizer.all_special_ids) | {i for i in range(17)}  # SmolLM2's added tokens are 0-16
    matcher = engine.grammars.matcher(engine.grammars.compile(Guide("json_schema", json.dumps(schema))).result())
    assert matcher.consume_tokens(tokenizer.encode('{"s":"a', add_special_tokens=False))
    allowed = allowed_ids(matcher, vocab)
    assert control and not allowed & control, [tokenizer.decode([i]) for i in allowed & control]
    assert not allowed & special, sorted(allowed & special)
