"""Paged KV cache bookkeeping: block pool, per-sequence block tables, prefix cache.

The cache tensor itself, `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`, is allocated once
by the runner (each runtime owns its memory); this module decides which block holds which tokens.

Prefix caching follows vLLM v1: a full block is named by a hash chained over all tokens up to and
including it, so equal hashes mean equal prefixes. A block whose ref count drops to 0 keeps its
hash and sits in the free queue; a later request with the same prefix takes it back (O(1) removal
from the queue), and allocation evicts from the queue head, least recently freed first. A sequence's
`cache_salt` (vLLM's) enters the first block's hash, so only sequences with the same salt share blocks: the
engine salts by tenant (`prefix_cache_scope`) and by the request's own `cache_salt`. A LoRA adapter's digest enters
it too: two adapters, or an adapter and the base model, never share a block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from backend.engine.kv_events import BlockRemoved, BlockStored, KVEvent
from backend.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, row_bytes: int) -> int:
    """A block's bytes in the cache, K and V of every layer; `row_bytes`: one (token, KV head) row."""
    return num_layers * 2 * block_size * num_kv_heads * row_bytes


def chain_hash(parent: bytes, block_tokens: list[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(block_tokens, dtype=np.int64).tobytes())
    return h.digest()


def block_hashes(token_ids: list[int], block_size: int, known: list[bytes] = (),
                 salt: str | None = None, lora: str | None = None) -> list[bytes]:
    """The chained hash of every full block of `token_ids`, extending the `known` leading ones; the first block's
    parent is the salt's digest (none: b""), chained with the LoRA adapter's digest `lora` when given."""
    hashes = list(known)
    root = b"" if salt is None else hashlib.blake2b(salt.encode(), digest_size=16, person=b"cache_salt").digest()
    if lora is not None:
        root = hashlib.blake2b(root + lora.encode(), digest_size=16, person=b"lora").digest()
    for i in range(len(hashes), len(token_ids) // block_size):
        hashes.append(chain_hash(hashes[i - 1] if i else root, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Fixed set of blocks with ref counts; free blocks queue in LRU order and may still be cached."""

    def __init__(self, num_blocks: int, record_events: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id, for blocks in use and free alike
        self.events: list[KVEvent] | None = [] if record_events else None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take now (free, cached or not)."""
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"allocate({n}) with {len(self.free_queue)} free blocks")
        ids = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict its cached content
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.append(BlockRemoved(block.block_hash))
                block.block_hash = None
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop a reference; blocks reaching 0 join the queue tail (evicted last)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def register(self, block_id: int, block_hash: bytes, parent_hash: bytes | None,
                 token_ids: list[int], salt: str | None = None, lora_name: str | None = None) -> None:
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id
            if self.events is not None:
                self.events.append(BlockStored(block_hash, parent_hash, tuple(token_ids), salt, lora_name))


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    """Gives sequences the blocks for the tokens they are about to compute. With `window` (a model whose every layer
    slides: each query sees its last `window` keys), a sequence's leading blocks that no later query reads go back
    to the pool as its computed tokens advance (vLLM's sliding-window manager): a long sequence holds about
    window / block_size blocks, not its length's. They stay cached for prefix hits while the pool keeps them; their
    entries stay in the block table (the kernels mask what lies outside the window and never read it unmasked)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_kv_events: bool = False, window: int = 0):
        self.pool = BlockPool(num_blocks, record_events=enable_kv_events and enable_prefix_caching)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.stats = PrefixCacheStats()
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks registered in the cache
        self._num_released: dict[str, int] = {}  # request id -> leading blocks released out of the window

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self.pool.cached)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _update_hashes(self, seq: Sequence) -> None:
        if len(seq.block_hashes) < seq.num_tokens // self.block_size:
            seq.block_hashes = block_hashes(seq.token_ids, self.block_size, seq.block_hashes, seq.cache_salt,
                                            seq.lora and seq.lora.digest)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of a sequence that has no blocks yet.

        At least one token is left to compute, since the step that computes it yields the logits; a sequence that
        still wants its prompt's logprobs takes none (they come from the logits of every prompt token).
        """
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        self._update_hashes(seq)
        return self._cached_run(seq.block_hashes[:(seq.num_tokens - 1) // self.block_size])

    def _cached_run(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding these chained hashes, from the first up to the first one not cached."""
        hits = []
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        needed = self.blocks_for(seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens)
        needed -= len(seq.block_ids) + len(cached_blocks)
        reclaimed = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_count == 0)
        return needed <= self.pool.num_free - reclaimed

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give `seq` the blocks for `num_new_tokens` more tokens after its computed ones and the cached
        prefix blocks (taken by reference). Returns False, changing nothing, when the pool is short; the
        scheduler, not this manager, advances the sequence's computed tokens.
        """
        self._release_out_of_window(seq)
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            return False
        if not seq.block_ids:  # admission: count the prefix-cache lookup once
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += len(cached_blocks) * self.block_size
        if cached_blocks:
            self.pool.touch(list(cached_blocks))
            seq.block_ids.extend(cached_blocks)
            self._num_registered[seq.request_id] = len(seq.block_ids)
        needed = self.blocks_for(seq.num_computed_tokens + len(cached_blocks) * self.block_size
                                 + num_new_tokens) - len(seq.block_ids)
        if needed > 0:
            seq.block_ids.extend(self.pool.allocate(needed))
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(seq)
        start = self._num_registered.get(seq.request_id, 0)
        end = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        bs, tokens = self.block_size, seq.token_ids
        for i in range(start, end):
            self.pool.register(seq.block_ids[i], seq.block_hashes[i], seq.block_hashes[i - 1] if i else None,
                               tokens[i * bs:(i + 1) * bs], seq.cache_salt, seq.lora and seq.lora.name)
        self._num_registered[seq.request_id] = max(start, end)

    def cached_prefix_blocks(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """The blocks holding the longest cached run of `token_ids`' full blocks, from the start."""
        if not self.enable_prefix_caching:
            return []
        return self._cached_run(block_hashes(token_ids, self.block_size, salt=salt))

    def import_prefix(self, token_ids: list[int], write: Callable[[list[int], list[int]], None],
                      salt: str | None = None) -> int:
        """Enter the full blocks of `token_ids`, computed elsewhere, into the prefix cache. Blocks already
        cached stay; the others are taken from the pool (as many as fit, from the start: a gap would cut the
        chain), filled by `write(positions, block_ids)` and registered (KV events record them). No block stays
        referenced: a request with this prefix then takes them as prefix-cache hits. Returns the blocks now
        cached from the start."""
        if not self.enable_prefix_caching:
            return 0
        bs, hashes = self.block_size, block_hashes(token_ids, self.block_size, salt=salt)
        cached = [self.pool.lookup(h) for h in hashes]
        held = [b for b in cached if b is not None]
        self.pool.touch(held)  # so that taking new blocks cannot evict them
        missing = [i for i, b in enumerate(cached) if b is None]
        if len(missing) > self.pool.num_free:  # import up to the first block that does not fit
            hashes = hashes[:missing[self.pool.num_free]]
            missing = missing[:self.pool.num_free]
        new = self.pool.allocate(len(missing))
        if missing:
            write(missing, new)
        for i, block_id in zip(missing, new):
            self.pool.register(block_id, hashes[i], hashes[i - 1] if i else None, token_ids[i * bs:(i + 1) * bs],
                               salt)
        self.pool.release(held + new)
        return len(hashes)

    def take_events(self) -> list[KVEvent]:
        """The prefix-cache events since the last call, oldest first (empty unless enabled)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past what the sequence's tokens need (the slots of rejected speculative tokens); they
        hold nothing computed, so nothing of them is cached."""
        keep = self.blocks_for(seq.num_tokens)
        if len(seq.block_ids) > keep:
            self.pool.release(list(reversed(seq.block_ids[keep:])))
            del seq.block_ids[keep:]

    def _release_out_of_window(self, seq: Sequence) -> None:
        """Release the leading blocks wholly before the next query's window (its keys from computed - window + 1 on),
        each once; with prefix caching, only blocks already registered (a released block is never registered)."""
        if not self.window:
            return
        end = (seq.num_computed_tokens - self.window + 1) // self.block_size
        if self.enable_prefix_caching:
            end = min(end, self._num_registered.get(seq.request_id, 0))
        start = self._num_released.get(seq.request_id, 0)
        if end > start:
            self.pool.release(list(reversed(seq.block_ids[start:end])))
            self._num_released[seq.request_id] = end

    def free(self, seq: Sequence) -> None:
        """Release all of a sequence's blocks (finish, abort, preemption). Tail blocks are evicted first."""
        self.pool.release(list(reversed(seq.block_ids[self._num_released.pop(seq.request_id, 0):])))
        seq.block_ids = []
        self._num_registered.pop(seq.request_id, None)
