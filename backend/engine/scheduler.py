"""Iteration-level scheduler: one ragged batch per step under a token budget.

Every step, each running sequence's computed tokens catch up with its known tokens (one token for a
decode, a chunk for an unfinished prefill), running sequences first; then waiting sequences are
admitted with their first prefill chunk while budget, `max_num_seqs` and KV blocks allow. Prefill
chunks and decode tokens share the batch (chunked prefill).

Admission policies, as in TensorRT-LLM's `batch_scheduler_policy`:
- `max_utilization`: admit while the next chunk's blocks exist; when a running sequence cannot grow,
  preempt by recompute the lowest-priority, newest running sequence.
- `guaranteed_no_evict`: admit only while every admitted sequence can reach its maximum length
  (prompt + max_tokens) in the pool; nothing is ever preempted.

Priority: lower value is served first; within a class the tenant with the fewest running sequences is admitted
first (fair share by default), then the one with the fewest waiting, then FCFS. Ordering alone is not enough once
one tenant's flood fills `max_num_seqs`: a late tenant then waits for one of the flood's sequences to end
(measured: 66x its solo TTFT at p99). So under `max_utilization`, when the batch is full and the next waiting
sequence's tenant runs fewer than its fair share (max_num_seqs over the tenants with work), the newest sequence of
the tenant furthest over its share is preempted (recompute; its full blocks stay in the prefix cache) to make
room. Running sequences are scheduled lightest tenant first, so when the pool runs short of blocks the victim (the
tail) is also the heaviest tenant's newest sequence. A light sequence (`_heavier_tenant`: its tenant runs below
its share beside a tenant with work above it, or runs nothing beside one that runs) runs its first chunk in a step
of its own, ahead of the decodes (as SGLang and vLLM V0 schedule every prefill): in a mixed step it would wait for
the flood's whole decode batch (measured on 2 cores beside 48 streams: 178 ms in the mixed step, 82 ms alone). At
most every other step is such a step, so arrivals cannot starve the running batch. Such a first chunk may also cut
into the step in flight (`schedule_cut_in`, between the model's layers, when the serving loop sees it arrive): the
step it would otherwise wait for takes 3x its whole solo TTFT beside a flood. Tenant quotas cap a tenant's running
sequences and KV blocks; a tenant over its block quota preempts its own newest sequence.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from dataclasses import dataclass

from backend.engine.config import SchedulerConfig, TenantQuota
from backend.engine.errors import QueueFullError
from backend.engine.kv_cache import KVCacheManager
from backend.engine.sampling import Sampled
from backend.engine.sequence import FinishReason, Sequence, Status
from backend.engine.speculation import AUTO_MAX_BATCH, Drafter, NgramDrafter, eligible, guide_drafts


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]]  # (sequence, tokens to compute this step), in batch order
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), drafter: Drafter | None = None):
        self.config = config
        self.drafter = drafter or NgramDrafter()
        self.kv = kv
        self.max_model_len = max_model_len  # the config's, resolved against the model and the pool
        self.eos_token_ids = eos_token_ids
        self.waiting: list[Sequence] = []  # sorted by Sequence.order_key
        self.running: list[Sequence] = []  # sorted at each step: priority, lightest tenant, arrival
        self.num_preemptions = 0
        self._last_step_alone = False  # the last step ran only first chunks admitted below their share

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; refused when more than `max_waiting` would wait beyond the free running slots."""
        free_slots = max(0, self.config.max_num_seqs - len(self.running))
        if len(self.waiting) >= self.config.max_waiting + free_slots:
            raise QueueFullError(f"overloaded: {len(self.waiting)} requests waiting (max_waiting "
                                 f"{self.config.max_waiting} beyond {free_slots} free running slots)")
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.order_key)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence: out of the queues, its blocks freed."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        self.drafter.release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- quotas ---------------------------------------------------------------------------------

    def quota(self, tenant: str | None) -> TenantQuota | None:
        if tenant is None:
            return None
        return self.config.tenant_quotas.get(tenant, self.config.tenant_quotas.get("*"))

    def _tenant_running(self, tenant: str) -> list[Sequence]:
        return [s for s in self.running if s.tenant == tenant]

    def _within_block_quota(self, seq: Sequence, num_new_tokens: int) -> bool:
        quota = self.quota(seq.tenant)
        if quota is None or quota.max_blocks is None:
            return True
        used = sum(len(s.block_ids) for s in self._tenant_running(seq.tenant) if s is not seq)
        return used + self.kv.blocks_for(seq.num_computed_tokens + num_new_tokens) <= quota.max_blocks

    def _at_running_quota(self, seq: Sequence) -> bool:
        quota = self.quota(seq.tenant)
        return (quota is not None and quota.max_running is not None
                and len(self._tenant_running(seq.tenant)) >= quota.max_running)

    # -- policy ---------------------------------------------------------------------------------

    def _next_waiting(self) -> int | None:
        """Which waiting sequence to admit next: the best priority class first; within it, the tenant with the
        fewest running sequences (requests without a tenant are one tenant), then the one with the fewest waiting,
        then FCFS. So a tenant that floods the queue shares the batch with the others instead of filling it, with
        no quota set, and a light tenant goes before a burst that arrived with it. Sequences that may not start yet
        wait on (a guide still compiling, a sample whose prompt another sample is computing); None when no other
        waits."""
        ready = [(i, s) for i, s in enumerate(self.waiting) if s.may_start]
        if not ready:
            return None
        best = ready[0][1].priority
        running = Counter(s.tenant for s in self.running)
        waiting = Counter(s.tenant for s in self.waiting)
        same_class = itertools.takewhile(lambda item: item[1].priority == best, ready)
        return min(same_class, key=lambda item: (running[item[1].tenant], waiting[item[1].tenant], item[0]))[0]

    def _max_blocks(self, seq: Sequence) -> int:
        max_len = min(len(seq.prompt_token_ids) + seq.params.max_tokens, self.max_model_len)
        return self.kv.blocks_for(max_len)

    def _fits_guarantee(self, seq: Sequence) -> bool:
        reserved = sum(self._max_blocks(s) for s in self.running)
        return reserved + self._max_blocks(seq) <= self.kv.num_blocks

    def _heavier_tenant(self, seq: Sequence) -> tuple[str | None] | None:
        """(the other tenant with the most work, running and waiting,) when `seq` is light beside it and within its
        tenant's quotas: the tenant `seq` may take a slot and blocks from (it may be None: requests without one);
        None when there is no such tenant. Light: `seq`'s tenant runs below its fair share (max_num_seqs over the
        tenants with work), and the other's work is above that share (a flood; waiting work counts, so a flood
        that has just arrived is as heavy as one that runs), or `seq`'s tenant runs nothing and has less work
        than the other, which runs something (measured: a flood whose streams all end at once sends its next
        requests over ~0.2 s, and an arrival in between shared a step with their prefills, 487 ms, 7x its solo
        TTFT)."""
        if self._at_running_quota(seq) or not self._within_block_quota(seq, seq.num_tokens):
            return None
        running = Counter(s.tenant for s in self.running)
        work = running + Counter(s.tenant for s in self.waiting)
        share = self.config.max_num_seqs / len(work)
        heavy, count = max(((t, n) for t, n in work.items() if t != seq.tenant), key=lambda item: item[1],
                           default=(None, 0))
        mine = running[seq.tenant]
        if not count or mine + 1 > share:
            return None
        idle_beside_work = mine == 0 and work[seq.tenant] < count and running[heavy] > 0
        return (heavy,) if count > share or idle_beside_work else None

    def _admit_below_share(self, budget: int, scheduled: list[tuple[Sequence, int]],
                           preempted: list[Sequence]) -> int:
        """Before anything else this step, admit waiting sequences whose tenant runs below its fair share while
        another runs above it. Tokens scheduled."""
        used = 0
        while used < budget and self.config.admission_policy == "max_utilization" \
                and (i := self._next_waiting()) is not None:
            seq = self.waiting[i]
            if (heavier := self._heavier_tenant(seq)) is None:
                break
            if not (n := self._take_room(seq, heavier[0], budget - used, preempted)):
                break
            scheduled.append((seq, n))
            used += n
        return used

    def _take_room(self, seq: Sequence, heavy: str | None, budget: int, preempted: list[Sequence]) -> int:
        """Admit `seq`, preempting `heavy`'s newest sequences (of no better priority) for the slot and the blocks
        while `heavy` keeps more running than `seq`'s tenant; the first chunk's size, 0 if it did not fit."""
        cached = self.kv.find_cached_prefix(seq)
        while True:
            if len(self.running) < self.config.max_num_seqs and (n := self._allocate_first_chunk(seq, budget, cached)):
                return n
            running = Counter(s.tenant for s in self.running)
            victims = [s for s in self.running if s.tenant == heavy and s.priority >= seq.priority]
            if not victims or running[heavy] <= running[seq.tenant] + 1:
                return 0
            victim = max(victims, key=Sequence.order_key)
            self._preempt(victim)
            preempted.append(victim)

    def _allocate_first_chunk(self, seq: Sequence, budget: int, cached: list[int]) -> int:
        """Move a waiting sequence to running with the blocks of its first chunk after its `cached` prefix
        blocks; the chunk's size, 0 when the pool is short."""
        n = min(seq.num_tokens - len(cached) * self.kv.block_size, budget)
        if not self.kv.allocate(seq, n, cached):
            return 0
        seq.num_cached_tokens = len(cached) * self.kv.block_size
        seq.num_computed_tokens += seq.num_cached_tokens
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return n

    def _draft_room(self, seq: Sequence, budget: int) -> int:
        """How many speculative tokens a decode of an eligible sequence may verify (speculation.py): at most
        num_speculative_tokens, within the step's budget, max_tokens and the context length."""
        if seq.num_uncomputed != 1 or not eligible(seq):
            return 0
        return max(0, min(self.config.num_speculative_tokens, budget - 1,
                          seq.params.max_tokens - len(seq.output_token_ids) - 1,
                          self.max_model_len - seq.num_tokens - 1))

    def _drafts(self, fresh: set[int], budget: int) -> dict[int, list[int]]:
        """id(sequence) -> its drafts this step, for the running decodes that may speculate (one batched call);
        none while more than speculative_max_batch sequences run."""
        config = self.config
        if config.speculative == "none" or len(self.running) > (config.speculative_max_batch
                                                                 or AUTO_MAX_BATCH[config.speculative]):
            return {}
        rooms = [(seq, room) for seq in self.running if id(seq) not in fresh
                 and (room := self._draft_room(seq, budget)) > 0]
        return {id(seq): guide_drafts(seq, drafts)
                for (seq, _), drafts in zip(rooms, self.drafter.propose(rooms) if rooms else [])}

    def _preempt(self, seq: Sequence) -> None:
        seq.draft_token_ids = []
        self.running.remove(seq)
        self.kv.free(seq)
        self.drafter.release(seq)
        seq.num_computed_tokens = 0
        self.num_preemptions += 1
        self._enqueue(seq)

    # -- the step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []

        budget -= self._admit_below_share(budget, scheduled, preempted)
        if scheduled and not self._last_step_alone:  # first chunks below their share run alone (module docstring)
            self._last_step_alone = True
            return SchedulerOutput(scheduled, preempted)
        self._last_step_alone = False
        fresh = {id(seq) for seq, _ in scheduled}
        num_share_victims = len(preempted)
        tenant_load = Counter(s.tenant for s in self.running)  # light tenants first, so victims come from heavy ones
        self.running.sort(key=lambda s: (s.priority, tenant_load[s.tenant], s.arrival_index))
        drafts = self._drafts(fresh, budget)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if id(seq) in fresh:
                i += 1
                continue
            seq.draft_token_ids = drafts.get(id(seq), [])[:max(0, budget - 1)]
            n = min(seq.num_uncomputed, budget) + len(seq.draft_token_ids)
            quota_ok = self._within_block_quota(seq, n)
            if quota_ok and self.kv.allocate(seq, n):
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            # Short of blocks: preempt from the tail (lowest priority, heaviest tenant, newest), within the
            # tenant when it is the tenant's quota that is short; never one scheduled this step (a sequence
            # admitted below its share may sort behind, with a worse priority).
            candidates = [s for s in self.running[i:] if id(s) not in fresh and (quota_ok or s.tenant == seq.tenant)]
            victim = candidates[-1]
            self._preempt(victim)
            preempted.append(victim)

        if len(preempted) > num_share_victims:  # the pool is short: admitting now would only preempt again
            return SchedulerOutput(scheduled, preempted)

        skipped: list[Sequence] = []
        while budget > 0 and len(self.running) < self.config.max_num_seqs and (i := self._next_waiting()) is not None:
            seq = self.waiting[i]
            if self._at_running_quota(seq):
                skipped.append(self.waiting.pop(i))
                continue
            if self.config.admission_policy == "guaranteed_no_evict" and not self._fits_guarantee(seq):
                break
            cached = self.kv.find_cached_prefix(seq)
            cached_tokens = len(cached) * self.kv.block_size
            if not self._within_block_quota(seq, min(seq.num_tokens - cached_tokens, budget) + cached_tokens):
                skipped.append(self.waiting.pop(i))
                continue
            if not (n := self._allocate_first_chunk(seq, budget, cached)):
                break
            scheduled.append((seq, n))
            budget -= n
        for seq in skipped:
            bisect.insort(self.waiting, seq, key=Sequence.order_key)
        return SchedulerOutput(scheduled, preempted)

    def schedule_cut_in(self) -> SchedulerOutput | None:
        """While a step is in flight, a step of its own for the first chunk of the next waiting sequence when it
        is light (`_heavier_tenant`, as `_admit_below_share` would admit it); None when there is none. The
        running sequences are mid-step, so nothing is preempted: the batch needs a free slot and the pool free
        blocks. The step after counts as following an alone step, so one cut-in per step at most."""
        if (self._last_step_alone or len(self.running) >= self.config.max_num_seqs
                or self.config.admission_policy != "max_utilization" or (i := self._next_waiting()) is None):
            return None
        seq = self.waiting[i]
        if self._heavier_tenant(seq) is None:
            return None
        n = self._allocate_first_chunk(seq, self.config.max_num_batched_tokens, self.kv.find_cached_prefix(seq))
        if not n:
            return None
        self._last_step_alone = True
        return SchedulerOutput([(seq, n)], [])

    # -- after the step ---------------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled: dict[int, list[Sampled]]
                           ) -> list[tuple[Sequence, list[Sampled]]]:
        """The one place that changes state after a forward: `sampled` (batch index -> the step's tokens: the
        sampler's pick, or a speculating sequence's accepted drafts and the token after them) are appended up to
        the first that finishes it; each scheduled sequence's computed tokens advance by what the forward computed,
        less its rejected drafts (whose blocks are released); its newly full blocks enter the prefix cache;
        finished sequences are freed. Returns the sequences that got tokens, with them, in batch order."""
        appended = []
        for i, (seq, n) in enumerate(output.scheduled):
            picks, drafts = sampled.get(i, []), seq.draft_token_ids
            seq.draft_token_ids = []
            seq.num_computed_tokens += n - (len(drafts) - len(picks) + 1 if drafts else 0)
            reason, kept = None, []
            for pick in picks:
                seq.output_token_ids.append(pick.token)
                kept.append(pick)
                if seq.sampling_state.grammar is not None:
                    seq.sampling_state.grammar.accept(pick.token)
                if (reason := self._finish_reason(seq, pick.token)) is not None:
                    break
            if drafts:  # a stop among the accepted drafts leaves fewer tokens than were computed
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                self.kv.trim(seq)
            self.kv.cache_computed_blocks(seq)
            if reason is not None:
                self.finish(seq, reason)
            if kept:
                appended.append((seq, kept))
        return appended

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        n = len(seq.output_token_ids)
        if n >= p.min_tokens and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            return FinishReason.STOP
        if seq.sampling_state.grammar is not None and seq.sampling_state.grammar.terminated:
            return FinishReason.STOP  # on the model's EOS, where the request has no stop id (guided_decoding.py)
        if n >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
