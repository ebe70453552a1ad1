"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob given the tokens before it, and the N
likeliest there, equal HF transformers' log_softmax of one forward over the prompt (float32), whatever the chunking,
a prefix-cache hit, a preemption, n samples or the runtime (PyTorch, ONNX Runtime); the generated tokens and the
other requests of the batch are unchanged by asking for them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from backend.engine import EngineConfig, LLMEngine, RequestOutput
from backend.engine.errors import InvalidRequestError
from backend.engine.sampling import SamplingParams
from build_engine.export_onnx import OPSETS, export_engine_dir
from tests.test_logprobs import run, tokens

PROMPT = list(range(100, 140))  # 40 tokens: three chunks under a 16-token budget
N = 5
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_model_dir) -> torch.Tensor:
    """[len(PROMPT) - 1, vocab]: HF's log_softmax at positions 0 .. P-2, which predict prompt tokens 1 .. P-1."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0, :-1].float(), dim=-1)


def engine_for(model_dir, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig.create(model=str(model_dir), max_num_batched_tokens=16, **settings))


def assert_prompt_logprobs_are_hfs(outputs: list[RequestOutput], reference: torch.Tensor, n: int,
                                   tol: float = TOL) -> None:
    """Only the output with the first token carries them: one entry per prompt token after the first."""
    carried = [out.prompt_logprobs for out in outputs if out.prompt_logprobs is not None]
    assert len(carried) == 1 and outputs[0].prompt_logprobs is carried[0]
    entries = carried[0]
    assert [e.token for e in entries] == PROMPT[1:]
    got = torch.tensor([e.logprob for e in entries])
    torch.testing.assert_close(got, reference[torch.arange(len(entries)), torch.tensor(PROMPT[1:])], atol=tol, rtol=0)
    for position, (entry, ref) in enumerate(zip(entries, reference), start=1):
        top_ids, top_values = [t for t, _ in entry.top_logprobs], torch.tensor([v for _, v in entry.top_logprobs])
        assert len(top_ids) == n, position
        if n:
            torch.testing.assert_close(top_values, torch.topk(ref, n).values, atol=tol, rtol=0)
            torch.testing.assert_close(ref[top_ids], top_values, atol=tol, rtol=0)


def test_chunked_prompt_logprobs_are_hfs_and_nothing_else_changes(tiny_model_dir, hf_prompt_logprobs):
    engine = engine_for(tiny_model_dir)
    asking = SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=N)
    plain = SamplingParams(max_tokens=5, ignore_eos=True)
    other = PROMPT[7:] + [3, 4]
    alone = {rid: tokens(outs) for rid, outs in run(engine, {"a": (PROMPT, plain), "b": (other, plain)}).items()}
    together = run(engine_for(tiny_model_dir), {"a": (PROMPT, asking), "b": (other, plain)})
    assert_prompt_logprobs_are_hfs(together["a"], hf_prompt_logprobs, N)
    assert {rid: tokens(outs) for rid, outs in together.items()} == alone
    assert all(out.prompt_logprobs is None for out in together["b"])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_model_dir, hf_prompt_logprobs):
    engine = engine_for(tiny_model_dir)
    run(engine, {"warm": (PROMPT, SamplingParams(max_tokens=2))})
    outputs = run(engine, {"again": (PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=0))})["again"]
    assert outputs[0].num_cached_tokens == 0
    assert_prompt_logprobs_are_hfs(outputs, hf_prompt_logprobs, 0)
    plain = run(engine, {"plain": (PROMPT, SamplingParams(max_tokens=2))})["plain"]
    assert plain[0].num_cached_tokens > 0, "a request that does not ask still takes the cached prefix"


def test_a_preempted_prefill_reports_each_prompt_logprob_once(tiny_model_dir, hf_prompt_logprobs):
    engine = engine_for(tiny_model_dir)
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2))
    outputs = engine.step()  # the first 16-token chunk
    seq = engine.requests["p"]
    assert len(seq.prompt_logprobs) == 16 and outputs == []
    engine.scheduler._preempt(seq)  # as a pool short of blocks does: recompute from the start
    while engine.has_unfinished():
        outputs += engine.step()
    assert_prompt_logprobs_are_hfs(outputs, hf_prompt_logprobs, 2)
    assert engine.scheduler.num_preemptions == 1


def test_n_samples_report_the_prompt_logprobs_once(tiny_model_dir, hf_prompt_logprobs):
    engine = engine_for(tiny_model_dir)
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=3, n=3, prompt_logprobs=1)
    [outputs] = run(engine, {"r": (PROMPT, params)}).values()
    by_sample = {i: [o for o in outputs if o.index == i] for i in range(3)}
    assert_prompt_logprobs_are_hfs(by_sample[0], hf_prompt_logprobs, 1)
    assert all(o.prompt_logprobs is None for i in (1, 2) for o in by_sample[i])
    assert all(by_sample[i][0].num_cached_tokens > 0 for i in (1, 2)), "the other samples take the prompt's blocks"


def test_a_one_token_prompt_has_no_prompt_logprobs(tiny_model_dir):
    [outputs] = run(engine_for(tiny_model_dir), {"one": ([7], SamplingParams(max_tokens=2, prompt_logprobs=3))}).values()
    assert outputs[0].prompt_logprobs == []


@pytest.mark.parametrize("n", [-1, 21])
def test_prompt_logprobs_out_of_range_are_refused_by_name(tiny_model_dir, n):
    engine = engine_for(tiny_model_dir)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", PROMPT, SamplingParams(prompt_logprobs=n))
    assert err.value.field == "prompt_logprobs" and "[0, 20]" in str(err.value)
    assert run(engine, {"next": (PROMPT, SamplingParams(max_tokens=1))})["next"][-1].finished


def test_onnx_runtime_gives_the_same_prompt_logprobs(tiny_model_dir, hf_prompt_logprobs, tmp_path):
    """The exported graph returns logits for every token `logits_index` names, as the PyTorch model does. ONNX
    Runtime's float32 GEMMs sum in another order than PyTorch's: up to 1.5e-4 apart from HF here, so 1e-3."""
    export_engine_dir(tiny_model_dir, tmp_path / "engine", "float32", OPSETS["onnxruntime"])
    engine = engine_for(tiny_model_dir, runtime="onnxruntime", engine_dir=str(tmp_path / "engine"))
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=N)
    outputs = run(engine, {"x": (PROMPT, params)})["x"]
    assert_prompt_logprobs_are_hfs(outputs, hf_prompt_logprobs, N, tol=1e-3)
    assert tokens(outputs) == tokens(run(engine_for(tiny_model_dir), {"x": (PROMPT, params)})["x"])
