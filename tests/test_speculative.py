"""Speculative decoding with n-gram drafts (backend/engine/speculation.py): greedy output token for token equal to
the output without speculation and to HF, for k in {1, 3, 5}, with drafts accepted; seeded sampled output the same
with speculation (n-gram and a draft model) as without; a stop id or max_tokens inside
an accepted run ends it where it would end without; penalties, bad words, min_tokens, logprobs and a guide's mask per
verified position;
the prefix cache holds only accepted tokens; every block free after; the counters through a real server; the same
greedy output on the 8-bit KV cache with and without speculation.

SmolLM2 (real weights): a random tiny model's greedy output never repeats, so no draft would ever be accepted."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.speculation import accepted_tokens, propose_ngram
from backend.serving.detokenize import decode_text
from backend.serving.tokenizer import encode, load_tokenizer
from client.client import LLMClient
from tests.conftest import start_server
from tests.reference import hf_greedy

TEXTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
         "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
         "List the numbers from 1 to 30: 1, 2, 3, 4,"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    tokenizer = load_tokenizer(smollm2_dir)
    return [encode(tokenizer, t, False) for t in TEXTS]  # as the llm tokenizes text_input


@pytest.fixture(scope="module")
def plain(smollm2_dir, prompts) -> list[list[int]]:
    """The engine's greedy outputs without speculation."""
    return LLMEngine(EngineConfig.create(model=str(smollm2_dir))).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


def speculating(model_dir, k: int = 3, **settings) -> LLMEngine:
    """Drafting at every batch size (speculative_max_batch 64: the default drafts only for a sequence alone)."""
    return LLMEngine(EngineConfig.create(model=str(model_dir), speculative="ngram", num_speculative_tokens=k,
                                         **{"speculative_max_batch": 64, **settings}))


def test_propose_and_accept():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # the last 3 tokens seen before, and what followed
    assert propose_ngram([1, 2, 3, 9, 5, 1, 2, 3, 7, 3], 2) == [7, 3]  # the most recent earlier "3"
    assert propose_ngram([4, 5, 6], 3) == [] and propose_ngram([4], 3) == []
    # the sampler's picks at each verified position; seq 0: drafts 7, 8, 9 -> 7, 8 accepted, then 2
    assert accepted_tokens([7, 8, 2, 4, 5, 5, 6], [[7, 8, 9], [5, 5]]) == [[7, 8, 2], [5, 5, 6]]


def test_greedy_equals_without_speculation_on_an_int8_kv_cache(smollm2_dir, prompts):
    """Speculation must not change outputs on the 8-bit KV cache either (a verified draft's K/V rounded as a decoded
    token's would be, its attention computed as its decode's: paged_attention.cpp). On an AVX2 Zen 3 the two parted
    at a near-tie while verified tokens attended in a prefill chunk's tiles (2026-11-28). Both engines on one GEMM
    tactic whose sums do not depend on the thread count or the rows beside a row: `auto`'s choice, made per start and
    keyed by the threads then free, could differ between them, and MKL's sums (`aten`) depend on the row count."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    same = {"kv_cache_dtype": "int8", "gemm_backend": "f32_panels", "quantization": "none"}
    expected = LLMEngine(EngineConfig.create(model=str(smollm2_dir), **same)).generate(prompts, params)
    eng = speculating(smollm2_dir, 5, **same)
    assert eng.generate(prompts, params) == expected
    assert eng.num_accepted_tokens > 0 and eng.kv.num_used_blocks == 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_without_speculation(smollm2_dir, prompts, plain, k):
    eng = speculating(smollm2_dir, k)
    assert eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) == plain
    assert eng.num_accepted_tokens > 0 and eng.num_draft_tokens >= eng.num_accepted_tokens
    assert eng.kv.num_used_blocks == 0
    stats = eng.stats()  # by position: a draft is accepted only after the drafts before it
    assert sum(stats.drafted_by_position) == stats.num_draft_tokens and len(stats.drafted_by_position) == k
    assert sum(stats.accepted_by_position) == stats.num_accepted_tokens
    assert list(stats.accepted_by_position) == sorted(stats.accepted_by_position, reverse=True)
    assert all(a <= d for a, d in zip(stats.accepted_by_position, stats.drafted_by_position))


def test_greedy_equals_hf(smollm2_dir, prompts):
    """In float32, the weights HF's reference reads (the other tests run the default: SmolLM2's GGUF as stored)."""
    outs = speculating(smollm2_dir, 5, quantization="none").generate(prompts, SamplingParams(max_tokens=24,
                                                                                              ignore_eos=True))
    assert outs == hf_greedy(smollm2_dir, prompts, [24] * len(prompts))


def test_a_stop_id_or_max_tokens_inside_an_accepted_run(smollm2_dir, prompts, plain):
    """The numbers prompt: ", " is drafted and accepted all along; stopping on it, or at max_tokens 7, ends the output
    where it ends without speculation."""
    comma = plain[2][1]
    stop = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(comma,), min_tokens=3, ignore_eos=True)
    short = SamplingParams(max_tokens=7, ignore_eos=True)
    expected = LLMEngine(EngineConfig.create(model=str(smollm2_dir))).generate([prompts[2]] * 2, [stop, short])
    eng = speculating(smollm2_dir, 5)
    eng.add_request("stop", prompts[2], stop)
    eng.add_request("short", prompts[2], short)
    got, reasons = {"stop": [], "short": []}, {}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert [got["stop"], got["short"]] == expected and reasons == {"stop": "stop", "short": "length"}
    assert len(got["short"]) == 7 and got["stop"][-1] == comma


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_seeded_sampled_output_is_the_same_with_speculation(smollm2_dir, prompts, drafter):
    """Each verified position is drawn with the uniform of (seed, position), as without speculation: a seeded output
    is token for token the same, so its distribution is the model's (the rejection sampler for certain drafts)."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=t, top_p=top_p, seed=seed)
              for seed, (t, top_p) in enumerate([(0.3, 1.0), (0.7, 0.9), (1.0, 1.0), (1.0, 0.95), (0.6, 1.0),
                                                 (0.9, 0.8)])]
    batch = prompts * 2
    plain = LLMEngine(EngineConfig.create(model=str(smollm2_dir)))
    expected = plain.generate(batch, params)
    greedy = plain.generate(batch, [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] * len(batch))
    settings = {"draft_model": str(smollm2_dir), "draft_quantization": "int4"} if drafter == "draft" else {}
    eng = LLMEngine(EngineConfig.create(model=str(smollm2_dir), speculative=drafter, num_speculative_tokens=4,
                                        speculative_max_batch=64, **settings))
    assert eng.generate(batch, params) == expected
    assert eng.num_accepted_tokens > 0 and eng.kv.num_used_blocks == 0
    assert sum(o != g for o, g in zip(expected, greedy)) >= len(batch) // 2  # the draws left the greedy path


