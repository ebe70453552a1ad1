"""Engine API behaviour: bad input, aborts at every stage, sampling options, no KV leaks."""

from __future__ import annotations

import math

import pytest

from backend.engine import EngineConfig, LLMEngine, UnknownRequestError
from backend.engine.errors import InvalidRequestError
from backend.engine.sampling import SamplingParams
from backend.engine.errors import QueueFullError

PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig.create(model=str(tiny_model_dir), max_num_batched_tokens=16, max_waiting=8, max_num_seqs=4))


def drain(engine: LLMEngine) -> dict[str, tuple[list[int], str | None]]:
    got: dict[str, tuple[list[int], str | None]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, _ = got.get(out.request_id, ([], None))
            got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
    return got


def assert_pool_free(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def greedy(engine: LLMEngine, n: int = 8, prompt: list[int] = PROMPT) -> list[int]:
    return engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(), "prompt_token_ids"),
    ([5] * 1024, SamplingParams(), "prompt_token_ids"),
    ([10 ** 6], SamplingParams(), "prompt_token_ids"),
    (PROMPT, SamplingParams(max_tokens=0), "max_tokens"),
    (PROMPT, SamplingParams(max_tokens=2000), "max_tokens"),
    (PROMPT, SamplingParams(top_p=0.0), "top_p"),
    (PROMPT, SamplingParams(temperature=-1.0), "temperature"),
    (PROMPT, SamplingParams(min_tokens=9, max_tokens=4), "min_tokens"),
    (PROMPT, SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
])
def test_bad_input_names_the_field_and_the_engine_serves_on(engine, prompt, params, field):
    before = greedy(engine)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", prompt, params)
    assert err.value.field == field and field in str(err.value)
    assert not engine.has_unfinished()
    assert greedy(engine) == before
    assert_pool_free(engine)


def test_unknown_and_duplicate_request_ids(engine):
    with pytest.raises(UnknownRequestError, match="nope"):
        engine.abort("nope")
    engine.add_request("dup", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request("dup", PROMPT, SamplingParams(max_tokens=2))
    drain(engine)
    assert_pool_free(engine)


def test_queue_bound_answers_overloaded(engine):
    for i in range(12):  # max_waiting 8 + 4 free running slots
        engine.add_request(f"q{i}", PROMPT, SamplingParams(max_tokens=1))
    with pytest.raises(QueueFullError, match="overloaded"):
        engine.add_request("q12", PROMPT, SamplingParams(max_tokens=1))
    assert len(drain(engine)) == 12
    assert_pool_free(engine)


@pytest.mark.parametrize("steps_before_abort", [0, 1, 3, 6])  # waiting, mid-prefill (40 tokens / 16), decoding
def test_abort_at_any_stage_frees_every_block_and_ends_once(engine, steps_before_abort):
    engine.add_request("victim", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("bystander", PROMPT[::-1], SamplingParams(max_tokens=6, ignore_eos=True))
    finals = []
    for _ in range(steps_before_abort):
        finals += [o for o in engine.step() if o.finished]
    engine.abort("victim")
    assert engine.kv.num_used_blocks == sum(len(s.block_ids) for s in engine.requests.values())
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert sorted((o.request_id, o.finish_reason) for o in finals) == [("bystander", "length"),
                                                                       ("victim", "cancelled")]
    assert_pool_free(engine)


def test_stop_token_ends_with_reason_stop(engine):
    ref = greedy(engine)
    out = drain_one(engine, SamplingParams(max_tokens=8, stop_token_ids=(ref[3],)))
    assert out == (ref[:ref.index(ref[3]) + 1], "stop")


def test_min_tokens_suppresses_stop_tokens(engine):
    ref = greedy(engine)
    tokens, reason = drain_one(engine, SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(ref[0],)))
    assert tokens[0] != ref[0] and len(tokens) >= 2


def test_bad_words_are_never_generated(engine):
    ref = greedy(engine)
    tokens, _ = drain_one(engine, SamplingParams(max_tokens=8, ignore_eos=True, bad_words_ids=((ref[0],),)))
    assert ref[0] not in tokens


def test_presence_penalty_prevents_repeats(engine):
    tokens, _ = drain_one(engine, SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=1e4))
    assert len(set(tokens)) == len(tokens)


def test_logprobs_are_those_of_the_chosen_tokens(engine):
    engine.add_request("lp", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True))
    logprobs = [lp for out in iter_outputs(engine) for lp in out.new_logprobs]
    assert len(logprobs) == 4 and all(lp <= 0 and math.isfinite(lp) for lp in logprobs)


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = drain_one(engine, params)[0]
    for i in range(5):
        engine.add_request(f"other{i}", PROMPT[i:], SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
    engine.add_request("seeded", PROMPT, params)
    together = drain(engine)["seeded"][0]
    assert alone == together
    other_seed = drain_one(engine, SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other_seed != alone


def iter_outputs(engine: LLMEngine):
    while engine.has_unfinished():
        yield from engine.step()


def drain_one(engine: LLMEngine, params: SamplingParams) -> tuple[list[int], str | None]:
    engine.add_request("one", PROMPT, params)
    return drain(engine)["one"]


def test_a_tenant_below_its_share_cuts_into_the_step_in_flight(tiny_model_dir):
    """b arrives while a's decode step runs: between two layers of it, b's prefill runs as a step of its own and
    yields b's first token before a's step ends; every output stays what the request gives alone."""
    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir), max_num_seqs=8, max_num_batched_tokens=512))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = {f"a{i}": PROMPT[i:] for i in range(6)} | {"b": PROMPT[3:30]}
    alone = {rid: engine.generate([prompt], params)[0] for rid, prompt in prompts.items()}
    with pytest.raises(RuntimeError, match="between the layers"):
        engine.cut_in()
    for i in range(6):
        engine.add_request(f"a{i}", prompts[f"a{i}"], params, tenant="a")
    got = {rid: out.new_token_ids for rid, out in ((o.request_id, o) for o in engine.step())}  # a's prefills
    cut_in: list = []
    calls = []

    def between_layers() -> None:
        calls.append(len(calls))
        if len(calls) == 1:  # b arrives during a's first decode step
            engine.add_request("b", prompts["b"], params, tenant="b")
        cut_in.extend(engine.cut_in())  # once per step: the later calls find nothing to run

    step = engine.step(between_layers)
    assert len(calls) == engine.model_config.num_layers - 1
    assert [(o.request_id, len(o.new_token_ids)) for o in cut_in] == [("b", 1)]
    assert sorted(o.request_id for o in step) == sorted(f"a{i}" for i in range(6))
    for out in cut_in + step:
        got[out.request_id] = got.get(out.request_id, []) + out.new_token_ids
    for rid, (tokens, _) in drain(engine).items():
        got[rid] += tokens
    assert got == alone
    assert_pool_free(engine)
