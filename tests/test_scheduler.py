"""Scheduler policies, driven without a model: the test plays the engine's part."""

import pytest

from backend.engine.kv_cache import KVCacheManager
from backend.engine.sampling import Sampled, SamplingParams
from backend.engine.config import SchedulerConfig, TenantQuota
from backend.engine.errors import QueueFullError
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import FinishReason, Sequence, Status


def seq(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0, tenant: str | None = None,
        arrival: list[int] = [0]) -> Sequence:
    arrival[0] += 1
    return Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    arrival_index=arrival[0], priority=priority, tenant=tenant)


def make(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 2048, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, block_size, enable_prefix_caching=False),
                     max_model_len)


def advance(sched: Scheduler, out) -> None:
    """What the engine does after a forward: token 7 for every sequence that caught up."""
    caught_up = {i: [Sampled(7)] for i, (s, n) in enumerate(out.scheduled) if s.num_computed_tokens + n == s.num_tokens}
    sched.update_from_output(out, caught_up)


def test_decodes_first_then_prefill_chunks_under_the_token_budget():
    sched = make(max_num_batched_tokens=10)
    a, b = seq("a", 6), seq("b", 20)
    sched.add(a)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 6)]
    advance(sched, out)
    sched.add(b)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 9)]  # chunked prefill
    advance(sched, out)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 9)]
    advance(sched, out)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 2)]


def test_max_num_seqs_bounds_the_running_set():
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(f"r{i}", 4))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_priority_classes_are_served_first_fcfs_within_a_class():
    sched = make(max_num_seqs=2)
    low, high1, high2 = seq("low", 4, priority=1), seq("high1", 4, priority=0), seq("high2", 4, priority=0)
    for s in (low, high1, high2):
        sched.add(s)
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled] == ["high1", "high2"]


def test_max_utilization_preempts_lowest_priority_newest_and_resumes_it():
    sched = make(num_blocks=6, block_size=4, admission_policy="max_utilization")
    a, b, c = seq("a", 8, priority=0), seq("b", 7, priority=1), seq("c", 7, priority=0)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()  # a: 2 blocks, c: 2 blocks, b: 2 blocks -> pool full
    assert {s.request_id for s, _ in out.scheduled} == {"a", "b", "c"}
    advance(sched, out)
    out = sched.schedule()  # a needs a 3rd block: b (lowest priority) is preempted
    assert [s.request_id for s in out.preempted] == ["b"]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.output_token_ids == [7]  # recompute keeps the output; b will recompute prompt + output
    assert sched.kv.num_used_blocks == sum(len(s.block_ids) for s in (a, c))
    sched.finish(a, FinishReason.CANCELLED)
    sched.finish(c, FinishReason.CANCELLED)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("b", 8)]


def test_guaranteed_no_evict_admits_only_what_can_finish():
    sched = make(num_blocks=6, block_size=4, admission_policy="guaranteed_no_evict")
    a, b = seq("a", 8, max_tokens=8), seq("b", 4, max_tokens=4)  # a needs 4 blocks at most, b 2
    c = seq("c", 4, max_tokens=4)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled] == ["a", "b"]
    assert c.status is Status.WAITING
    while c.status is Status.WAITING:
        advance(sched, out)
        out = sched.schedule()
        assert not out.preempted
    assert b.status is Status.FINISHED  # c got in once b's reservation was released


def test_a_flooding_tenant_shares_the_batch_with_a_late_one_without_quotas():
    sched = make(max_num_seqs=4, max_num_batched_tokens=1000)
    flood = [seq(f"a{i}", 4, tenant="a") for i in range(10)]
    for s in flood:
        sched.add(s)
    advance(sched, sched.schedule())  # a0..a3 run
    late = seq("b0", 4, tenant="b")
    sched.add(late)
    sched.finish(flood[0], FinishReason.STOP)  # one slot frees: the tenant with no running request gets it
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled if s.num_computed_tokens == 0] == ["b0"]
    sched.finish(flood[1], FinishReason.STOP)  # then the queues alternate: a (3 running) vs b (1): b's next
    sched.add(seq("b1", 4, tenant="b"))
    advance(sched, out)
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled if s.num_computed_tokens == 0] == ["b1"]


