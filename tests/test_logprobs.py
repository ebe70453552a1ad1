"""Top logprobs (OpenAI's `top_logprobs`): each step's N likeliest tokens of the model's raw distribution equal HF
transformers' log_softmax of the same step's logits, greedy and sampled, in a batch beside rows that ask for none,
which are served as they are alone."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from backend.engine import EngineConfig, LLMEngine, RequestOutput
from backend.engine.errors import InvalidRequestError
from backend.engine.guided_decoding import Guide
from backend.engine.sampling import SamplingParams

PROMPT = list(range(100, 140))
N = 5
TOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig.create(model=str(tiny_model_dir), max_num_batched_tokens=32))


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True).eval()


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    """Every output of each request, all in flight at once."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def hf_step_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: log_softmax of HF's logits at each step, fed the prompt and the output ids so far."""
    with torch.inference_mode():
        rows = [hf(torch.tensor([prompt + output[:i]])).logits[0, -1] for i in range(len(output))]
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)


def assert_top_logprobs_are_hfs(hf, prompt: list[int], outputs: list[RequestOutput], n: int) -> None:
    ids = tokens(outputs)
    tops = [top for out in outputs for top in out.new_top_logprobs]
    logprobs = [lp for out in outputs for lp in out.new_logprobs]
    reference = hf_step_logprobs(hf, prompt, ids)
    assert len(tops) == len(ids) == len(logprobs)
    for step, (token, top, logprob, ref) in enumerate(zip(ids, tops, logprobs, reference)):
        top_ids, top_values = [t for t, _ in top], torch.tensor([v for _, v in top])
        assert len(top) == n and len(set(top_ids)) == n, step
        assert torch.all(top_values[:-1] >= top_values[1:]), f"step {step}: not likeliest first"
        torch.testing.assert_close(top_values, torch.topk(ref, n).values, atol=TOL, rtol=0)
        torch.testing.assert_close(ref[top_ids], top_values, atol=TOL, rtol=0)  # HF's N likeliest, in order
        assert abs(logprob - float(ref[token])) <= TOL, step
        if token in top_ids:
            assert logprob == dict(top)[token], step


def test_greedy_and_sampled_top_logprobs_are_hfs_and_rows_that_ask_none_are_unchanged(engine, hf):
    greedy = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=N)
    # top_k N: each drawn token is among the N likeliest of the raw distribution (no penalties)
    sampled = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=20, temperature=0.8,
                             top_k=N, seed=7)
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    other = PROMPT[5:] + [7, 8, 9]
    alone = {rid: tokens(outs) for rid, outs in run(engine, {"plain": (other, plain),
                                                               "sampled": (PROMPT, sampled)}).items()}
    together = run(engine, {"greedy": (PROMPT, greedy), "plain": (other, plain), "sampled": (PROMPT, sampled)})
    assert tokens(together["plain"]) == alone["plain"] and tokens(together["sampled"]) == alone["sampled"]
    assert all(out.new_top_logprobs == [[]] * len(out.new_token_ids) and out.new_logprobs == [None] *
               len(out.new_token_ids) for out in together["plain"])
    assert_top_logprobs_are_hfs(hf, PROMPT, together["greedy"], N)
    assert all(out.new_token_ids[0] == out.new_top_logprobs[0][0][0] for out in together["greedy"])
    assert_top_logprobs_are_hfs(hf, PROMPT, together["sampled"], 20)
    assert tokens(together["sampled"]) != tokens(together["greedy"])  # 6 draws among 5: a tie is unlikely


def test_top_logprobs_without_logprobs(engine):
    [outputs] = run(engine, {"a": (PROMPT, SamplingParams(max_tokens=3, ignore_eos=True, top_logprobs=2))}).values()
    assert [len(top) for out in outputs for top in out.new_top_logprobs] == [2, 2, 2]
    assert all(lp is None for out in outputs for lp in out.new_logprobs)


def test_a_guided_row_left_with_no_token_gets_no_logprobs(engine):
    params = SamplingParams(max_tokens=8, min_tokens=6, logprobs=True, top_logprobs=N,
                            guided=Guide("choice", '["ok"]'))
    [outputs] = run(engine, {"g": (PROMPT, params)}).values()
    final = outputs[-1]
    assert final.finish_reason == "error" and isinstance(final.error, InvalidRequestError)
    assert (final.new_token_ids, final.new_logprobs, final.new_top_logprobs) == ([], [], [])
    assert all(len(top) == N for out in outputs[:-1] for top in out.new_top_logprobs)


@pytest.mark.parametrize("n", [-1, 21])
def test_top_logprobs_out_of_range_is_refused_by_name(engine, n):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", PROMPT, SamplingParams(top_logprobs=n))
    assert err.value.field == "top_logprobs" and "[0, 20]" in str(err.value)
    assert "bad" not in engine.requests
