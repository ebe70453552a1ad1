"""Drafts from a small model of the same vocabulary (`speculative: draft`), run by the engine's own runner code.

The draft model has its own runner and KV pool. It mirrors each speculating sequence: what it has computed is kept
as long as it agrees with the sequence's tokens (its accepted drafts are the sequence's next tokens, at the same
positions); past the first disagreement (a rejected draft) its blocks are trimmed and recomputed. A step's drafts
for all sequences come from batched forwards: the first catches each sequence up (its whole prompt the first time,
after that the tokens the target added) and yields one greedy draft; each further forward adds one. Drafts only
propose: the target verifies them (speculation.py), so what the draft model computes never changes an output.
"""

from __future__ import annotations

from backend.engine.batch import build_model_input
from backend.engine.kv_cache import KVCacheManager
from backend.engine.runners.base import Runner
from backend.engine.sampling import SamplingParams
from backend.engine.sequence import Sequence


class DraftModel:
    def __init__(self, vocab_size: int, runner: Runner, block_size: int, q_tile: int):
        if runner.model_config.vocab_size != vocab_size:
            raise ValueError(f"draft_model: its vocabulary has {runner.model_config.vocab_size} tokens, the model's "
                             f"{vocab_size}: a draft model must share the model's tokenizer")
        self.runner = runner
        self.kv = KVCacheManager(runner.num_blocks, block_size, enable_prefix_caching=False)
        self.q_tile = q_tile
        self.mirrors: dict[str, Sequence] = {}  # request id -> the draft model's copy of the sequence
        self._synced: dict[str, int] = {}  # request id -> the sequence's length when its mirror last took its tokens

    def propose(self, rooms: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to `room` greedy draft tokens after each sequence's tokens ([] where the draft pool is short)."""
        drafts: dict[str, list[int]] = {seq.request_id: [] for seq, _ in rooms}
        pending = [(mirror, mirror.num_uncomputed, room) for mirror, room in
                   ((self._mirror(seq), room) for seq, room in rooms)]
        while pending := [(m, n, room) for m, n, room in pending if room > 0 and self._allocate(m, n)]:
            batch = build_model_input([(m, n) for m, n, _ in pending], self.kv.block_size, self.q_tile,
                                      [1] * len(pending))
            for (m, n, _), token in zip(pending, self.runner.forward(batch).argmax(dim=-1).tolist()):
                m.num_computed_tokens += n
                m.prompt_token_ids.append(token)
                drafts[m.request_id].append(token)
            pending = [(m, 1, room - 1) for m, _, room in pending]
        return [drafts[seq.request_id] for seq, _ in rooms]

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: its mirror's blocks go back to the draft pool."""
        mirror = self.mirrors.pop(seq.request_id, None)
        self._synced.pop(seq.request_id, None)
        if mirror is not None:
            self.kv.free(mirror)

    def _mirror(self, seq: Sequence) -> Sequence:
        """The draft model's copy of `seq`, holding its tokens, computed up to where it agrees with them."""
        tokens = seq.token_ids
        mirror = self.mirrors.get(seq.request_id)
        synced, self._synced[seq.request_id] = self._synced.get(seq.request_id, 0), len(tokens)
        if mirror is None:
            mirror = self.mirrors[seq.request_id] = Sequence(seq.request_id, tokens, SamplingParams(), 0)
            return mirror
        # its first `synced` tokens are the sequence's own (a sequence only grows); past them, its drafts
        known = mirror.prompt_token_ids[synced:mirror.num_computed_tokens]
        agree = synced + next((i for i, (a, b) in enumerate(zip(known, tokens[synced:])) if a != b),
                              min(len(known), len(tokens) - synced))
        mirror.prompt_token_ids, mirror.num_computed_tokens = tokens, min(agree, mirror.num_computed_tokens,
                                                                          len(tokens) - 1)
        self.kv.trim(mirror)
        return mirror

    def _allocate(self, mirror: Sequence, n: int) -> bool:
        if self.kv.allocate(mirror, n):
            return True
        self.release(mirror)  # short of blocks: no drafts for it this step, and it starts over next time
        return False