def test_a_full_batch_makes_room_for_a_tenant_below_its_share():
    sched = make(max_num_seqs=4, max_num_batched_tokens=1000)
    flood = [seq(f"a{i}", 4, max_tokens=100, tenant="a") for i in range(10)]
    for s in flood:
        sched.add(s)
    advance(sched, sched.schedule())  # a0..a3 fill the batch
    sched.add(seq("b0", 4, tenant="b"))
    out = sched.schedule()  # b is below its share (4 / 2 tenants), a above: a's newest makes room
    assert [s.request_id for s in out.preempted] == ["a3"]
    assert [s.request_id for s, _ in out.scheduled if s.num_computed_tokens == 0] == ["b0"]
    advance(sched, out)
    sched.add(seq("b1", 4, tenant="b"))
    out = sched.schedule()  # b is still below its share: one more of a's
    assert [s.request_id for s in out.preempted] == ["a2"]
    advance(sched, out)
    sched.add(seq("b2", 4, tenant="b"))
    out = sched.schedule()  # b runs its share (2 of 4): no more preemption, b2 waits
    assert not out.preempted and {s.request_id for s in sched.running} == {"a0", "a1", "b0", "b1"}


def test_a_first_chunk_below_its_share_runs_alone_at_most_every_other_step():
    sched = make(max_num_seqs=8, max_num_batched_tokens=1000)
    flood = [seq(f"a{i}", 4, max_tokens=100, tenant="a") for i in range(6)]
    for s in flood:
        sched.add(s)
    advance(sched, sched.schedule())  # a runs 6 of 8 slots, above its share of 4 once b has work
    sched.add(seq("b0", 4, tenant="b"))
    out = sched.schedule()  # b0's prefill alone: it does not wait for a's decodes
    assert [(s.request_id, n) for s, n in out.scheduled] == [("b0", 4)] and not out.preempted
    advance(sched, out)
    sched.add(seq("c0", 4, tenant="c"))
    out = sched.schedule()  # the next arrival shares a step with every decode: arrivals cannot starve the batch
    assert {s.request_id for s, _ in out.scheduled} == {"c0", "b0", *(s.request_id for s in flood)}
    advance(sched, out)
    out = sched.schedule()  # nothing new arrived: a plain decode step
    assert len(out.scheduled) == 8


def test_a_light_tenant_goes_alone_before_a_burst_or_beside_work_when_it_runs_nothing():
    sched = make(max_num_seqs=8, max_num_batched_tokens=1000)
    for s in [seq(f"a{i}", 4, max_tokens=100, tenant="a") for i in range(12)]:  # a flood whose streams all began
        sched.add(s)
    sched.add(seq("b0", 4, tenant="b"))
    out = sched.schedule()  # a's waiting work is above its share: b0 does not share a step with a's prefills
    assert [(s.request_id, n) for s, n in out.scheduled] == [("b0", 4)]
    advance(sched, out)
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled] == ["b0", *(f"a{i}" for i in range(7))]

    sched = make(max_num_seqs=8, max_num_batched_tokens=1000)  # a runs within its share, its next requests coming
    for s in [seq(f"a{i}", 4, max_tokens=100, tenant="a") for i in range(2)]:
        sched.add(s)
    advance(sched, sched.schedule())
    sched.add(seq("b0", 4, tenant="b"))
    sched.add(seq("a2", 4, max_tokens=100, tenant="a"))
    out = sched.schedule()  # b runs nothing beside a's work: light, alone
    assert [s.request_id for s, _ in out.scheduled] == ["b0"]
    advance(sched, out)
    advance(sched, sched.schedule())
    sched.add(seq("b1", 4, tenant="b"))
    out = sched.schedule()  # b runs something now: b1 shares the step like everyone
    assert {s.request_id for s, _ in out.scheduled} == {"a0", "a1", "a2", "b0", "b1"}


def test_a_first_chunk_below_its_share_cuts_into_the_step_in_flight_once_and_never_preempts():
    sched = make(max_num_seqs=8, max_num_batched_tokens=1000)
    flood = [seq(f"a{i}", 4, max_tokens=100, tenant="a") for i in range(6)]
    for s in flood:
        sched.add(s)
    advance(sched, sched.schedule())
    in_flight = sched.schedule()  # a's decodes; b0 and b1 arrive while it runs
    sched.add(seq("b0", 4, tenant="b"))
    sched.add(seq("b1", 4, tenant="b"))
    cut = sched.schedule_cut_in()
    assert [(s.request_id, n) for s, n in cut.scheduled] == [("b0", 4)] and not cut.preempted
    advance(sched, cut)
    assert sched.schedule_cut_in() is None  # one cut-in per step in flight
    advance(sched, in_flight)
    out = sched.schedule()  # b1 shares the next step: no alone step right after a cut-in
    assert {s.request_id for s, _ in out.scheduled} == {"b0", "b1", *(s.request_id for s in flood)}
    advance(sched, out)

    full = make(max_num_seqs=4, max_num_batched_tokens=1000)  # a fills the batch: making room needs a preemption
    for s in [seq(f"a{i}", 4, max_tokens=100, tenant="a") for i in range(4)]:
        full.add(s)
    advance(full, full.schedule())
    full.schedule()
    full.add(seq("b0", 4, tenant="b"))
    assert full.schedule_cut_in() is None and [s.request_id for s in full.waiting] == ["b0"]


