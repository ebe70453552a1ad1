"""Block pool and KV cache manager: ref counts, prefix hits, eviction order, no leaks."""

import pytest

from backend.engine.kv_cache import BlockPool, KVCacheManager, chain_hash
from backend.engine.kv_events import BlockRemoved, BlockStored
from backend.engine.sampling import SamplingParams
from backend.engine.sequence import Sequence


def make_seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), arrival_index=0)


def test_pool_allocates_in_lru_order_and_tracks_refs():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.num_free == 2
    pool.touch([0])
    pool.release([0])
    assert pool.blocks[0].ref_count == 1 and pool.num_free == 2
    pool.release([1, 0])
    assert list(pool.free_queue) == [2, 3, 1, 0]  # freed blocks join the tail: evicted last
    with pytest.raises(RuntimeError, match="double free"):
        pool.release([0])
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_cached_free_block_is_reused_by_hash_and_evicted_when_reallocated():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    h = chain_hash(b"", [1, 2, 3])
    pool.register(b, h, None, [1, 2, 3])
    pool.release([b])
    assert pool.lookup(h) == b  # still cached while free
    pool.touch([b])  # a prefix hit takes it out of the free queue
    assert b not in pool.free_queue and pool.blocks[b].ref_count == 1
    pool.release([b])
    pool.allocate(2)  # needs every block: the cached one is evicted
    assert pool.lookup(h) is None and pool.blocks[b].block_hash is None


def test_eviction_takes_least_recently_freed_first():
    pool = BlockPool(3)
    ids = pool.allocate(3)
    for i, b in enumerate(ids):
        pool.register(b, chain_hash(b"", [i]), None, [i])
    pool.release([ids[1]])
    pool.release([ids[0]])
    pool.release([ids[2]])
    [taken] = pool.allocate(1)
    assert taken == ids[1]
    assert pool.lookup(chain_hash(b"", [0])) == ids[0]


def test_chained_hash_depends_on_the_whole_prefix():
    h1 = chain_hash(b"", [1, 2])
    assert chain_hash(h1, [3, 4]) != chain_hash(chain_hash(b"", [9, 9]), [3, 4])
    assert chain_hash(h1, [3, 4]) == chain_hash(chain_hash(b"", [1, 2]), [3, 4])


def test_manager_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(12))  # exactly 3 full blocks
    a = make_seq("a", prompt)
    assert kv.allocate(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(a)
    assert kv.num_cached_blocks == 3

    b = make_seq("b", prompt)
    hits = kv.find_cached_prefix(b)
    assert hits == a.block_ids[:2]  # the last block is recomputed: its last token gives the logits
    assert kv.allocate(b, len(prompt) - 8, hits)
    assert b.block_ids[:2] == a.block_ids[:2] and len(b.block_ids) == 3  # 2 shared + 1 for tokens 8..11
    assert kv.pool.blocks[a.block_ids[0]].ref_count == 2
    assert kv.stats.hit_tokens == 8

    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16  # all free again; cached content stays reusable
    assert kv.num_cached_blocks == 3


def test_allocate_refuses_without_side_effects_when_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    s = make_seq("s", list(range(9)))
    assert not kv.allocate(s, 9)
    assert s.block_ids == [] and kv.num_free_blocks == 2
    assert kv.allocate(s, 8)
    assert len(s.block_ids) == 2


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq("a", list(range(8)))
    kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    assert kv.find_cached_prefix(make_seq("b", list(range(8)))) == []
    assert kv.num_cached_blocks == 0


def test_kv_events_follow_stores_and_evictions_in_order():
    kv = KVCacheManager(num_blocks=3, block_size=2, enable_kv_events=True)
    a = make_seq("a", [1, 2, 3, 4, 5])
    assert kv.allocate(a, 5)
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)  # two full blocks: [1, 2] and [3, 4]; [5] is not full
    h1, h2 = a.block_hashes[:2]
    assert kv.take_events() == [BlockStored(h1, None, (1, 2)), BlockStored(h2, h1, (3, 4))]
    assert kv.take_events() == []  # drained
    kv.free(a)  # freeing keeps cached content: no event
    assert kv.take_events() == []
    b = make_seq("b", [7, 8, 9, 10, 11, 12])
    assert kv.allocate(b, 6)  # 3 blocks: evicts both cached blocks, least recently freed first
    assert kv.take_events() == [BlockRemoved(h2), BlockRemoved(h1)]
    kv.free(b)


def test_kv_events_are_off_by_default():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_seq("a", [1, 2, 3])
    assert kv.allocate(a, 3)
    a.num_computed_tokens = 3
    kv.cache_computed_blocks(a)
    assert kv.take_events() == [] and kv.pool.events is None


def test_a_salt_keeps_equal_prompts_apart_and_the_events_carry_it(tiny_model_dir):
    """cache_salt (vLLM's) and the tenant (prefix_cache_scope "tenant", the default) enter the first block's hash:
    the same prompt under another salt or tenant shares no block; under the same one it does."""
    from backend.engine import EngineConfig, LLMEngine
    from backend.engine.sampling import SamplingParams

    prompt = list(range(100, 164))  # 4 full blocks

    def cached_tokens(engine, **kw) -> int:
        rid = f"r{engine.stats().num_running}-{len(kw)}-{sorted(kw.items())}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1), **kw)
        seq = engine.requests[rid]
        while engine.has_unfinished():
            engine.step()
        return seq.num_cached_tokens

    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir), num_kv_blocks=64, enable_kv_events=True))
    assert cached_tokens(engine, cache_salt="a") == 0
    assert cached_tokens(engine, cache_salt="a") == 48  # all full blocks but the last token's
    assert cached_tokens(engine, cache_salt="b") == 0 and cached_tokens(engine) == 0
    assert cached_tokens(engine, tenant="t1") == 0 and cached_tokens(engine, tenant="t2") == 0
    assert cached_tokens(engine, tenant="t1") == 48
    stored = [e for e in engine.kv.take_events() if isinstance(e, BlockStored)]
    assert {e.cache_salt for e in stored} == {"a", "b", None, "tenant=t1", "tenant=t2"}

    shared = LLMEngine(EngineConfig.create(model=str(tiny_model_dir), num_kv_blocks=64, prefix_cache_scope="global"))
    assert cached_tokens(shared, tenant="t1") == 0 and cached_tokens(shared, tenant="t2") == 48
    assert cached_tokens(shared, tenant="t2", cache_salt="a") == 0
