"""`speculative: draft` (backend/engine/draft_model.py): greedy output token for token equal to the output without
speculation and to HF, for k in {1, 3, 5}, under chunked prefill and preemption; a draft model equal to the model
has every draft accepted (so its mirrored KV is right: a random tiny model's next token is otherwise never guessed);
another draft model, or the model's own int4 copy (`draft_quantization`), changes no output; both KV pools free
after, aborts and preemptions included; no drafts above speculative_max_batch; settings refused by name; served
through a real tritonserver."""

from __future__ import annotations

import functools

import pytest

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from client.client import LLMClient
from tests.conftest import start_server
from tests.reference import hf_greedy
from tests.test_engine_correctness import SCENARIOS, run, workload
from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """Another seeded random Llama of the same tokenizer: its drafts are mostly rejected."""
    return make_tiny_llama(tmp_path_factory.mktemp("draft_other"), seed=1, num_hidden_layers=1)


@functools.cache
def reference(model_dir) -> list[list[int]]:
    reqs = workload(LLMEngine(EngineConfig.create(model=str(model_dir))).model_config.vocab_size)
    return hf_greedy(model_dir, [r.prompt for r in reqs], [r.max_tokens for r in reqs])


def drafting(model_dir, draft_dir, k: int = 3, **settings) -> LLMEngine:
    """Speculating at every batch size (speculative_max_batch 64), unless told otherwise."""
    settings = {"speculative_max_batch": 64, **settings}
    return LLMEngine(EngineConfig.create(model=str(model_dir), speculative="draft", draft_model=str(draft_dir),
                                         num_speculative_tokens=k, **settings))


def check_pools_free(engine: LLMEngine) -> None:
    drafter = engine.scheduler.drafter
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
    assert drafter.kv.num_free_blocks == drafter.kv.num_blocks and not drafter.mirrors, "draft KV blocks leaked"


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption"])
def test_the_model_as_its_own_draft_has_every_draft_accepted(tiny_model_dir, scenario, k):
    settings = {**SCENARIOS[scenario], **({"num_kv_blocks": 28} if scenario == "preemption" else {})}
    engine = drafting(tiny_model_dir, tiny_model_dir, k, **settings)
    reqs = workload(engine.model_config.vocab_size)
    assert run(engine, reqs, use_priority=False) == reference(tiny_model_dir)
    # a verify row and the draft's decode round alike except at near-ties (speculation.py)
    assert engine.num_draft_tokens > 100 and engine.num_accepted_tokens >= 0.98 * engine.num_draft_tokens
    check_pools_free(engine)
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("draft", ["another model", "the model in int4"])
def test_another_draft_model_changes_no_output(tiny_model_dir, other_draft_dir, k, draft):
    settings = dict(SCENARIOS["chunked_prefill"])
    if draft == "the model in int4":
        settings["draft_quantization"] = "int4"
    draft_dir = other_draft_dir if draft == "another model" else tiny_model_dir
    engine = drafting(tiny_model_dir, draft_dir, k, **settings)
    reqs = workload(engine.model_config.vocab_size)
    assert run(engine, reqs, use_priority=False) == reference(tiny_model_dir)
    assert engine.num_accepted_tokens < engine.num_draft_tokens / 2
    check_pools_free(engine)


def test_verify_rows_run_through_the_exported_graph(tiny_model_dir, tiny_engine_dir):
    """runtime onnxruntime: a drafted sequence's 1 + k logits rows come out of the ONNX graph (its logits axis is
    dynamic), with the same output and every draft of the model's own copy accepted."""
    engine = drafting(tiny_model_dir, tiny_model_dir, 3, runtime="onnxruntime", engine_dir=str(tiny_engine_dir),
                      **SCENARIOS["chunked_prefill"])
    reqs = workload(engine.model_config.vocab_size)
    assert run(engine, reqs, use_priority=False) == reference(tiny_model_dir)
    assert engine.num_draft_tokens > 100 and engine.num_accepted_tokens >= 0.98 * engine.num_draft_tokens
    check_pools_free(engine)


