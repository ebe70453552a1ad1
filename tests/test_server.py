"""The product, end to end: a real tritonserver on the model repository (tiny model), through tritonclient."""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend.serving.detokenize import decode_text
from backend.engine import EngineConfig, LLMEngine
from backend.engine.sampling import SamplingParams
from backend.serving.tokenizer import encode, load_tokenizer
from client.client import LLMClient, build_inputs
from load_tests.faults import end_streams
from tests.conftest import LLM_TEST_SETTINGS, start_server

PROMPTS = ["Hello there", "你好,世界。今天天气很好", "I ❤️ 🦙 and 👨‍👩‍👧", "def f(x):\n    return x * 2",
           "The quick brown fox jumps over the lazy dog. " * 6]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tokenizer):
    """Offline engine text for a prompt: what every serving path must reproduce."""
    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir)))
    cache: dict[tuple[str, int], str] = {}

    def text(prompt: str, max_tokens: int) -> str:
        if (prompt, max_tokens) not in cache:
            ids = encode(tokenizer, prompt, apply_chat_template=False)
            out = engine.generate([ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
            cache[prompt, max_tokens] = decode_text(tokenizer, out)
        return cache[prompt, max_tokens]

    return text


def grpc_url(server) -> str:
    return server.url_grpc


def metrics(server) -> dict[str, float]:
    body = urllib.request.urlopen(server.url_metrics, timeout=10).read().decode()
    values = {}
    for line in body.splitlines():
        if line.startswith("llm_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'(model|version)="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
            values[name] = float(value)
    return values


def wait_until_idle(server, timeout: float = 10.0) -> dict[str, float]:
    """The engine has nothing running and every KV block is free (read from the metrics port)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m.get("llm_num_requests_running") == 0 and m.get('llm_kv_blocks{state="used"}') == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {m}")
        time.sleep(0.05)


TEXT_DOORS = ["llm", "ensemble", "llm_bls"]  # the llm takes text itself (the default), the others tokenize first


@pytest.mark.parametrize("model", TEXT_DOORS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_equals_non_streamed_equals_engine(server, reference, model, prompt):
    with LLMClient(grpc_url(server), model) as client:
        streamed = client.generate(prompt, max_tokens=24, ignore_eos=True, stream=True)
        whole = client.generate(prompt, max_tokens=24, ignore_eos=True, stream=False)
    assert streamed.text == whole.text == reference(prompt, 24)
    assert len(streamed.chunk_times) > 1 and len(whole.chunk_times) == 1


@pytest.mark.parametrize("model", TEXT_DOORS)
def test_stream_interval_sends_the_same_text_in_fewer_responses(server, reference, model):
    """24 tokens with stream_interval 5: the first response at once, then one per 5 tokens (1 + 5 x 4 + 3)."""
    prompt = PROMPTS[0]
    with LLMClient(grpc_url(server), model) as client:
        result = client.generate(prompt, max_tokens=24, ignore_eos=True, stream=True, stream_interval=5)
    assert result.text == reference(prompt, 24)
    assert len(result.chunk_times) == 6


def test_non_streamed_echoes_the_prompt_when_asked(server, tokenizer, reference):
    prompt = PROMPTS[1]
    with LLMClient(grpc_url(server)) as client:
        result = client.generate(prompt, max_tokens=8, ignore_eos=True, exclude_input_in_output=False)
    assert result.text.startswith(prompt) and result.text.endswith(reference(prompt, 8))


@pytest.mark.parametrize("model", ["llm", "ensemble"])
def test_http_generate_and_generate_stream(server, reference, model):
    prompt = PROMPTS[2]
    body = json.dumps({"text_input": prompt, "max_tokens": 16, "ignore_eos": True}).encode()
    url = f"{server.url_http}/v2/models/{model}"
    out = json.loads(urllib.request.urlopen(urllib.request.Request(f"{url}/generate", body), timeout=60).read())
    assert out["text_output"] == reference(prompt, 16)
    body = json.dumps({"text_input": prompt, "max_tokens": 16, "ignore_eos": True, "stream": True}).encode()
    events = urllib.request.urlopen(urllib.request.Request(f"{url}/generate_stream", body), timeout=60).read()
    pieces = [json.loads(line[5:]) for line in events.decode().splitlines() if line.startswith("data:")]
    assert len(pieces) > 1 and "".join(p["text_output"] for p in pieces) == reference(prompt, 16)


def test_32_concurrent_streams_all_finish_correctly(server, reference):
    jobs = [(f"Request {i}: {PROMPTS[i % len(PROMPTS)]}", 8 + i % 17) for i in range(32)]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with LLMClient(grpc_url(server)) as client:
                results[i] = client.generate(jobs[i][0], max_tokens=jobs[i][1], ignore_eos=True, stream=True).text
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert [results[i] for i in range(32)] == [reference(p, n) for p, n in jobs]
    wait_until_idle(server)


def test_optional_outputs_only_when_asked(server):
    with LLMClient(grpc_url(server)) as client:
        plain = client.generate("Hi", max_tokens=4)
        full = client.generate("Hi", max_tokens=4, ignore_eos=True, return_log_probs=True,
                               return_num_input_tokens=True, return_num_output_tokens=True, return_finish_reason=True)
    assert plain.outputs == {}
    assert int(full.outputs["num_output_tokens"].reshape(-1)[0]) == 4
    assert int(full.outputs["num_input_tokens"].reshape(-1)[0]) == 1
    assert full.finish_reason == "length"
    assert full.outputs["output_log_probs"].size == 4 and np.all(full.outputs["output_log_probs"] <= 0)


def test_stop_words_end_generation_across_tokens(server, reference):
    text = reference(PROMPTS[0], 24)
    stop = text[5:9]  # four characters that very likely span a token boundary
    with LLMClient(grpc_url(server)) as client:
        result = client.generate(PROMPTS[0], max_tokens=24, ignore_eos=True, stop_words=[stop],
                                 return_finish_reason=True)
    assert result.finish_reason == "stop"
    assert stop in result.text and result.text.find(stop) + len(stop) <= len(result.text)
    assert text.startswith(result.text)


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_past_its_timeout_ends_with_its_partial_text(server, reference, stream):
    with LLMClient(grpc_url(server)) as client:
        result = client.generate(PROMPTS[0], max_tokens=1000, ignore_eos=True, timeout_ms=300, stream=stream,
                                 return_finish_reason=True, return_num_output_tokens=True)
    assert result.finish_reason == "timeout"
    n = int(result.outputs["num_output_tokens"].reshape(-1)[0])
    assert 0 < n < 1000 and result.text and reference(PROMPTS[0], n).startswith(result.text)
    wait_until_idle(server)  # nothing running, every KV block free


def test_seed_gives_reproducible_samples(server):
    with LLMClient(grpc_url(server)) as client:
        a, b, c = (client.generate("Hi", max_tokens=12, ignore_eos=True, temperature=1.0, top_k=40, seed=s).text
                   for s in (7, 7, 8))
    assert a == b != c


def test_genai_perf_and_openai_frontend_payloads(server):
    with LLMClient(grpc_url(server)) as client:
        # genai-perf (tensorrtllm backend): text_input, max_tokens, stream, exclude_input_in_output, min_length
        genai = client.generate("Hi", max_tokens=10, stream=True, exclude_input_in_output=True, min_length=10,
                                return_num_output_tokens=True)
        # Triton's OpenAI frontend, TRT-LLM format
        openai = client.generate("Hi", max_tokens=10, stream=True, stop_words=["\n\n"], top_p=0.9,
                                 frequency_penalty=0.0, presence_penalty=0.0, seed=1, temperature=0.0,
                                 return_num_input_tokens=True, return_num_output_tokens=True)
    assert int(genai.outputs["num_output_tokens"].reshape(-1)[0]) == 10 and genai.text
    assert int(openai.outputs["num_input_tokens"].reshape(-1)[0]) == 1 and openai.text


# Bad inputs, on every front door: tests/test_bad_inputs.py (each input of the table, each way it can be bad).


def test_overload_answers_overloaded_and_serves_the_rest(server):
    """Fill the engine (48 running + 16 waiting, LLM_TEST_SETTINGS) with long requests, then: the next
    requests are refused with 'overloaded', and once the long ones are cancelled the server serves."""
    running, waiting = int(LLM_TEST_SETTINGS["max_num_seqs"]), int(LLM_TEST_SETTINGS["max_waiting"])
    clients = [LLMClient(grpc_url(server)) for _ in range(running + waiting)]
    finals: list[str] = []

    def hold(client: LLMClient) -> None:
        chunks = list(client.stream("Hi", max_tokens=1000, ignore_eos=True, return_finish_reason=True))
        finals.append(chunks[-1].outputs["finish_reason"].reshape(-1)[0].decode() if chunks[-1].final else "none")

    threads = [threading.Thread(target=hold, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while (m := metrics(server))["llm_num_requests_running"] < running or m["llm_num_requests_waiting"] < waiting:
            assert time.monotonic() < deadline, f"the engine never filled up: {m}"
            time.sleep(0.01)
        refused = metrics(server).get('llm_requests_refused_total{reason="overloaded"}', 0)
        with LLMClient(grpc_url(server)) as extra:
            for _ in range(3):
                with pytest.raises(InferenceServerException, match="overloaded"):
                    extra.generate("Hi", max_tokens=8)
        assert metrics(server)['llm_requests_refused_total{reason="overloaded"}'] == refused + 3
    finally:  # a failure here must not leave the shared server full for the tests after it
        end_streams(clients, threads, 60)
    assert len(finals) == len(clients) and set(finals) <= {"cancelled", "length"}, finals
    with LLMClient(grpc_url(server)) as client:
        assert client.generate("Hi", max_tokens=8, ignore_eos=True, return_num_output_tokens=True) \
            .outputs["num_output_tokens"].reshape(-1)[0] == 8
    assert 1 <= wait_until_idle(server)["llm_cpu_threads"] <= os.cpu_count()  # runtime torch on the CPU sets them


def test_latency_histograms_count_every_token_before_the_last_response(server):
    """TTFT and inter-token latency are kept in the stub and sent as a histogram's series (backend/triton/metrics.py):
    by the time a client has its last response, its first token and its 5 gaps are counted."""
    before = wait_until_idle(server)
    with LLMClient(grpc_url(server)) as client:
        assert len(list(client.stream("Hi", max_tokens=6, ignore_eos=True, stream=True))) >= 6
    after = metrics(server)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew("llm_time_to_first_token_seconds_count") == 1 and grew("llm_inter_token_latency_seconds_count") == 5
    for name in ("llm_time_to_first_token_seconds", "llm_inter_token_latency_seconds"):
        buckets = sorted((float(m[1]), after[key]) for key in after if (m := re.fullmatch(
            name + r'_bucket\{le="([^"]+)"\}', key)))
        assert [le for le, _ in buckets][-2:] == [30.0, float("inf")]
        counts = [count for _, count in buckets]
        assert counts == sorted(counts) and counts[-1] == after[f"{name}_count"]  # cumulative, as Prometheus reads
        assert 0 < grew(f"{name}_sum") < 30
    deadline = time.monotonic() + 5  # the step histograms: flushed once the engine is idle
    while metrics(server).get("llm_step_tokens_count", 0) < before.get("llm_step_tokens_count", 0) + 6:
        assert time.monotonic() < deadline, "the step histogram did not count the request's 6 steps"
        time.sleep(0.05)


def _first_chunks_then(client: LLMClient, prompt: str, n: int, **options):
    chunks = client.stream(prompt, max_tokens=900, ignore_eos=True, stream=True, return_finish_reason=True, **options)
    for _ in range(n):
        next(chunks)
    return chunks


def test_cancel_through_the_ensemble_with_stop_frees_kv(server):
    with LLMClient(grpc_url(server), "ensemble") as client:
        chunks = _first_chunks_then(client, "Tell me a long story", 3)
        assert metrics(server)['llm_kv_blocks{state="used"}'] > 0
        client.cancel()
        rest = list(chunks)
    assert rest[-1].final
    reasons = {c.outputs["finish_reason"].reshape(-1)[0].decode() for c in rest if "finish_reason" in c.outputs}
    assert "cancelled" in reasons
    wait_until_idle(server, timeout=2.0)


@pytest.mark.parametrize("model", ["llm", "ensemble"])
def test_an_abandoned_stream_is_stopped_and_drained_before_it_closes(server, model):
    """LLMClient never cancels a stream the server may still write to (Triton 2.51's stream deadlock,
    docs/reliability.md): it sends `stop`, reads to the last final response, then closes the stream."""
    with LLMClient(grpc_url(server), model) as client:
        chunks = _first_chunks_then(client, "Tell me a long story", 3)
        chunks.close()  # what a `break` out of the loop, or the generator's garbage collection, does
        assert client._finals_due == 0 and client._active_id is None
        wait_until_idle(server, timeout=2.0)
        assert client.generate("Hello", max_tokens=4).text  # the client serves its next request


@pytest.mark.parametrize("model", ["llm", "llm_bls"])
def test_a_text_stream_cancelled_by_its_client_frees_kv(cancelling_server, model):
    server = cancelling_server
    client = LLMClient(grpc_url(server), model)
    chunks = _first_chunks_then(client, "Tell me a long story", 3)
    assert metrics(server)['llm_kv_blocks{state="used"}'] > 0
    client._grpc.stop_stream(cancel_requests=True)  # what a client disconnect does: no `stop` is sent
    client._active_id = None
    wait_until_idle(server, timeout=2.0)
    client.close()
    del chunks


def test_direct_llm_sees_grpc_cancel_and_frees_kv(cancelling_server, tokenizer):
    server = cancelling_server
    client = grpcclient.InferenceServerClient(grpc_url(server))
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    prompt = np.array([encode(tokenizer, "Tell me a story", False)], dtype=np.int32)
    ids = grpcclient.InferInput("input_ids", list(prompt.shape), "INT32")
    ids.set_data_from_numpy(prompt)
    client.async_stream_infer("llm", [ids] + build_inputs("", max_tokens=900, stream=True, ignore_eos=True)[1:],
                              request_id="direct", enable_empty_final_response=True)
    for _ in range(3):
        result, error = responses.get(timeout=30)
        assert error is None and result.as_numpy("output_ids").size == 1
    client.stop_stream(cancel_requests=True)
    wait_until_idle(server, timeout=2.0)
    client.close()


@pytest.fixture(scope="module")
def onnx_server(tmp_path_factory, tiny_model_dir):
    from build_engine.export_onnx import cached_engine_dir

    settings = {**LLM_TEST_SETTINGS, "runtime": "onnxruntime",
                "engine_dir": str(cached_engine_dir(tiny_model_dir, "float32"))}
    with start_server(tmp_path_factory.mktemp("repo_onnx"), tiny_model_dir, settings) as srv:
        srv.wait_ready(600)
        yield srv


@pytest.mark.parametrize("model", TEXT_DOORS)
def test_onnxruntime_runner_serves_the_same_text(onnx_server, reference, model):
    with LLMClient(grpc_url(onnx_server), model) as client:
        for prompt in PROMPTS[:3]:
            streamed = client.generate(prompt, max_tokens=24, ignore_eos=True, stream=True)
            whole = client.generate(prompt, max_tokens=24, ignore_eos=True, stream=False)
            assert streamed.text == whole.text == reference(prompt, 24)