def drain(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    """Each request's tokens, logprobs and top logprobs, as the step outputs carry them."""
    got = {str(i): ([], [], []) for i in range(len(prompts))}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    while engine.has_unfinished():
        for out in engine.step():
            for kept, new in zip(got[out.request_id], (out.new_token_ids, out.new_logprobs, out.new_top_logprobs)):
                kept.extend(new)
    return [got[str(i)] for i in range(len(prompts))]


def test_penalties_bad_words_min_tokens_and_logprobs_apply_per_verified_position(smollm2_dir, prompts, plain):
    """Rows with penalties, bad words, a min_tokens ban or logprobs speculate too: each verified position is picked
    as without speculation (the drafts before it count as output), with the same logprobs (to float rounding: the
    verify rows' logits come from a chunk)."""
    ban = plain[2][3]
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3, logprobs=True),
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=3),
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, bad_words_ids=((ban,),)),
              SamplingParams(max_tokens=MAX_TOKENS, min_tokens=20, stop_token_ids=(plain[2][1],),
                             temperature=0.8, seed=5, presence_penalty=0.5),
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)]
    batch = [prompts[0], prompts[1], prompts[2], prompts[2], prompts[2]]
    expected = drain(LLMEngine(EngineConfig.create(model=str(smollm2_dir))), batch, params)
    eng = speculating(smollm2_dir, 3)
    got = drain(eng, batch, params)
    assert [g[0] for g in got] == [e[0] for e in expected]
    for (_, logprobs, tops), (_, want, want_tops) in zip(got, expected):
        assert logprobs == pytest.approx(want, abs=1e-4)
        assert [[t for t, _ in row] for row in tops] == [[t for t, _ in row] for row in want_tops]
    assert ban not in got[2][0] and len(got[3][0]) >= 20 and expected[4][0] == plain[2]
    assert eng.num_accepted_tokens > 0 and eng.kv.num_used_blocks == 0


def test_guided_rows_verify_each_position_under_its_own_mask(smollm2_dir):
    """A JSON schema of repeated objects (n-gram drafts hit on the repeated keys): each verified position is masked
    by the guide past the drafts before it, so greedy and seeded outputs equal those without speculation, and the
    guide's own matcher sees only accepted tokens (the outputs parse)."""
    import json

    from backend.engine.guided_decoding import Guide

    tokenizer = load_tokenizer(smollm2_dir)
    schema = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "id": {"type": "integer"}},
        "required": ["name", "id"], "additionalProperties": False}}
    prompt = encode(tokenizer, "Four users as JSON: [{\"name\": \"ann\", \"id\": 1}, ", False)
    guide = Guide("json", json.dumps(schema))
    params = [SamplingParams(max_tokens=120, guided=guide),
              SamplingParams(max_tokens=120, guided=guide, temperature=0.7, seed=3)]
    expected = LLMEngine(EngineConfig.create(model=str(smollm2_dir))).generate([prompt] * 2, params)
    eng = speculating(smollm2_dir, 4)
    got = eng.generate([prompt] * 2, params)
    assert got == expected and eng.num_accepted_tokens > 0 and eng.kv.num_used_blocks == 0
    for ids in got:
        assert len(json.loads(decode_text(tokenizer, ids))) == 4


