"""Load a model folder's tokenizer offline and turn request text into prompt ids."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `model_dir`; `local_files_only` keeps it off the Hugging Face hub."""
    return AutoTokenizer.from_pretrained(Path(model_dir), local_files_only=True)


def encode(tokenizer: PreTrainedTokenizerBase, text: str, apply_chat_template: bool) -> list[int]:
    """Prompt ids for `text`, either as one user turn of the chat template or as raw text.

    Raw text gets the tokenizer's own special tokens, as `tokenizer(text)` does for HF users (none for
    SmolLM2, BOS for Llama-style tokenizers). The chat template writes its special tokens itself.
    """
    if apply_chat_template:
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    return tokenizer(text, add_special_tokens=True)["input_ids"]
