"""Request state as the engine sees it.

One rule drives scheduling (as in vLLM v1): a sequence knows `num_tokens` tokens (prompt + output)
and has KV for `num_computed_tokens` of them; each step computes some of the difference, and when
it catches up, the sampler appends one more token. Preemption by recompute only resets
`num_computed_tokens` to 0 (and frees the blocks); the output tokens are kept.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.engine.sampling import Sampled, SamplingParams, SamplingState

if TYPE_CHECKING:
    from backend.engine.lora import LoraAdapter


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context
    CANCELLED = "cancelled"  # aborted by the client
    TIMEOUT = "timeout"  # past the request's deadline (its timeout_ms)
    ERROR = "error"  # failed after admission (a guide that does not compile or allows no token): see `error`


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int  # global FCFS order; preemption keeps it, so a preempted sequence resumes first
    priority: int = 0  # lower value = served first (vLLM's convention)
    tenant: str | None = None
    cache_salt: str | None = None  # in its first block's hash: only sequences with the same salt share KV blocks
    lora: LoraAdapter | None = None  # the adapter its tokens run with (its digest is in its block hashes)
    sample_of: str | None = None  # the request's id when it has n > 1 samples (this one's id is `<that>/<index>`)
    index: int = 0  # which sample of its request
    prefill_leader: "Sequence | None" = None  # the sample that computes the shared prompt first (n > 1)
    sampling_state: SamplingState = field(default_factory=SamplingState)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at (the last) admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks, in order
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: Exception | None = None  # why it ended, with FinishReason.ERROR
    prompt_logprobs: list[Sampled] = field(default_factory=list)  # of prompt tokens 1, 2, ... (params.prompt_logprobs)
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens scheduled after its own this step

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asks for its prompt's logprobs and some are still to compute: then it computes its whole prompt (no
        prefix-cache hit) and every token of its prompt chunks gets logits."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    @property
    def may_start(self) -> bool:
        """Its guide, if any, has compiled, and the sample that prefills its request's prompt (n > 1) has done so
        (or ended): this one then takes the prompt's full blocks from the prefix cache."""
        lead = self.prefill_leader
        return self.sampling_state.ready and (lead is None or lead.status is Status.FINISHED
                                              or lead.num_computed_tokens >= len(lead.prompt_token_ids))

    def order_key(self) -> tuple[int, int]:
        """Scheduling order: priority class first, then arrival (FCFS within a class)."""
        return (self.priority, self.arrival_index)