def test_aborts_free_the_draft_pool(tiny_model_dir):
    engine = drafting(tiny_model_dir, tiny_model_dir, 3)
    reqs = workload(engine.model_config.vocab_size)[:6]
    for i, r in enumerate(reqs):
        engine.add_request(f"r{i}", r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.drafter.mirrors
    unfinished = sorted(engine.requests)
    assert len(unfinished) >= 2
    for request_id in unfinished[::2]:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    check_pools_free(engine)


def test_no_drafts_while_more_than_speculative_max_batch_run(tiny_model_dir):
    """Six requests that start and end together: with speculative_max_batch 1 no step drafts, with 6 they do."""
    reqs = workload(49152)[:6]
    prompts = [r.prompt for r in reqs]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    drafted = {}
    for max_batch in (1, 6):
        engine = drafting(tiny_model_dir, tiny_model_dir, 3, speculative_max_batch=max_batch)
        assert engine.generate(prompts, params) == [o[:16] for o in hf_greedy(tiny_model_dir, prompts, [16] * 6)]
        drafted[max_batch] = engine.num_draft_tokens
        check_pools_free(engine)
    assert drafted[1] == 0 < drafted[6]


def test_sampled_outputs_follow_the_target_distribution(tmp_path_factory):
    """A chi-square test of exactness: 3,000 seeded samples of 3 tokens from an 8-token model with another random
    model's drafts (most rejected, some accepted); each position's token distribution is the target model's (HF,
    float64 over all 64 prefixes). Each test's p-value must exceed 1e-4 (the seeds are fixed, so the outcome is too;
    a right sampler fails one of the three with probability 3e-4 on a CPU that rounds differently); a sampler that
    drew a verified position from the draft fails, and so does a reference temperature 15 % off (p = 1.8e-5)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.tiny_model import TINY_LLAMA, save_random_llama

    config = LlamaConfig(**{**TINY_LLAMA, "initializer_range": 0.3}, vocab_size=8, bos_token_id=0, eos_token_id=1)
    target = save_random_llama(tmp_path_factory.mktemp("chi2_target"), config, seed=0)
    draft = save_random_llama(tmp_path_factory.mktemp("chi2_draft"), config, seed=5)
    prompt, n, temperature = [3, 5, 2, 7], 3000, 1.5
    engine = drafting(target, draft, 2, max_waiting=n)
    params = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=temperature, seed=seed) for seed in range(n)]
    outs = torch.tensor(engine.generate([prompt] * n, params))
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens
    check_pools_free(engine)

    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32, local_files_only=True).eval()
    pairs = torch.cartesian_prod(torch.arange(8), torch.arange(8))
    with torch.inference_mode():
        logits = hf(torch.cat([torch.tensor([prompt] * 64), pairs], dim=1)).logits.double() / temperature
    probs = logits.softmax(-1)  # [64, 6, 8]: row (t1, t2); position 3 predicts t1, 4 t2 given t1, 5 t3 given both
    p1 = probs[0, 3]
    p12 = p1[:, None] * probs[::8, 4]  # [t1, t2]
    p3 = (p12.reshape(64, 1) * probs[:, 5]).sum(0)
    for position, expected in enumerate((p1, p12.sum(0), p3)):
        counts = torch.bincount(outs[:, position], minlength=8).double()
        e = n * expected
        chi2 = ((counts - e) ** 2 / e).sum()
        p_value = torch.special.gammaincc(torch.tensor(7 / 2, dtype=torch.float64), chi2 / 2).item()
        assert p_value > 1e-4, (position, counts.tolist(), e.tolist(), p_value)


@pytest.mark.parametrize(("settings", "words"), [
    (dict(speculative="draft"), "draft_model: set it"),
    (dict(speculative="ngram", draft_model="/somewhere"), "draft_model: set it"),
    (dict(speculative="ngram", speculative_max_batch=0), "speculative_max_batch: must be >= 1"),
])
def test_draft_settings_are_refused_by_name(tiny_model_dir, settings, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig.create(model=str(tiny_model_dir), **settings)


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_model_dir, random_llama_dir):
    with pytest.raises(ValueError, match="draft_model: its vocabulary has 1000 tokens, the model's 49152"):
        drafting(tiny_model_dir, random_llama_dir)


def test_served_with_a_draft_model(tmp_path_factory, tiny_model_dir):
    """config.pbtxt's `speculative: draft` with `draft_model`: the text HF's greedy ids decode to."""
    from backend.serving.detokenize import decode_text
    from backend.serving.tokenizer import encode, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    prompt = "The quick brown fox"
    expected = hf_greedy(tiny_model_dir, [encode(tokenizer, prompt, False)], [24])[0]
    settings = {"speculative": "draft", "draft_model": str(tiny_model_dir), "num_speculative_tokens": "4",
                "kv_cache_memory_gb": "0.05"}
    with start_server(tmp_path_factory.mktemp("repo_draft"), tiny_model_dir, settings) as srv:
        srv.wait_ready(300)
        with LLMClient(srv.url_grpc, "llm") as client:
            text = client.generate(prompt, max_tokens=24, ignore_eos=True, stream=True).text
    assert text == decode_text(tokenizer, expected)
