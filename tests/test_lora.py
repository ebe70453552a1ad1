"""LoRA adapters (backend/engine/lora.py): greedy output under an adapter equals HF transformers + peft (float32) token
for token, for three adapters of different ranks and targets served in one batch with base-model requests (the base
rows equal HF without adapters); the kernel and the gather attention; chunked prefill and speculation change nothing;
the same prompt under two adapters shares no KV block, a reload under the same name reuses none of the old one's;
at most max_loras resident (evicted ones reload, outputs unchanged); an unknown adapter, a rank over max_lora_rank,
a malformed folder or an option not served is refused by name and the next request is served; unloading an adapter
in use is refused until its requests end; KV all free after, aborts included."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.errors import InvalidRequestError
from load_tests.lora_adapters import make_adapter
from tests.reference import peft_greedy

MAX_TOKENS = 12
# name -> (rank, target modules, options): q/k/v/o and MLP, attention only, MLP only with rsLoRA
ADAPTERS = {"all8": (8, None, {}), "attn4": (4, ["q_proj", "v_proj", "o_proj"], {}),
            "mlp16": (16, ["gate_proj", "up_proj", "down_proj"], {"use_rslora": True})}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {name: str(make_adapter(tiny_model_dir, root / name, rank, seed=i, targets=targets, **options))
            for i, (name, (rank, targets, options)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 49152, size=n).tolist() for n in (5, 19, 37, 64)]


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters, prompts) -> dict[str | None, list[list[int]]]:
    """HF + peft greedy per adapter, and HF alone (None)."""
    return {name: peft_greedy(tiny_model_dir, None if name is None else adapters[name], prompts,
                               [MAX_TOKENS] * len(prompts))
            for name in [None, *adapters]}


def engine_with(model_dir, adapters: dict[str, str], **settings) -> LLMEngine:
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    return LLMEngine(EngineConfig.create(model=str(model_dir), lora_modules=modules or None, **settings))


def run_all(engine: LLMEngine, requests: list[tuple[str | None, list[int]]]) -> list[list[int]]:
    """All requests in flight at once (one mixed batch); their greedy outputs in order."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(requests))]
    for rid, (lora, prompt) in zip(ids, requests):
        engine.add_request(rid, prompt, params, lora_name=lora)
    outs = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
    assert engine.kv.num_used_blocks == 0, "KV blocks leaked"
    return [outs[rid] for rid in ids]


@pytest.mark.parametrize("settings", [{}, {"attention": "gather"}, {"max_num_batched_tokens": 16},
                                      {"speculative": "ngram", "speculative_max_batch": 64}],
                         ids=["kernel", "gather", "chunked_prefill", "ngram"])
def test_a_mixed_batch_equals_hf_peft(tiny_model_dir, adapters, prompts, expected, settings):
    for name in adapters:  # the adapters change the output: an engine that ignored them would fail here
        assert expected[name] != expected[None], name
    engine = engine_with(tiny_model_dir, adapters, **settings)
    names = [None, *adapters]
    requests = [(name, prompt) for prompt in prompts for name in names]
    outs = run_all(engine, requests)
    for (name, prompt), out in zip(requests, outs):
        assert out == expected[name][prompts.index(prompt)], (name, len(prompt))
    stats = engine.stats()
    assert stats.lora_resident == 3 and dict(stats.lora_requests) == {name: len(prompts) for name in adapters}


def test_an_adapter_of_fused_qkv_and_gate_up_targets(tiny_model_dir, prompts, tmp_path):
    """An adapter trained on fused modules (Phi-3's qkv_proj / gate_up_proj: one A, B over the fused output) equals the
    same delta written as separate q/k/v and gate/up modules sharing that A, which HF + peft runs."""
    from safetensors.torch import load_file, save_file

    separate = make_adapter(tiny_model_dir, tmp_path / "separate", 8, seed=5,
                            targets=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])
    state = load_file(str(separate / "adapter_model.safetensors"))
    fused_state = {}
    for layer in range(2):
        for kind, fused, names in (("self_attn", "qkv_proj", "qkv"), ("mlp", "gate_up_proj", ("gate", "up"))):
            keys = [f"base_model.model.model.layers.{layer}.{kind}.{n}_proj.lora_" for n in names]
            for key in keys:  # one A for all the fused parts
                state[key + "A.weight"] = state[keys[0] + "A.weight"].clone()
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{fused}.lora_"
            fused_state[prefix + "A.weight"] = state[keys[0] + "A.weight"]
            fused_state[prefix + "B.weight"] = torch.cat([state[key + "B.weight"] for key in keys])
    save_file(state, str(separate / "adapter_model.safetensors"))
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(fused_state, str(fused / "adapter_model.safetensors"))
    config = json.loads((separate / "adapter_config.json").read_text())
    (fused / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["qkv_proj", "gate_up_proj"]}))
    expected = peft_greedy(tiny_model_dir, separate, prompts, [MAX_TOKENS] * len(prompts))
    assert expected != peft_greedy(tiny_model_dir, None, prompts, [MAX_TOKENS] * len(prompts))
    engine = engine_with(tiny_model_dir, {"fused": str(fused)})
    assert run_all(engine, [("fused", p) for p in prompts]) == expected


