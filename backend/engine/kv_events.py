"""What happened to the prefix cache, in order, for routers that track which worker holds which prefix.

A block is *stored* when its full, computed content is registered under its chained hash, and *removed*
when an allocation evicts that content. The events name blocks by hash and carry the tokens, so a
router (Dynamo's KV router hashes tokens itself) can rebuild each worker's prefix tree. Collected only
when `enable_kv_events` is set; the front door drains them after each step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    block_hash: bytes
    parent_hash: bytes | None  # None: the first block of a sequence
    token_ids: tuple[int, ...]
    cache_salt: str | None = None  # the salt in the first block's hash (kv_cache.block_hashes)
    lora_name: str | None = None  # the LoRA adapter whose digest is in it too


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: bytes


KVEvent = BlockStored | BlockRemoved
