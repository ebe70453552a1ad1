"""Tool calls through Dynamo's frontend: a real frontend and one worker registered with
`--dyn-tool-call-parser hermes` (the Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, fits
SmolLM2's ChatML) and `--dyn-reasoning-parser qwen3` (Qwen3's, for `<think>...</think>`), serving the tiny random
Llama from .venv-dynamo (`make dynamo-venv`).

Neither the tiny model nor SmolLM2-135M writes a tool call on its own, so each request forces one with guided
decoding: a guided regex for the exact Hermes text (the frontend's parser turns it into `tool_calls`; without
the flag the same text comes back as content with finish_reason "stop"), or `tool_choice` "required" / named,
which the frontend itself turns into `sampling_options.guided_decoding.json` for the worker and parses back.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from openai import OpenAI

from tests.dynamo_cluster import MODEL, start_cluster

PARAMETERS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
              "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]},
                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
GET_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                "parameters": PARAMETERS}}
ARGUMENTS = {"city": "Lyon", "unit": "fahrenheit"}
HERMES_CALL = re.escape(f"<tool_call>{json.dumps({'name': 'get_weather', 'arguments': ARGUMENTS})}</tool_call>")
MESSAGES = [{"role": "user", "content": "What is the weather in Lyon?"}]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("dynamo-tools-logs")


@pytest.fixture(scope="module")
def client(tiny_model_dir, logs):
    cluster = start_cluster(tiny_model_dir, logs,
                            ("--dyn-tool-call-parser", "hermes", "--dyn-reasoning-parser", "qwen3"), workers=1)
    yield OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=60)
    cluster.stop()


def test_a_hermes_tool_call_comes_back_as_tool_calls(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[GET_WEATHER], max_tokens=80,
                                         temperature=0, extra_body={"guided_regex": HERMES_CALL}).choices[0]
    assert out.finish_reason == "tool_calls"
    assert not out.message.content
    [call] = out.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "get_weather",
                                                                                    ARGUMENTS)


def test_a_streamed_hermes_tool_call_comes_back_as_tool_call_deltas(client):
    chunks = [c.choices[0] for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[GET_WEATHER], max_tokens=80, temperature=0, stream=True,
        extra_body={"guided_regex": HERMES_CALL}) if c.choices]
    deltas = [call for c in chunks for call in c.delta.tool_calls or ()]
    assert {d.index for d in deltas} == {0}
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == ARGUMENTS
    assert "".join(c.delta.content or "" for c in chunks) == ""  # the tool call's text is not content too
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_tool_choice_is_guided_by_the_tools_schema(client, tool_choice):
    """tool_choice "required" guides to a JSON array of {name, parameters}; without parallel_tool_calls=False
    (maxItems 1) the random model appends calls until max_tokens. A named choice guides to the parameters alone."""
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[GET_WEATHER], max_tokens=80,
                                         temperature=0, tool_choice=tool_choice,
                                         parallel_tool_calls=False).choices[0]
    assert out.finish_reason == "tool_calls"
    [call] = out.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)


def test_the_frontend_takes_the_workers_parsers(client, logs):
    """The worker's parser flags reach the frontend with its registration: Dynamo's own log of the route it chose.
    (A guided `<think>...</think>` answer still came back whole in `content` with Dynamo 1.6.1's qwen3 parser, with
    and without chat_template_kwargs enable_thinking: the parser's effect is Dynamo's, not checked here.)"""
    client.models.list()
    assert re.search(r'tool_parser\S*=\S*Some\("hermes"\).*reasoning_parser\S*=\S*Some\("qwen3"\)',
                     (logs / "frontend.log").read_text())