def test_blocks_short_preempt_the_heaviest_tenant_not_the_newest_sequence():
    sched = make(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=1000)
    a = [seq(f"a{i}", 8, max_tokens=100, tenant="a") for i in range(3)]
    b = seq("b0", 8, max_tokens=100, tenant="b")
    for s in (*a, b):
        sched.add(s)
    out = sched.schedule()  # 2 blocks each: the pool is full
    advance(sched, out)
    out = sched.schedule()  # every sequence needs a third block: a's newest goes, not b0 (the newest)
    assert out.preempted and all(s.tenant == "a" for s in out.preempted) and b.status is Status.RUNNING


def test_a_tenant_below_its_share_is_admitted_while_the_pool_is_short():
    sched = make(num_blocks=8, block_size=4, max_num_seqs=6, max_num_batched_tokens=1000)
    flood = [seq(f"a{i}", 8, max_tokens=100, tenant="a") for i in range(6)]
    for s in flood:
        sched.add(s)
    advance(sched, sched.schedule())  # a0..a3 hold every block; a4, a5 wait
    late = seq("b0", 8, tenant="b")
    sched.add(late)
    out = sched.schedule()  # a runs 4 of 6 slots, above its share of 3: b0's blocks come from a's newest, now
    assert late.status is Status.RUNNING and (late, 8) in out.scheduled
    assert out.preempted and all(s.tenant == "a" for s in out.preempted)
    assert sched.kv.num_used_blocks == sum(len(s.block_ids) for s in sched.running)


def test_requests_without_a_tenant_make_room_too_when_they_flood():
    sched = make(max_num_seqs=4, max_num_batched_tokens=1000)
    for i in range(6):
        sched.add(seq(f"n{i}", 4, max_tokens=100))  # no tenant: the default one
    advance(sched, sched.schedule())
    sched.add(seq("b0", 4, tenant="b"))
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["n3"] and "b0" in {s.request_id for s, _ in out.scheduled}


def test_without_tenants_admission_stays_fcfs():
    sched = make(max_num_seqs=2)
    reqs = [seq(f"r{i}", 4) for i in range(4)]
    for s in reqs:
        sched.add(s)
    assert [s.request_id for s, _ in sched.schedule().scheduled] == ["r0", "r1"]


def test_tenant_running_quota_skips_to_other_tenants():
    sched = make(tenant_quotas={"t1": TenantQuota(max_running=1)})
    sched.add(seq("a", 4, tenant="t1"))
    sched.add(seq("b", 4, tenant="t1"))
    sched.add(seq("c", 4, tenant="t2"))
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled] == ["c", "a"]  # t2 has less waiting: it goes first
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_tenant_block_quota_preempts_within_the_tenant():
    sched = make(num_blocks=64, block_size=4, tenant_quotas={"*": TenantQuota(max_blocks=4)})
    a, b, other = seq("a", 8, tenant="t"), seq("b", 7, tenant="t"), seq("o", 30, tenant="u")
    for s in (a, b, other):
        sched.add(s)
    out = sched.schedule()
    assert {s.request_id for s, _ in out.scheduled} == {"a", "b"}  # "o" alone exceeds the quota
    advance(sched, out)
    out = sched.schedule()  # a grows to a 3rd block: over t's quota of 4 -> b (t's newest) goes
    assert [s.request_id for s in out.preempted] == ["b"]


def test_waiting_queue_bound_refuses_with_overloaded():
    sched = make(max_waiting=2, max_num_seqs=1)
    for rid in "abc":  # 2 waiting + 1 free running slot: a burst is not refused before scheduling
        sched.add(seq(rid, 4))
    with pytest.raises(QueueFullError, match="overloaded"):
        sched.add(seq("d", 4))


def test_unknown_policy_is_rejected_by_name():
    with pytest.raises(ValueError, match="admission_policy"):
        SchedulerConfig(admission_policy="fifo")
