"""Seeded synthetic workload shared by the offline and online benchmarks.

Prompts are random token ids drawn uniformly from the model's vocabulary with the
special tokens left out (no real text: the throughput numbers depend only on the
lengths, and random ids need no data set). Every request ignores EOS, so it
generates exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Request:
    """One generation request: prompt ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int


def make_workload(
    num_requests: int = 64,
    prompt_len: tuple[int, int] = (16, 256),
    output_len: tuple[int, int] = (16, 128),
    vocab_size: int = 32000,
    seed: int = 0,
    exclude_ids: Iterable[int] = (),
) -> list[Request]:
    """Requests with prompt and output lengths uniform in the inclusive ranges given."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(exclude_ids, dtype=np.int64))
    prompt_lens = rng.integers(prompt_len[0], prompt_len[1] + 1, size=num_requests)
    output_lens = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    return [
        Request(prompt_token_ids=rng.choice(allowed, size=int(n)).tolist(), max_tokens=int(m))
        for n, m in zip(prompt_lens, output_lens)
    ]


def model_vocab(model_dir: str | Path) -> tuple[int, list[int]]:
    """The vocabulary size of an HF model folder and the special token ids to leave out.

    Without a tokenizer in the folder (a random model), no id is special. With one, the size
    is capped at the tokenizer's length, since embedding rows past it are padding.
    """
    from transformers import AutoConfig, AutoTokenizer

    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return vocab_size, []
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return min(vocab_size, len(tokenizer)), sorted(special)


def save_workload(requests: list[Request], path: str | Path) -> None:
    """Write requests as a JSON list (read back by ``load_workload``, e.g. in another venv)."""
    Path(path).write_text(json.dumps([asdict(r) for r in requests]))


def load_workload(path: str | Path) -> list[Request]:
    """Read requests written by ``save_workload``."""
    return [Request(**r) for r in json.loads(Path(path).read_text())]
