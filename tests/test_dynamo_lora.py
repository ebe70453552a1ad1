"""LoRA adapters through NVIDIA Dynamo: a real frontend and worker (.venv-dynamo); the worker's `--lora-modules` are
registered as models of their own, so OpenAI's `model` names an adapter. Greedy text equals HF + peft's; the base
model's equals HF's; the KV router sends an adapter's shared prefix to the worker that holds it (the workers' KV events
carry the adapter's name), and the base model's same prompt shares nothing with it; an adapter the worker did not
load is refused by the frontend, and the next request is served; an adapter loaded at run time (POST
/engine/update/load_lora on the worker's system port, with /v1/loras' body) is served once listed, and is gone once
unloaded."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from backend.serving.tokenizer import load_tokenizer
from load_tests.lora_adapters import make_adapter
from tests.dynamo_cluster import MODEL, learned, prefix_turns, routed, start_cluster
from tests.reference import peft_greedy

PROMPT = "The capital of France is"
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dynamo_loras")
    return {"sql": str(make_adapter(tiny_model_dir, root / "sql", 8, seed=11)),
            "chat": str(make_adapter(tiny_model_dir, root / "chat", 4, seed=12, targets=["q_proj", "v_proj"]))}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, adapters, tmp_path_factory):
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    c = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("dynamo-lora-logs"), ("--lora-modules", modules),
                      workers=2)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_the_model_field_names_an_adapter(client, tiny_model_dir, adapters):
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer(PROMPT)["input_ids"]
    for model, adapter in ((MODEL, None), ("sql", adapters["sql"]), ("chat", adapters["chat"])):
        [expected] = peft_greedy(tiny_model_dir, adapter, [ids], [12])
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body=IGNORE_EOS)
        assert out.choices[0].text == tokenizer.decode(expected), model
    assert {MODEL, "sql", "chat"} <= {m.id for m in client.models.list().data}


def test_an_adapter_not_loaded_is_refused_and_the_next_request_served(client):
    with pytest.raises(NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=4)
    assert client.completions.create(model="sql", prompt=PROMPT, max_tokens=4, extra_body=IGNORE_EOS).usage \
        .completion_tokens == 4


def test_the_router_sends_an_adapters_shared_prefix_to_the_worker_that_holds_it(cluster):
    prefix = " ".join(f"v{i % 11}" for i in range(200))  # ~200 tokens, 12 blocks
    served = prefix_turns(cluster, prefix, model="sql")
    assert learned(served), served
    # the base model and another adapter share nothing
    assert routed(cluster, f"{prefix} turn 9")[1] == 0 and routed(cluster, f"{prefix} turn 9", "chat")[1] == 0


def test_an_adapter_loaded_and_unloaded_at_run_time(cluster, client, tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    folder = make_adapter(tiny_model_dir, tmp_path / "late", 16, seed=13)
    port = int(cluster.url.rsplit(":", 1)[1])

    def update(key: str, body: dict, worker: int = 0) -> dict:  # on a worker's system port
        request = urllib.request.Request(f"http://127.0.0.1:{port + 1 + worker}/engine/update/{key}",
                                         json.dumps(body).encode(), {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.load(r)

    def listed(present: bool) -> None:
        deadline = time.monotonic() + 30
        while ("late" in {m.id for m in client.models.list().data}) != present:
            assert time.monotonic() < deadline, f"/v1/models: 'late' still {'absent' if present else 'listed'}"
            time.sleep(0.2)

    bad = update("load_lora", {"lora_name": "late", "source": {"uri": f"file://{tmp_path}"}})
    assert bad["status"] == "error" and "no adapter_config.json" in bad["message"], bad
    # on one worker only, the frontend may route it to the other, which refuses it by name rather than answer with
    # the base model; then on every worker (as with Dynamo's /v1/loras)
    assert update("load_lora", {"lora_name": "late", "source": {"uri": f"file://{folder}"}})["status"] == "success"
    listed(True)
    for _ in range(6):
        try:
            client.completions.create(model="late", prompt=PROMPT, max_tokens=2, extra_body=IGNORE_EOS)
        except BadRequestError as err:
            assert "'late' is neither" in str(err)
    assert update("load_lora", {"lora_name": "late", "source": {"uri": f"file://{folder}"}}, 1)["status"] == "success"
    assert "late" in update("list_loras", {})["loras"] and "late" in update("list_loras", {}, 1)["loras"]
    listed(True)
    [expected] = peft_greedy(tiny_model_dir, folder, [tokenizer(PROMPT)["input_ids"]], [12])
    out = client.completions.create(model="late", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=IGNORE_EOS)
    assert out.choices[0].text == tokenizer.decode(expected)
    assert all(update("unload_lora", {"lora_name": "late"}, w)["status"] == "success" for w in (0, 1))
    listed(False)
    assert "unknown LoRA adapter 'late'" in update("unload_lora", {"lora_name": "late"})["message"]