def test_a_request_alone_equals_itself_in_the_mixed_batch(tiny_model_dir, adapters, prompts, expected):
    engine = engine_with(tiny_model_dir, adapters)
    assert run_all(engine, [("attn4", prompts[2])]) == [expected["attn4"][2]]
    assert run_all(engine, [(None, prompts[2])]) == [expected[None][2]]


def test_the_same_prompt_under_two_adapters_shares_no_block(tiny_model_dir, adapters, prompts, expected):
    engine = engine_with(tiny_model_dir, adapters)
    prompt = prompts[3]  # 64 tokens: 3 full blocks are cached after it

    def cached(lora: str | None) -> int:
        engine.add_request("p", prompt, SamplingParams(max_tokens=2, ignore_eos=True), lora_name=lora)
        outs = [o for _ in range(8) for o in engine.step() if o.finished]
        assert engine.kv.num_used_blocks == 0
        return outs[0].num_cached_tokens

    assert cached("all8") == 0
    assert cached("all8") == 48  # the same adapter reuses its blocks
    assert cached("attn4") == 0 and cached(None) == 0  # another adapter, or the base model, never does
    assert cached(None) == 48


def test_a_reload_under_the_same_name_reuses_no_kv(tiny_model_dir, adapters, prompts, expected):
    engine = engine_with(tiny_model_dir, {"a": adapters["all8"]})
    assert run_all(engine, [("a", prompts[3])]) == [expected["all8"][3]]
    engine.load_lora("a", adapters["attn4"])  # other weights under the same name
    engine.add_request("again", prompts[3], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), lora_name="a")
    outs = [o for _ in range(40) for o in engine.step()]
    assert [t for o in outs for t in o.new_token_ids] == expected["attn4"][3]
    assert outs[-1].finished and outs[-1].num_cached_tokens == 0


def test_at_most_max_loras_resident(tiny_model_dir, adapters, prompts, expected):
    engine = engine_with(tiny_model_dir, adapters, max_loras=2)
    assert engine.stats().lora_resident == 2 and set(engine.list_loras()) == set(adapters)
    for name in ["all8", "attn4", "mlp16", "all8"]:  # each evicts the least recently used: reloaded when named
        assert run_all(engine, [(name, prompts[1])]) == [expected[name][1]]
    stats = engine.stats()
    assert stats.lora_resident == 2 and stats.lora_evictions >= 3 and stats.lora_loads >= 5
    # two in use by unfinished requests: a third cannot come in, and says why
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("x", prompts[0], params, lora_name="all8")
    engine.add_request("y", prompts[0], params, lora_name="attn4")
    with pytest.raises(InvalidRequestError, match="max_loras") as err:
        engine.add_request("z", prompts[0], params, lora_name="mlp16")
    assert err.value.field == "lora_name"
    engine.abort("x")
    engine.add_request("z", prompts[0], params, lora_name="mlp16")  # all8's request ended: it may go
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_used_blocks == 0


def test_unknown_adapter_refused_by_name_and_the_next_request_served(tiny_model_dir, adapters, prompts, expected):
    engine = engine_with(tiny_model_dir, adapters)
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'") as err:
        engine.add_request("bad", prompts[0], SamplingParams(max_tokens=4), lora_name="nope")
    assert err.value.field == "lora_name"
    assert run_all(engine, [("mlp16", prompts[0])]) == [expected["mlp16"][0]]


def test_unloading_an_adapter_in_use_is_refused_until_its_requests_end(tiny_model_dir, adapters, prompts):
    engine = engine_with(tiny_model_dir, adapters)
    engine.add_request("busy", prompts[1], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), lora_name="all8")
    engine.step()
    with pytest.raises(InvalidRequestError, match="in use"):
        engine.unload_lora("all8")
    with pytest.raises(InvalidRequestError, match="in use"):
        engine.load_lora("all8", adapters["attn4"])
    engine.abort("busy")
    engine.step()
    engine.unload_lora("all8")
    assert "all8" not in engine.list_loras() and engine.kv.num_used_blocks == 0
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter"):
        engine.add_request("gone", prompts[1], SamplingParams(max_tokens=2), lora_name="all8")


def _broken(folder, how: str) -> None:
    config = folder / "adapter_config.json"
    if how == "no config":
        config.unlink()
    elif how == "not json":
        config.write_text("{")
    elif how == "no weights":
        (folder / "adapter_model.safetensors").unlink()
    elif how == "dora":
        config.write_text(json.dumps({**json.loads(config.read_text()), "use_dora": True}))


