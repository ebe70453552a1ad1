"""Each step's load as Dynamo's forward-pass metrics count it (backend/engine/step_load.py): prefill chunks and the
KV they read, decodes and their context, and what waits, new or preempted."""

from __future__ import annotations

from backend.engine import EngineConfig, LLMEngine
from backend.engine.sampling import SamplingParams


def test_a_chunked_prefill_then_decodes_and_a_queue(tiny_model_dir):
    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir), max_num_seqs=1, max_num_batched_tokens=16,
                                           enable_prefix_caching=False))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(100, 140)), params)  # 40 tokens: chunks of 16, 16, 8
    engine.add_request("b", list(range(200, 230)), params)  # waits: one running sequence at most
    loads = []
    while engine.has_unfinished():
        engine.step()
        loads.append(engine.stats().last_step)
    first, second, third, decode = loads[:4]
    assert (first.prefill_requests, first.prefill_tokens, first.prefill_kv_tokens) == (1, 16, 0)
    assert (second.prefill_tokens, second.prefill_kv_tokens, third.prefill_tokens, third.prefill_kv_tokens) == \
        (16, 16, 8, 32)
    assert (first.queued_prefill_requests, first.queued_prefill_tokens) == (1, 30)
    assert first.decode_requests == 0 and first.queued_decode_requests == 0
    # the prefill's last chunk samples token 1; each decode step computes the last token with the rest as context
    assert (decode.prefill_requests, decode.decode_requests, decode.decode_kv_tokens) == (0, 1, 41)
    last = loads[-1]  # b's last decode, nothing waits
    assert (last.decode_requests, last.decode_kv_tokens, last.queued_prefill_requests) == (1, 32, 0)
