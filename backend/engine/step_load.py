"""What one step computed and what waited, counted as Dynamo's forward-pass metrics count them (its planner scales
workers on them: dynamo.common.forward_pass_metrics), so any serving door can publish them as they are."""

from __future__ import annotations

from dataclasses import dataclass

from backend.engine.sequence import Sequence


@dataclass(frozen=True)
class StepLoad:
    prefill_requests: int = 0  # scheduled sequences whose prompt is not all computed (new, or a further chunk)
    prefill_tokens: int = 0  # tokens those compute this step
    prefill_kv_tokens: int = 0  # tokens those already had KV for (prefix-cache hits, earlier chunks)
    decode_requests: int = 0
    decode_kv_tokens: int = 0  # the decoding sequences' tokens (prompt + output so far)
    queued_prefill_requests: int = 0  # waiting, never run
    queued_prefill_tokens: int = 0
    queued_decode_requests: int = 0  # waiting after a preemption (they had output)
    queued_decode_kv_tokens: int = 0


def step_load(scheduled: list[tuple[Sequence, int]], waiting: list[Sequence]) -> StepLoad:
    """`scheduled` as the scheduler returned it (before the step ran), and the sequences left waiting."""
    prefill = [(seq, n) for seq, n in scheduled if seq.num_computed_tokens < len(seq.prompt_token_ids)]
    decode = [seq for seq, n in scheduled if seq.num_computed_tokens >= len(seq.prompt_token_ids)]
    preempted = [seq for seq in waiting if seq.output_token_ids]
    fresh = [seq for seq in waiting if not seq.output_token_ids]
    return StepLoad(prefill_requests=len(prefill), prefill_tokens=sum(n for _, n in prefill),
                    prefill_kv_tokens=sum(seq.num_computed_tokens for seq, _ in prefill),
                    decode_requests=len(decode), decode_kv_tokens=sum(seq.num_tokens for seq in decode),
                    queued_prefill_requests=len(fresh),
                    queued_prefill_tokens=sum(len(seq.prompt_token_ids) for seq in fresh),
                    queued_decode_requests=len(preempted),
                    queued_decode_kv_tokens=sum(seq.num_tokens for seq in preempted))
