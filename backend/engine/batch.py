"""The flat, ragged batch every runner consumes.

The runner contract (runners/base.py): token_ids[T], positions[T], slot_mapping[T], query_start[S+1],
context_lens[S], block_tables[S, B], and logits_index[L]: the tokens whose logits the step returns, in batch
order: each sequence's last token, or the last m of its chunk when it asks for m (a prompt's logprobs). From these we also derive, on the host and cheaply, the index
tensors that place tokens into attention rows (see models/llama.py), so that the compiled graph has
only input-defined shapes.

A row holds up to `q_tile` consecutive new tokens of one sequence. Decodes are one row of one
token; a prefill chunk of n tokens is ceil(n / q_tile) rows. Q, the row width, is
min(q_tile, longest chunk): a decode-only batch has Q = 1 and no padding at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from backend.engine.sequence import Sequence

if TYPE_CHECKING:
    from backend.engine.lora import LoraBatch

GRAPH_INPUTS = ("token_ids", "positions", "row_block_tables", "row_token_index", "kv_src", "kv_dst",
                "token_slot", "logits_index")


@dataclass
class ModelInput:
    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] cache slot (block * block_size + offset) for each new token's K/V
    query_start: np.ndarray  # [S + 1] sequence boundaries in the flat batch
    context_lens: np.ndarray  # [S] tokens in the cache after this step
    block_tables: np.ndarray  # [S, B], padded with block 0 (masked)
    row_block_tables: np.ndarray  # [R, B]
    row_token_index: np.ndarray  # [R, Q]
    kv_src: np.ndarray  # [P]
    kv_dst: np.ndarray  # [P]
    token_slot: np.ndarray  # [T]
    logits_index: np.ndarray  # [L] tokens whose logits the step returns
    logits_start: np.ndarray  # [S + 1] each sequence's rows of the logits; its last row is its last token's
    prompt_lens: np.ndarray  # [S] each sequence's prompt tokens (the CPU kernel attends to the rest as decodes)
    lora: LoraBatch | None = None  # the tokens of sequences with a LoRA adapter, by adapter (PyTorch runner only)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def graph_inputs(self) -> dict[str, np.ndarray]:
        """The inputs of the compiled graph, in its order (the KV cache comes last, from the runner)."""
        return {name: getattr(self, name) for name in GRAPH_INPUTS}


def build_model_input(scheduled: list[tuple[Sequence, int]], block_size: int, q_tile: int,
                      logits_rows: list[int] | None = None) -> ModelInput:
    """The batch of `scheduled` (sequence, tokens to compute); `logits_rows[s]` (default 1) of the last tokens of
    sequence s's chunk get logits."""
    i64 = np.int64
    chunks = [n for _, n in scheduled]
    S, T = len(scheduled), sum(chunks)
    B = max(len(seq.block_ids) for seq, _ in scheduled)
    Q = min(q_tile, max(chunks))
    C = B * block_size

    token_ids = np.empty(T, i64)
    positions = np.empty(T, i64)
    query_start = np.zeros(S + 1, i64)
    context_lens = np.empty(S, i64)
    prompt_lens = np.empty(S, i64)
    block_tables = np.zeros((S, B), i64)
    row_tables, row_tokens, srcs, dsts = [], [], [], []
    token_slot = np.empty(T, i64)

    t = 0
    for s, (seq, n) in enumerate(scheduled):
        start = seq.num_computed_tokens
        chunk = seq.token_ids[start:start + n]  # then the speculative drafts, which follow the last token
        token_ids[t:t + n] = chunk + seq.draft_token_ids[:n - len(chunk)]
        positions[t:t + n] = np.arange(start, start + n)
        query_start[s + 1] = t + n
        context_lens[s] = start + n
        prompt_lens[s] = len(seq.prompt_token_ids)
        block_tables[s, :len(seq.block_ids)] = seq.block_ids
        for a in range(0, n, Q):
            b = min(a + Q, n)
            r = len(row_tables)
            row_tables.append(block_tables[s])
            row_tokens.append(np.minimum(np.arange(t + a, t + a + Q), t + b - 1))  # padded with its last token
            token_slot[t + a:t + b] = r * Q + np.arange(b - a)
            # the row sees every new key of its sequence up to its last query
            srcs.append(np.arange(t, t + b))
            dsts.append(r * C + np.arange(start, start + b))
        t += n

    rows = np.ones(S, i64) if logits_rows is None else np.asarray(logits_rows, i64)
    logits_start = np.concatenate([[0], np.cumsum(rows)])
    ends = query_start[1:]
    logits_index = np.concatenate([np.arange(end - m, end) for end, m in zip(ends, rows)]) if S else np.empty(0, i64)
    blocks = block_tables[np.repeat(np.arange(S), chunks), positions // block_size]
    return ModelInput(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        query_start=query_start,
        context_lens=context_lens,
        block_tables=block_tables,
        row_block_tables=np.stack(row_tables),
        row_token_index=np.stack(row_tokens),
        kv_src=np.concatenate(srcs),
        kv_dst=np.concatenate(dsts),
        token_slot=token_slot,
        logits_index=logits_index,
        logits_start=logits_start,
        prompt_lens=prompt_lens,
    )
