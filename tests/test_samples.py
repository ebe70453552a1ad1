"""n samples of one request (OpenAI's n, tensorrtllm_backend's num_return_sequences): the samples share the
prompt's KV blocks (computed once), each has its own sampling state, sample i of a seeded request is that request
alone with seed + i, and cancelling the request ends all of them with their KV freed."""

from __future__ import annotations

import pytest

from backend.engine import EngineConfig, LLMEngine
from backend.engine.errors import InvalidRequestError
from backend.engine.sampling import MAX_SAMPLES, SamplingParams
from backend.engine.sequence import FinishReason

PROMPT = list(range(200, 264))  # 4 full blocks of 16


@pytest.fixture
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig.create(model=str(tiny_model_dir), num_kv_blocks=256))


def drain(engine: LLMEngine) -> dict[tuple[str, int], tuple[list[int], str | None]]:
    """Each (request, sample)'s tokens and finish reason; checks exactly one request_finished per request."""
    got: dict[tuple[str, int], tuple[list[int], str | None]] = {}
    ended: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens, _ = got.get((out.request_id, out.index), ([], None))
            got[out.request_id, out.index] = (tokens + out.new_token_ids, out.finish_reason)
            ended += [out.request_id] if out.request_finished else []
    assert sorted(ended) == sorted({rid for rid, _ in got}), ended
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return got


def test_four_samples_differ_repeat_with_the_seed_and_each_is_its_seed_alone(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=4, ignore_eos=True)
    engine.add_request("a", PROMPT, params)
    first = drain(engine)
    assert sorted(first) == [("a", i) for i in range(4)]
    assert len({tuple(tokens) for tokens, _ in first.values()}) == 4  # distinct at temperature 1
    engine.add_request("b", PROMPT, params)
    again = drain(engine)
    assert [again["b", i] for i in range(4)] == [first["a", i] for i in range(4)]
    for i in range(4):  # vLLM's rule: sample i is the request alone with seed + i
        engine.add_request(f"alone{i}", PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=7 + i,
                                                               ignore_eos=True))
        assert drain(engine)[f"alone{i}", 0] == first["a", i]


def test_the_prompt_is_computed_once(engine):
    """The first sample prefills the prompt; the others start once it has, taking its full blocks from the prefix
    cache: 3 of 4 samples find 48 of the 64 prompt tokens cached (the last block is never a hit: at least one
    token is computed for its logits)."""
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=4, n=4, ignore_eos=True))
    samples = [engine.requests[f"a/{i}"] for i in range(4)]
    drain(engine)
    assert [s.num_cached_tokens for s in samples] == [0, 48, 48, 48]
    assert engine.kv.stats.hit_tokens == 3 * 48


def test_greedy_samples_are_the_greedy_output(engine):
    engine.add_request("one", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    alone = drain(engine)["one", 0]
    engine.add_request("two", PROMPT, SamplingParams(max_tokens=8, n=2, ignore_eos=True))
    got = drain(engine)
    assert got["two", 0] == got["two", 1] == alone


def test_cancelling_ends_every_sample_and_frees_their_blocks(engine):
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=50, n=3, temperature=1.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.has_request("a") and engine.kv.num_used_blocks > 0
    engine.abort("a")
    finals = [o for o in engine.step() if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2] and {o.finish_reason for o in finals} == {"cancelled"}
    assert [o.request_finished for o in finals].count(True) == 1
    assert not engine.has_request("a") and engine.kv.num_used_blocks == 0


def test_each_sample_ends_alone_and_the_request_with_the_last(engine):
    """A sample that stops early (here: ended by its front door, as a stop string does) leaves the others running."""
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=1, ignore_eos=True))
    first = sum(len(o.new_token_ids) for o in engine.step() if o.index == 0)
    early = engine.finish(engine.sample_id("a", 1), FinishReason.STOP)
    assert (early.index, early.finished, early.request_finished) == (1, True, False)
    got = drain(engine)
    assert first + len(got["a", 0][0]) == 6 and got["a", 0][1] == "length"


@pytest.mark.parametrize("n", [0, MAX_SAMPLES + 1])
def test_n_out_of_range_is_refused_by_name(engine, n):
    with pytest.raises(InvalidRequestError, match=rf"^n: must be in \[1, {MAX_SAMPLES}\]"):
        engine.add_request("bad", PROMPT, SamplingParams(n=n))
    assert not engine.has_request("bad")
