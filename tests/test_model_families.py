"""Every served family on random weights from transformers' own config classes: greedy outputs token for token equal
to HF `generate` in float32, with chunked prefill, prefix-cache hits and preemption (test_engine_correctness's
workload: 22 prompts of 1-300 tokens, many longer than the sliding windows here), the KV pool all free afterwards.
Both attention paths: the CPU kernel and the gather graph. Small shapes: 2-4 layers, GQA, 8 experts top-2 for the
mixtures (gpt-oss: sinks, YaRN, biased experts and router, alternating windows). Per family too: speculation (n-gram,
and the model drafting for itself) keeps HF's greedy ids; the int8 KV cache stays within its bounds. Bad input: an unknown model_type, a rope type not implemented, a feature not served:
refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (Gemma3TextConfig, GptOssConfig, MistralConfig, MixtralConfig, Phi3Config, Qwen2Config,
                          Qwen3Config, Qwen3MoeConfig)

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.models.config import SLIDING, load_model_config
from backend.engine.runners.torch_runner import TorchRunner
from load_tests.lora_adapters import make_adapter
from tests.reference import hf_greedy, peft_greedy
from tests.test_engine_correctness import SCENARIOS, run, workload
from tests.test_quantization import all_logits, assert_near

VOCAB = 512
WINDOW = 48  # shorter than most prompts of the workload: the window matters
SINK_STD = 8.0  # gpt-oss's sinks: near the random attention's top scores, so they move its outputs
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, initializer_range=0.5)
FAMILIES = {
    "qwen3": lambda: Qwen3Config(**COMMON, intermediate_size=128, num_hidden_layers=3, use_sliding_window=True,
                                 sliding_window=WINDOW, max_window_layers=1),  # layers 1 and 2 slide
    "gemma3_text": lambda: Gemma3TextConfig(**{**COMMON, "tie_word_embeddings": True}, intermediate_size=128,
                                            num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                            layer_types=[SLIDING, SLIDING, "full_attention", SLIDING],
                                            final_logit_softcapping=30.0),
    "mistral": lambda: MistralConfig(**COMMON, intermediate_size=128, num_hidden_layers=2, sliding_window=WINDOW),
    "qwen2": lambda: Qwen2Config(**COMMON, intermediate_size=128, num_hidden_layers=2, use_sliding_window=True,
                                 sliding_window=WINDOW, max_window_layers=1),
    "phi3": lambda: Phi3Config(**{**COMMON, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                "partial_rotary_factor": 0.5}},
                               intermediate_size=128, num_hidden_layers=2),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, intermediate_size=128, num_hidden_layers=2, num_experts=8,
                                        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                        mlp_only_layers=[1]),
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=32, num_hidden_layers=2, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=WINDOW),
    "gpt_oss": lambda: GptOssConfig(**{**COMMON, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}}, intermediate_size=32, num_hidden_layers=2,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW, layer_types=[SLIDING, "full_attention"]),
}


def save_random(path: Path, config, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        if isinstance(config, Gemma3TextConfig):  # HF starts Gemma's norms at 0 (a scale of 1): make them matter
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.data.normal_(0.0, 0.3)
        if isinstance(config, GptOssConfig):  # HF starts gpt-oss's expert biases at 0, and its sinks small: make them
            for name, p in model.named_parameters():  # matter (the random attention's scores are large)
                if name.endswith("proj_bias") or name.endswith("sinks"):
                    p.data.normal_(0.0, 2.0 if name.endswith("proj_bias") else SINK_STD)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory) -> Path:
    return save_random(tmp_path_factory.mktemp(request.param), FAMILIES[request.param]())


_refs: dict[str, list[list[int]]] = {}


def _assert_workload_matches_hf(family_dir: Path, engine: LLMEngine) -> None:
    """The workload's greedy ids are HF generate's (computed once a model), and the pool is all free afterwards."""
    reqs = workload(VOCAB)
    key = str(family_dir)
    if key not in _refs:
        _refs[key] = hf_greedy(family_dir, [r.prompt for r in reqs], [r.max_tokens for r in reqs])
    outs = run(engine, reqs, use_priority=False)
    assert [i for i, (o, r) in enumerate(zip(outs, _refs[key])) if o != r] == []
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption", "prefix_caching"])
@pytest.mark.parametrize("attention", ["kernel", "gather"])
def test_family_matches_hf(family_dir, scenario, attention):
    engine = LLMEngine(EngineConfig.create(model=str(family_dir), attention=attention, quantization="none",
                                           **SCENARIOS[scenario]))
    _assert_workload_matches_hf(family_dir, engine)


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_speculation_keeps_each_familys_greedy_output(family_dir, speculative):
    """Speculation must not change outputs: with n-gram drafts, and with the model drafting for itself (every draft
    right, so every step verifies a full run of them), the workload's greedy ids are HF's, the pool free after."""
    engine = LLMEngine(EngineConfig.create(model=str(family_dir), quantization="none", speculative=speculative,
                                           draft_model=str(family_dir) if speculative == "draft" else None,
                                           max_num_batched_tokens=64))
    _assert_workload_matches_hf(family_dir, engine)


def test_a_lora_adapter_on_each_family_equals_hf_and_peft(family_dir, tmp_path):
    """An adapter on every Linear of a layer (Phi-3's as its checkpoint fuses them: qkv_proj, gate_up_proj): greedy
    ids equal HF + peft's on prompts longer than the windows. A mixture of experts is refused by name (an adapter on
    its experts is not served), nothing loaded."""
    cfg = load_model_config(family_dir)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if cfg.model_type == "phi3" else None
    adapter = make_adapter(family_dir, tmp_path / "adapter", rank=8, seed=1, targets=targets)
    if cfg.moe_layers:
        with pytest.raises(ValueError, match=f"adapters on a mixture-of-experts model \\({cfg.model_type}\\)"):
            LLMEngine(EngineConfig.create(model=str(family_dir), quantization="none", lora_modules=f"a={adapter}"))
        return
    engine = LLMEngine(EngineConfig.create(model=str(family_dir), quantization="none", lora_modules=f"a={adapter}"))
    prompts = [r.prompt for r in workload(VOCAB)[:6]]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=12, ignore_eos=True), lora_name="a")
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [outs[str(i)] for i in range(len(prompts))] == peft_greedy(family_dir, adapter, prompts, [12] * len(prompts))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_an_int8_kv_cache_stays_within_its_bounds_on_each_family(family_dir):
    """The int8 KV cache on each family's attention (q/k norms, windows, partial rotary, Gemma's scale): the logits
    of a prompt longer than the windows within test_kv_cache_dtype's int8 bounds of the float32 cache's (measured at
    most 0.042 / 93 %). Mixtral's every layer routes, and a rounding that flips a router's top 2 changes which experts
    run: 0.15 / 80 % there (measured 0.118 / 83 %; Qwen3-MoE here, one routed layer: 0.016 / 99 %)."""
    tokens = [3 + i * 7 % (VOCAB - 3) for i in range(150)]
    runners = [TorchRunner(family_dir, "float32", 64, 16, gemm_backend="aten", quantization="none",
                           kv_cache_dtype=dtype) for dtype in ("auto", "int8")]
    reference, logits = (all_logits(r, tokens) for r in runners)
    every_layer_routes = runners[0].model_config.moe_layers == tuple(range(runners[0].model_config.num_layers))
    assert_near(logits, reference, *((0.15, 0.80) if every_layer_routes else (0.07, 0.90)))
    assert not torch.equal(logits, reference)


def test_a_sliding_model_holds_a_window_of_blocks(tmp_path):
    """Mistral slides on every layer: a 300-token prompt and 100 new tokens (25 blocks of 16) take at most the
    window's 3 blocks, a 64-token chunk's 4 and the block being filled, at any step; the output is HF's."""
    folder = save_random(tmp_path / "mistral", FAMILIES["mistral"]())
    engine = LLMEngine(EngineConfig.create(model=str(folder), quantization="none", max_num_batched_tokens=64,
                                           num_kv_blocks=64))
    prompt = [3 + i * 7 % (VOCAB - 3) for i in range(300)]
    engine.add_request("long", prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    out, peak = [], 0
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
        peak = max(peak, engine.kv.num_used_blocks)
    assert peak <= WINDOW // 16 + 64 // 16 + 1 and engine.kv.num_free_blocks == engine.kv.num_blocks
    assert out == hf_greedy(folder, [prompt], [100])[0]


def test_the_families_read_as_their_configs_say(tmp_path):
    """The facts each family's decoder runs on: the windows per layer, q/k norms, Gemma's norms and scales,
    Phi's partial rotary, the experts and which layers have them, gpt-oss's sinks, biases and activation."""
    cfgs = {name: load_model_config(save_random(tmp_path / name, make())) for name, make in FAMILIES.items()}
    assert [cfgs["qwen3"].window(i) for i in range(3)] == [0, WINDOW, WINDOW] and cfgs["qwen3"].qk_norm
    assert [cfgs["gemma3_text"].window(i) for i in range(4)] == [WINDOW, WINDOW, 0, WINDOW]
    gemma = cfgs["gemma3_text"]
    assert gemma.sandwich_norms and gemma.activation == "gelu_tanh" and gemma.embed_scale == 8.0
    assert gemma.scale == 24 ** -0.5 and gemma.final_logit_softcapping == 30.0
    assert cfgs["mistral"].max_window == WINDOW and cfgs["qwen2"].max_window == 0  # qwen2's layer 0 sees all
    assert cfgs["phi3"].rotary_dim == 8 and cfgs["phi3"].sliding_window == 0
    assert cfgs["qwen3_moe"].moe_layers == (0,) and cfgs["qwen3_moe"].num_experts == 8
    assert cfgs["mixtral"].moe_layers == (0, 1) and cfgs["mixtral"].norm_topk_prob
    oss = cfgs["gpt_oss"]
    assert [oss.window(i) for i in range(2)] == [WINDOW, 0] and oss.max_window == 0
    assert oss.attention_sinks and oss.attention_bias and oss.o_proj_bias and oss.router_bias and oss.expert_bias
    assert (oss.activation, oss.swiglu_alpha, oss.swiglu_limit) == ("clamped_swiglu", 1.702, 7.0)


def _edited(folder: Path, tmp_path: Path, **changes) -> Path:
    out = tmp_path / "edited"
    out.mkdir()
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "falcon"}, "model_type 'falcon' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope type 'dynamic' is not implemented"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping: gemma3_text models with it are not served"),
])
def test_what_is_not_served_is_refused_by_name(tmp_path, changes, message):
    base = "gemma3_text" if "attn_logit_softcapping" in changes else "qwen3"
    folder = save_random(tmp_path / "model", FAMILIES[base]())
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig.create(model=str(_edited(folder, tmp_path, **changes)), quantization="none"))