@pytest.mark.parametrize("how, words", [
    ("no config", "no adapter_config.json"), ("not json", "is not JSON"),
    ("no weights", "no adapter_model.safetensors"), ("dora", "use_dora"),
    ("rank", "rank 16 .* over max_lora_rank 8"), ("lm_head", "not a LoRA A/B of a served target module"),
])
def test_bad_adapters_are_refused_by_name(tiny_model_dir, adapters, prompts, expected, tmp_path, how, words):
    if how == "lm_head":
        folder = make_adapter(tiny_model_dir, tmp_path / "head", 4, seed=3, targets=["q_proj", "lm_head"])
    else:
        folder = tmp_path / "broken"
        shutil.copytree(adapters["mlp16"], folder)
        _broken(folder, how)
    with pytest.raises(ValueError, match=f"lora_modules: LoRA adapter 'bad' .*{words}"):
        engine_with(tiny_model_dir, {"bad": str(folder)}, max_lora_rank=8)
    engine = engine_with(tiny_model_dir, {}, max_lora_rank=8)  # at run time: refused, and the next request served
    with pytest.raises(InvalidRequestError, match=words) as err:
        engine.load_lora("bad", str(folder))
    assert err.value.field == "lora_path" and engine.list_loras() == {}
    assert engine.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) == \
        [expected[None][0]]


@pytest.mark.parametrize("settings, words", [
    ({"lora_modules": "a"}, "lora_modules: 'a': expected NAME=PATH"),
    ({"lora_modules": "a=/x,a=/y"}, "named twice"),
    ({"max_loras": 0}, "max_loras: must be >= 1"),
    ({"lora_modules": "a=/x", "runtime": "onnxruntime"}, "served by runtime torch on the CPU"),
])
def test_lora_settings_are_refused_by_name(tiny_model_dir, settings, words):
    with pytest.raises(ValueError, match=words):
        LLMEngine(EngineConfig.create(model=str(tiny_model_dir), **settings))


def test_served_on_every_door(tmp_path_factory, tiny_model_dir, adapters):
    """lora_name on the llm, lora_task_id (tensorrtllm_backend's) on the ensemble and llm_bls: the text HF + peft's
    greedy ids decode to; an unknown adapter and tensorrtllm_backend's lora_weights are refused by name, and the next
    request is served; requests per adapter on the metrics port."""
    import urllib.error
    import urllib.request

    from tritonclient.utils import InferenceServerException

    from backend.serving.detokenize import decode_text
    from backend.serving.tokenizer import encode, load_tokenizer
    from client.client import LLMClient
    from tests.conftest import start_server

    tokenizer = load_tokenizer(tiny_model_dir)
    prompt = "The quick brown fox"
    ids = encode(tokenizer, prompt, False)
    want = {name: decode_text(tokenizer, peft_greedy(tiny_model_dir, adapters.get(name), [ids], [16])[0])
            for name in (None, "attn4", "mlp16")}
    assert len(set(want.values())) == 3
    settings = {"lora_modules": f"attn4={adapters['attn4']},mlp16={adapters['mlp16']}", "kv_cache_memory_gb": "0.05"}
    with start_server(tmp_path_factory.mktemp("repo_lora"), tiny_model_dir, settings) as srv:
        srv.wait_ready(300)
        for model, adapter in (("llm", {"lora_name": "attn4"}), ("ensemble", {"lora_task_id": 2}),
                               ("llm_bls", {"lora_task_id": 1}), ("llm", {})):
            name = adapter.get("lora_name") or {1: "attn4", 2: "mlp16", None: None}[adapter.get("lora_task_id")]
            with LLMClient(srv.url_grpc, model) as client:
                text = client.generate(prompt, max_tokens=16, ignore_eos=True, stream=True, **adapter).text
            assert text == want[name], (model, adapter)
        with LLMClient(srv.url_grpc, "llm") as client:
            with pytest.raises(InferenceServerException, match="lora_name: unknown LoRA adapter 'nope'"):
                client.generate(prompt, max_tokens=4, lora_name="nope")
            with pytest.raises(InferenceServerException, match="lora_task_id: no LoRA adapter has lora_task_id 9"):
                client.generate(prompt, max_tokens=4, lora_task_id=9)
        body = json.dumps({"text_input": prompt, "max_tokens": 4, "lora_weights": [[0.5]]}).encode()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(f"{srv.url_http}/v2/models/llm/generate", data=body),
                                   timeout=30)
        assert err.value.code == 400 and "lora_weights" in err.value.read().decode()
        with LLMClient(srv.url_grpc, "llm") as client:
            assert client.generate(prompt, max_tokens=16, ignore_eos=True, lora_name="mlp16").text == want["mlp16"]
        metrics = urllib.request.urlopen(srv.url_metrics, timeout=30).read().decode()
    assert 'llm_lora_adapters_resident{' in metrics
    for name, count in (("attn4", 2), ("mlp16", 2)):
        assert any(line.startswith("llm_lora_requests_total{") and f'lora="{name}"' in line
                   and line.endswith(f" {count}") for line in metrics.splitlines()), name
