"""Exact streaming detokenization with no state in the decoding step.

Contract (engine -> stateless postprocessing model):
1. The engine keeps each request's output ids and `sent`, how many of them it has already shipped.
2. Each response carries `context_ids = context_before(output_ids, sent)` (at most CONTEXT_TOKENS ids;
   empty at first, prompt ids are never context), `new_ids = output_ids[sent:]` and `final`; then
   `sent = len(output_ids)`. Nothing else is tracked.
3. The postprocessing model returns `decode_delta(tokenizer, context_ids, new_ids, final)`.
4. The pieces concatenate to `decode_text(tokenizer, output_ids)`, the non-streamed text, because the
   text emitted after k ids is a pure function of the ids:  emitted(k) = decode(ids[:k]) minus one
   trailing U+FFFD.  `decode_delta` returns emitted(k + len(new)) - emitted(k), or everything on `final`.
5. Held-back ids need no bookkeeping: they sit in the next call's context, whose emitted() leaves them out.

Why one U+FFFD: byte-level BPE decoders (SmolLM2, GPT-2, Llama 3) join the token bytes and decode them
lossily, so an incomplete UTF-8 tail becomes exactly one U+FFFD and every character before it is final.
(SentencePiece byte-fallback decoders turn a whole run of byte tokens into U+FFFDs instead; they are not
supported.) The window context+new gives the same emitted() difference as the full ids once the decoder
is back in step, which takes at most 3 bytes (a UTF-8 character has at most 4), so the context must hold at
least 4 bytes of text or start at the first output id. Every non-special token is at least one byte; the
spare ids in CONTEXT_TOKENS cover skipped special tokens, which decode to nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 8
REPLACEMENT_CHAR = "\ufffd"


def decode_text(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], skip_special_tokens: bool = True
) -> str:
    """The one decode used for streamed and non-streamed text; space clean-up would break prefixes."""
    return tokenizer.decode(
        list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def context_before(ids: Sequence[int], start: int) -> list[int]:
    """The context ids the engine sends with the ids from `start` on."""
    return list(ids[max(0, start - CONTEXT_TOKENS) : start])


def decode_delta(
    tokenizer: PreTrainedTokenizerBase,
    context_ids: Sequence[int],
    new_ids: Sequence[int],
    final: bool,
    skip_special_tokens: bool = True,
) -> str:
    """The complete text that `new_ids` add after `context_ids`; on `final`, also any held-back tail."""
    before = _emitted(decode_text(tokenizer, context_ids, skip_special_tokens))
    after = decode_text(tokenizer, [*context_ids, *new_ids], skip_special_tokens)
    if not final:
        after = _emitted(after)
    return after[len(before) :]


def _emitted(text: str) -> str:
    return text[:-1] if text.endswith(REPLACEMENT_CHAR) else text


@dataclass
class IncrementalDetokenizer:
    """Stateful wrapper over `decode_delta` for callers that see the whole stream (BLS, stop strings)."""

    tokenizer: PreTrainedTokenizerBase
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    text: str = ""

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Add ids and return the text they complete; `final=True` flushes a held-back tail."""
        context = context_before(self.ids, len(self.ids))
        piece = decode_delta(self.tokenizer, context, new_ids, final, self.skip_special_tokens)
        self.ids.extend(new_ids)
        self.text += piece
        return piece
