"""Guided decoding through the real tritonserver (tiny model): tensorrtllm_backend's `guided_decoding_guide_type` /
`guided_decoding_guide` inputs on every text door, gRPC and HTTP generate_stream; the output equals the offline
engine's guided output; a bad guide is an INVALID_ARG naming the input and the next request is served."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import jsonschema
import pytest
from tritonclient.utils import InferenceServerException

from backend.engine import EngineConfig, LLMEngine
from backend.engine.guided_decoding import Guide
from backend.engine.sampling import SamplingParams
from backend.serving.detokenize import decode_text
from backend.serving.tokenizer import encode, load_tokenizer
from client.client import LLMClient
from tests.test_server import TEXT_DOORS, wait_until_idle

PROMPT = "Describe a person as JSON."
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
GUIDES = [("json_schema", json.dumps(SCHEMA)), ("regex", r"[A-Z][a-z]{2,6} [0-9]{2}"),
          ("choice", json.dumps(["alpha", "beta", "gamma"])), ("ebnf_grammar", 'root ::= "x" [0-9]{1,3} "y"')]


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    """The offline engine's guided greedy text of PROMPT (no chat template), as every door must give it."""
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir)))

    def text(kind: str, spec: str) -> str:
        ids = encode(tokenizer, PROMPT, apply_chat_template=False)
        out = engine.generate([ids], SamplingParams(max_tokens=64, guided=Guide(kind, spec)))[0]
        return decode_text(tokenizer, out)

    return text


@pytest.mark.parametrize("model", TEXT_DOORS)
@pytest.mark.parametrize("stream", [True, False])
def test_every_guide_on_every_door_gives_the_offline_output(server, offline, model, stream):
    with LLMClient(server.url_grpc, model) as client:
        for kind, spec in GUIDES:
            result = client.generate(PROMPT, max_tokens=64, stream=stream, apply_chat_template=False,
                                     guided_decoding_guide_type=kind, guided_decoding_guide=spec,
                                     return_finish_reason=True)
            assert result.text == offline(kind, spec) and result.finish_reason == "stop", (kind, result.text)
            if kind == "json_schema":
                jsonschema.validate(json.loads(result.text), SCHEMA)
    wait_until_idle(server)


def test_http_generate_stream_takes_a_guide(server):
    body = json.dumps({"text_input": PROMPT, "max_tokens": 32, "guided_decoding_guide_type": "regex",
                       "guided_decoding_guide": "[0-9]{3}-[0-9]{4}"}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"{server.url_http}/v2/models/llm/generate_stream",
                                                       data=body), timeout=60) as resp:
        events = [json.loads(line[5:]) for line in resp.read().decode().splitlines() if line.startswith("data:")]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", "".join(e.get("text_output", "") for e in events))


@pytest.mark.parametrize("model", TEXT_DOORS)
@pytest.mark.parametrize("options, words", [
    ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{oops"}, "guided_decoding_guide: not a"),
    ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "(unclosed"},
     "guided_decoding_guide: the regex guide does not compile"),
    ({"guided_decoding_guide_type": "yaml", "guided_decoding_guide": "a: 1"}, "guided_decoding_guide_type: expected"),
    ({"guided_decoding_guide": "[0-9]+"}, "guided_decoding_guide_type: missing"),
    ({"guided_decoding_guide_type": "choice", "guided_decoding_guide": '["ok"]', "min_tokens": 5, "max_tokens": 8},
     "guided_decoding_guide: no token is allowed"),
    ({"min_p": 2.0}, "min_p: must be in [0, 1]"),
])
def test_a_bad_guide_is_invalid_arg_naming_the_input_and_the_next_request_is_served(server, model, options, words):
    with LLMClient(server.url_grpc, model) as client:
        with pytest.raises(InferenceServerException) as err:
            client.generate(PROMPT, **{"max_tokens": 4, **options})
        assert words in err.value.message(), err.value.message()
        assert client.generate(PROMPT, max_tokens=3, ignore_eos=True).text
    wait_until_idle(server)


def test_the_client_cli_sends_a_guide(server, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    for flags, check in ((["--json-schema", str(schema)], lambda out: jsonschema.validate(json.loads(out), SCHEMA)),
                         (["--choice", "left", "--choice", "right"], lambda out: out in ("left", "right")),
                         (["--regex", "[0-9]{4}"], lambda out: re.fullmatch("[0-9]{4}", out))):
        proc = subprocess.run([sys.executable, "-m", "client", PROMPT, "--url", server.url_grpc, "--max-tokens", "40",
                               *flags], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "finish: stop" in proc.stderr, proc.stderr
        assert check(proc.stdout.strip()) is not False, proc.stdout
