"""Greedy outputs equal HF `generate` token for token, under chunked prefill, preemption, prefix
caching and priorities, with requests arriving at different steps; the KV pool ends 100 % free."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from backend.engine import EngineConfig, LLMEngine
from backend.engine.sampling import SamplingParams
from tests.reference import hf_greedy


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int
    arrival_step: int
    priority: int = 0


def workload(vocab: int, seed: int = 0) -> list[Req]:
    """16 prompts of lengths 1..300 plus 6 sharing a 100-token prefix, arriving two per step."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731 (skip special ids 0..2)
    lengths = [1, 2, 5, 17, 31, 64, 100, 128, 150, 199, 200, 230, 256, 270, 299, 300]
    prefix = tok(100)
    prompts = [tok(n) for n in lengths] + [prefix + tok(rng.randint(1, 40)) for _ in range(6)]
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return [Req(prompts[i], rng.randint(1, 24), arrival_step=k // 2, priority=rng.choice([0, 1, 2]))
            for k, i in enumerate(order)]


def run(engine: LLMEngine, reqs: list[Req], use_priority: bool) -> list[list[int]]:
    outputs: dict[str, list[int]] = {}
    finals: dict[str, int] = {}
    step = 0
    while step <= max(r.arrival_step for r in reqs) or engine.has_unfinished():
        for i, r in enumerate(reqs):
            if r.arrival_step == step:
                engine.add_request(str(i), r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                                   priority=r.priority if use_priority else 0)
                outputs[str(i)] = []
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            finals[out.request_id] = finals.get(out.request_id, 0) + out.finished
        step += 1
    assert finals == {str(i): 1 for i in range(len(reqs))}, "every request ends with exactly one final output"
    return [outputs[str(i)] for i in range(len(reqs))]


SCENARIOS = {
    "chunked_prefill": dict(max_num_batched_tokens=24, q_tile=4),
    "preemption": dict(num_kv_blocks=48, max_num_batched_tokens=128),
    "prefix_caching": dict(max_num_batched_tokens=256, enable_prefix_caching=True),
    "priorities_no_evict": dict(num_kv_blocks=64, admission_policy="guaranteed_no_evict", max_num_seqs=4),
}


def check_scenario(model_dir, name: str, refs_cache: dict, attention: str = "auto") -> None:
    # float32 weights, the ones HF's reference reads (the default serves SmolLM2's GGUF as stored)
    engine = LLMEngine(EngineConfig.create(model=str(model_dir), attention=attention, quantization="none",
                                           **SCENARIOS[name]))
    reqs = workload(engine.model_config.vocab_size)
    key = str(model_dir)
    if key not in refs_cache:
        refs_cache[key] = hf_greedy(model_dir, [r.prompt for r in reqs], [r.max_tokens for r in reqs])
    outs = run(engine, reqs, use_priority=name.startswith("priorities"))
    mismatches = [i for i, (o, r) in enumerate(zip(outs, refs_cache[key])) if o != r]
    assert not mismatches, f"{name}: requests {mismatches} differ from HF generate"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
    if name == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    if name == "prefix_caching":
        assert engine.kv.stats.hit_tokens >= 5 * 96, "the shared 100-token prefix should hit the cache"


_refs: dict = {}


# Both attention paths of the torch runner: the CPU kernel and the gather graph that ONNX Runtime and
# TensorRT run (tests/test_onnx_runner.py checks those runtimes against PyTorch).
@pytest.mark.parametrize("attention", ["kernel", "gather"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_tiny_llama_matches_hf(tiny_model_dir, scenario, attention):
    check_scenario(tiny_model_dir, scenario, _refs, attention)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["kernel", "gather"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_smollm2_matches_hf(smollm2_dir, scenario, attention):
    check_scenario(smollm2_dir, scenario, _refs, attention)
