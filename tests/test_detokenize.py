"""Streamed detokenization must equal the one-shot decode, piece by piece free of split characters."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from backend.serving.detokenize import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    context_before,
    decode_delta,
    decode_text,
)
from backend.serving.tokenizer import encode, load_tokenizer

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog.  Twice!",
    "cjk": "你好,世界。今天天气很好",
    "emoji": "I ❤️ 🦙 and 👨‍👩‍👧",
    "mixed": "Mixed: café naïve — 日本語 🎉 ok\r\n",
    "code": "def f(x):\n    if x:\n\treturn [x ** 2 for _ in range(3)]\n\n",
}
CHUNKS = (1, 2, 3)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(smollm2_dir)


def stream_stateless(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], chunk: int, skip_special_tokens: bool = True
) -> list[str]:
    """What the engine + postprocessing model do: ship ids in chunks, the last one with final=True."""
    starts = range(0, len(ids), chunk)
    return [
        decode_delta(
            tokenizer,
            context_before(ids, start),
            ids[start : start + chunk],
            final=start + chunk >= len(ids),
            skip_special_tokens=skip_special_tokens,
        )
        for start in starts
    ]


def stream_stateful(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], chunk: int
) -> tuple[IncrementalDetokenizer, list[str]]:
    """The BLS path: chunks without final, then an empty final flush."""
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(ids[start : start + chunk]) for start in range(0, len(ids), chunk)]
    pieces.append(detok.push([], final=True))
    return detok, pieces


def assert_exact(pieces: list[str], expected: str) -> None:
    assert "".join(pieces) == expected
    if REPLACEMENT_CHAR not in expected:
        assert not [piece for piece in pieces if REPLACEMENT_CHAR in piece]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", TEXTS)
def test_stateless_stream_equals_full_decode(
    tokenizer: PreTrainedTokenizerBase, name: str, chunk: int
) -> None:
    ids = encode(tokenizer, TEXTS[name], apply_chat_template=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == decode_text(tokenizer, ids) == TEXTS[name]
    assert_exact(stream_stateless(tokenizer, ids, chunk), full)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", TEXTS)
def test_incremental_detokenizer_equals_full_decode(
    tokenizer: PreTrainedTokenizerBase, name: str, chunk: int
) -> None:
    ids = encode(tokenizer, TEXTS[name], apply_chat_template=False)
    detok, pieces = stream_stateful(tokenizer, ids, chunk)
    assert_exact(pieces, TEXTS[name])
    assert detok.text == TEXTS[name]
    assert detok.ids == ids


def test_split_characters_are_held_back_not_garbled(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "🦙", apply_chat_template=False)
    assert len(ids) > 1, "the test needs an emoji that spans tokens"
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push([token]) for token in ids] == [""] * (len(ids) - 1) + ["🦙"]


def test_final_flushes_an_incomplete_tail(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "ok 🦙", apply_chat_template=False)[:-1]
    full = decode_text(tokenizer, ids)
    assert full.startswith("ok") and full.endswith(REPLACEMENT_CHAR)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids) == full[:-1]
    assert detok.push([], final=True) == REPLACEMENT_CHAR


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_match_non_streamed(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> None:
    ids = encode(tokenizer, TEXTS["emoji"], apply_chat_template=True) + [tokenizer.eos_token_id]
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert expected == decode_text(tokenizer, ids, skip_special_tokens)
    assert ("<|im_start|>" in expected) is not skip_special_tokens
    for chunk in CHUNKS:
        assert_exact(stream_stateless(tokenizer, ids, chunk, skip_special_tokens), expected)


def test_invalid_utf8_from_random_tokens_streams_exactly(tokenizer: PreTrainedTokenizerBase) -> None:
    """Random models emit stray byte tokens and special tokens; the stream must still match decode."""
    rng = random.Random(0)
    byte_tokens = [i for i in range(len(tokenizer)) if len(tokenizer.convert_ids_to_tokens(i)) == 1]
    non_ascii = [i for i in byte_tokens if tokenizer.decode([i]) == REPLACEMENT_CHAR]
    specials = [tokenizer.eos_token_id, tokenizer.bos_token_id]
    pools = (byte_tokens + specials, non_ascii + specials, non_ascii)
    for _ in range(300):
        pool = rng.choice(pools)
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 24))]
        chunk = rng.choice(CHUNKS)
        assert "".join(stream_stateless(tokenizer, ids, chunk)) == decode_text(tokenizer, ids)
        assert stream_stateful(tokenizer, ids, chunk)[0].text == decode_text(tokenizer, ids)


def test_chat_template_wraps_one_user_turn(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "Hi", apply_chat_template=True)
    text = decode_text(tokenizer, ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert encode(tokenizer, "Hi", apply_chat_template=False) == tokenizer("Hi")["input_ids"]
