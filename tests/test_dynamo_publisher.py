"""RouterFeed: the engine's KV events become Dynamo publish calls in order, chained stores grouped
(a recording stand-in takes Dynamo's publisher's place; the feed is the thing under test)."""

from backend.dynamo.publisher import RouterFeed, block_id64
from backend.engine.kv_events import BlockRemoved, BlockStored


class Recorder:
    def __init__(self):
        self.calls = []

    def publish_stored(self, **kw):
        self.calls.append(("stored", kw))

    def publish_removed(self, hashes):
        self.calls.append(("removed", hashes))


def test_chained_stores_go_out_as_one_event_and_order_is_kept():
    a, b, c, x = (bytes([i]) * 16 for i in (1, 2, 3, 9))
    feed = RouterFeed(snapshot_type=dict)
    feed.kv_publisher = Recorder()
    feed.on_kv_events([BlockStored(a, None, (1, 2)), BlockStored(b, a, (3, 4)), BlockRemoved(x),
                       BlockRemoved(c), BlockStored(c, x, (5, 6)), BlockStored(a, None, (1, 2), "tenant=t"),
                       BlockStored(b, None, (1, 2), None, "sql")])
    assert feed.kv_publisher.calls == [
        ("stored", {"token_ids": [1, 2, 3, 4], "num_block_tokens": [2, 2],
                    "block_hashes": [block_id64(a), block_id64(b)], "parent_hash": None, "cache_salt": None,
                    "lora_name": None}),
        ("removed", [block_id64(x), block_id64(c)]),
        ("stored", {"token_ids": [5, 6], "num_block_tokens": [2], "block_hashes": [block_id64(c)],
                    "parent_hash": block_id64(x), "cache_salt": None, "lora_name": None}),
        ("stored", {"token_ids": [1, 2], "num_block_tokens": [2], "block_hashes": [block_id64(a)],
                    "parent_hash": None, "cache_salt": "tenant=t", "lora_name": None}),  # the router hashes with it
        ("stored", {"token_ids": [1, 2], "num_block_tokens": [2], "block_hashes": [block_id64(b)],
                    "parent_hash": None, "cache_salt": None, "lora_name": "sql"}),  # and with a LoRA adapter's name
    ]


def test_block_ids_are_signed_64_bit():
    assert block_id64(b"\xff" * 16) == -1
    assert -(2**63) <= block_id64(bytes(range(16))) < 2**63
