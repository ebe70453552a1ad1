"""What Dynamo's KV-aware router needs from a worker, fed from the engine thread's output thread.

- KV events: each step's prefix-cache stores and evictions, in order. A run of stored blocks that
  chain (each the parent of the next) goes out as one `publish_stored`. The router hashes the tokens
  itself; our 128-bit chained hashes only name blocks, here cut to the signed 64 bits Dynamo takes.
- Load: a snapshot of the KV pool after every step and when the engine goes idle (used blocks, total,
  prefix-cache hit rate).
- Forward-pass metrics, what Dynamo's planner scales on: each step's prefill and decode requests and tokens, the
  waiting ones, and the step's wall time (engine.step_load; the publisher sends an idle heartbeat on its own).
"""

from __future__ import annotations

from typing import Any

from backend.engine.engine import EngineStats
from backend.engine.kv_events import BlockRemoved, BlockStored, KVEvent
from backend.serving.engine_thread import LoopObserver

def block_id64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little", signed=True)


class RouterFeed(LoopObserver):
    def __init__(self, snapshot_type: Any):
        self.snapshot_type = snapshot_type  # dynamo.common.backend.publisher.ComponentSnapshot
        self.kv_publisher: Any = None  # dynamo.llm.KvEventPublisher, once the worker hands it over
        self.snapshots: Any = None  # the worker's SnapshotPublisher
        self.fpm: Any = None  # dynamo.llm.FpmDirectPublisher, once the endpoint is up

    def on_kv_events(self, events: list[KVEvent]) -> None:
        if self.kv_publisher is None:
            return
        for group in _runs(events):
            if isinstance(group[0], BlockRemoved):
                self.kv_publisher.publish_removed([block_id64(e.block_hash) for e in group])
                continue
            parent = group[0].parent_hash
            self.kv_publisher.publish_stored(
                token_ids=[t for e in group for t in e.token_ids],
                num_block_tokens=[len(e.token_ids) for e in group],
                block_hashes=[block_id64(e.block_hash) for e in group],
                parent_hash=None if parent is None else block_id64(parent), cache_salt=group[0].cache_salt,
                lora_name=group[0].lora_name)

    def on_step(self, stats: EngineStats, step_seconds: float) -> None:
        self.on_idle(stats)
        fpm, load = self.fpm, stats.last_step
        if fpm is None:
            return
        fpm.publish(
            dp_rank=0, scheduled_num_prefill_requests=load.prefill_requests,
            scheduled_sum_prefill_tokens=load.prefill_tokens, scheduled_sum_prefill_kv_tokens=load.prefill_kv_tokens,
            scheduled_num_decode_requests=load.decode_requests, scheduled_sum_decode_kv_tokens=load.decode_kv_tokens,
            queued_num_prefill_requests=load.queued_prefill_requests,
            queued_sum_prefill_tokens=load.queued_prefill_tokens,
            queued_num_decode_requests=load.queued_decode_requests,
            queued_sum_decode_kv_tokens=load.queued_decode_kv_tokens, wall_time_secs=step_seconds)

    def on_idle(self, stats: EngineStats) -> None:
        if self.snapshots is None:
            return
        self.snapshots.publish(0, self.snapshot_type(
            kv_used_blocks=stats.kv_blocks_used, kv_total_blocks=stats.kv_blocks_total,
            gpu_cache_usage=stats.kv_blocks_used / stats.kv_blocks_total,
            kv_cache_hit_rate=stats.prefix_cache_hit_rate, dp_rank=0))


def _runs(events: list[KVEvent]) -> list[list[KVEvent]]:
    """Consecutive removals together; consecutive stores together while each is the next one's parent."""
    runs: list[list[KVEvent]] = []
    for event in events:
        last = runs[-1][-1] if runs else None
        if isinstance(event, BlockRemoved) and isinstance(last, BlockRemoved):
            runs[-1].append(event)
        elif isinstance(event, BlockStored) and isinstance(last, BlockStored) and \
                event.parent_hash == last.block_hash:
            runs[-1].append(event)
        else:
            runs.append([event])
    return runs
