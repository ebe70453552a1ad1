"""Speculative decoding, verified in the one ragged forward: n-gram drafts (prompt lookup, vLLM's `ngram`) or a
draft model's (draft_model.py).

A running sequence whose next step is a decode gets up to k draft tokens (none while more than speculative_max_batch
sequences run): with `ngram`, the tokens that followed the most recent earlier occurrence of its last n tokens (n from
3 down to 1) in its prompt and output. It is scheduled as 1 + k query tokens (its last token and the drafts); the
forward returns the logits of all 1 + k positions; the drafts are accepted while each equals the sampler's pick at
its position, and the pick after the last accepted one is the step's own token. So a step yields 1 to k + 1 tokens,
each the one decoding without speculation picks at its position: the output equals the output without speculation.
Bit for bit on the CPU kernel path: a verified token attends as its one-token decode would (paged_attention.cpp
takes generated tokens one by one in any chunk), and the GEMM tactics but `aten` (MKL) give a row the same sums at
any row count; elsewhere (the gather graph, the GPU kernels, MKL) the verify rows round as a prefill chunk does, which
can differ from a one-token decode only at a near-tie.

A sampled row draws each position with the uniform of (its seed, that position) (sampling.py), the draw it makes there
without speculation: a seeded output is the same with speculation on or off, and so its distribution is the target's.
This is rejection sampling for drafts that are certain (an n-gram's, or a greedy draft model's: q is one-hot): the
draft d is kept with probability p(d), and otherwise the token comes from p without d, renormalized.

Penalties, bad words, the min_tokens ban, logprobs and a guide's mask apply per verified position as they would
without speculation (engine._sampler_row sees the drafts before the position as output, and a copy of the guide's
matcher past them); a guided sequence's drafts stop at the first its guide refuses. The rejected drafts' KV slots
are given back (scheduler.update_from_output): the computed tokens stop at the accepted ones, blocks past the
sequence's tokens are released, and nothing past them enters the prefix cache (block hashes come from the sequence's
tokens, never from drafts).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from backend.engine.sequence import Sequence

NGRAM_MAX, NGRAM_MIN = 3, 1
# speculative_max_batch's default: the most running sequences at which drafting still paid, SmolLM2 on 2 CPUs
# (AMD EPYC Zen 5, 2026-11-25, bench_speculative): n-gram drafts lost 5-7 % at batch 4, the model's int4 copy as the
# draft model gained 3-33 % there; both lost at 16.
AUTO_MAX_BATCH = {"ngram": 1, "draft": 4}


def eligible(seq: Sequence) -> bool:
    """Whether this sequence's next tokens may be verified several at a step (not while its prompt's logprobs are
    still being computed)."""
    return not seq.wants_prompt_logprobs


def guide_drafts(seq: Sequence, drafts: list[int]) -> list[int]:
    """A guided sequence's drafts up to the first its guide refuses (none past it could be accepted)."""
    grammar = seq.sampling_state.grammar
    return drafts if grammar is None or not drafts else drafts[:grammar.valid_prefix(drafts)]


def propose_ngram(token_ids: list[int], k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens (longest n first)."""
    if k <= 0 or len(token_ids) < 2:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(NGRAM_MAX, len(tokens) - 1), NGRAM_MIN - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every n-gram that has a next token
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(starts):
            start = starts[-1] + n
            return tokens[start:start + k].tolist()
    return []


class Drafter(Protocol):
    def propose(self, rooms: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to `room` draft tokens to follow each sequence's tokens, in order."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: drop what is kept for it."""


class NgramDrafter:
    """`speculative: ngram` (and `none`, which asks for no drafts): prompt lookup, no state."""

    def propose(self, rooms: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [propose_ngram(seq.token_ids, room) for seq, room in rooms]

    def release(self, seq: Sequence) -> None:
        pass


def accepted_tokens(picks: list[int], drafts_per_seq: list[list[int]]) -> list[list[int]]:
    """Each drafted sequence's tokens this step: its drafts while each equals the sampler's pick at its position,
    then the pick after the last accepted one. `picks` holds 1 + len(drafts) picks per sequence, in order."""
    out, row = [], 0
    for drafts in drafts_per_seq:
        best = picks[row:row + len(drafts) + 1]
        accepted = next((j for j, (d, b) in enumerate(zip(drafts, best)) if d != b), len(drafts))
        out.append(drafts[:accepted] + [best[accepted]])
        row += len(drafts) + 1
    return out