def test_the_prefix_cache_holds_only_accepted_tokens(smollm2_dir, prompts, plain):
    """The blocks a speculating engine caches (written by verify steps that rejected drafts; a small pool makes the
    rejected slots' blocks come back to the free queue and be reused) hold, bit for bit, the K/V a plain engine
    caches for the same tokens: a verified token attends as its decode. A second run starts from them (prefix hits)
    and frees every block. Its continuation is not compared with the first run's: the 20 outputs it repeats are prompt
    tokens there, and those not taken from the cache are recomputed in prefill tiles, which round otherwise than
    their decodes did."""
    small = dict(block_size=4, num_kv_blocks=96)
    eng = speculating(smollm2_dir, 5, **small)
    reference = LLMEngine(EngineConfig.create(model=str(smollm2_dir), **small))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    first = eng.generate(prompts, params)
    assert first == plain == reference.generate(prompts, params)
    common = eng.kv.pool.cached.keys() & reference.kv.pool.cached.keys()
    assert len(common) > 20
    for block_hash in common:
        ours, theirs = eng.kv.pool.cached[block_hash], reference.kv.pool.cached[block_hash]
        assert torch.equal(eng.runner.kv_cache[:, :, ours], reference.runner.kv_cache[:, :, theirs])
    continued = [p + o[:20] for p, o in zip(prompts, first)]
    again = eng.generate(continued, SamplingParams(max_tokens=MAX_TOKENS - 20, ignore_eos=True))
    assert [len(o) for o in again] == [MAX_TOKENS - 20] * len(prompts)
    assert eng.stats().prefix_cache_hit_rate > 0 and eng.kv.num_used_blocks == 0


def test_served_with_speculation(tmp_path_factory, smollm2_dir, prompts, plain):
    """A real tritonserver with `speculative: ngram`: the same text as the engine without it, and the counters."""
    tokenizer = load_tokenizer(smollm2_dir)
    settings = {"speculative": "ngram", "num_speculative_tokens": "4", "kv_cache_memory_gb": "0.25",
                "speculative_max_batch": "8"}
    with start_server(tmp_path_factory.mktemp("repo_spec"), smollm2_dir, settings) as srv:
        srv.wait_ready(300)
        with LLMClient(srv.url_grpc, "llm") as client:
            text = client.generate(TEXTS[2], max_tokens=MAX_TOKENS, ignore_eos=True, stream=True).text
        metrics = urllib.request.urlopen(srv.url_metrics, timeout=10).read().decode()
    assert text == decode_text(tokenizer, plain[2])
    counters = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("llm_spec_")}
    assert counters["llm_spec_draft_tokens_total"] >= counters["llm_spec_accepted_tokens_total"] > 0
    first = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
             if line.startswith("llm_spec_") and 'position="1"' in line}
    assert first["llm_spec_drafted_tokens_by_position_total"] >= first["llm_spec_accepted_tokens_by_position_total"] > 0


def test_a_stop_string_inside_an_accepted_run(smollm2_dir, prompts):
    """The serving loop cuts a several-token output at the token that completes a stop string: the same tokens,
    count and finish reason as without speculation."""
    from backend.serving.engine_thread import EngineLoop, Submission
    from backend.serving.request import GenerationRequest

    tokenizer = load_tokenizer(smollm2_dir)
    results = []
    for settings in ({}, {"speculative": "ngram", "num_speculative_tokens": 5, "speculative_max_batch": 8}):
        config = EngineConfig.create(model=str(smollm2_dir), **settings)
        loop = EngineLoop(lambda: LLMEngine(config), tokenizer).start()
        got, done = [], []
        # the numbers prompt: speculation yields ", 1" in one step after " 1", "2" (the ", " completes "12,")
        request = GenerationRequest(prompts[2], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                    stream=True, stop_strings=["12,"])
        loop.submit(Submission("c", request, lambda out: (got.extend(out.new_token_ids), out.finished and
                                                          done.append((out.finish_reason, out.num_output_tokens))),
                               lambda err: done.append(err)))
        try:
            for _ in range(600):
                if done:
                    break
                __import__("time").sleep(0.1)
        finally:
            accepted = loop.engine.num_accepted_tokens
            loop.shutdown()
        results.append((got, done, accepted))
    (plain_tokens, plain_end, _), (spec_tokens, spec_end, accepted) = results
    assert spec_tokens == plain_tokens and spec_end == plain_end == [("stop", len(plain_tokens))]
    assert decode_text(tokenizer, plain_tokens).endswith("12,") and accepted > 0
