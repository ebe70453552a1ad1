"""The decoder layers in one C++ call a step (runners/layer_program.py) compute what the Python loop computes, bit for
bit: the workload of test_engine_correctness (chunked prefill in tiles, prefix-cache hits, decode) on each family the
program serves (Llama; Qwen3's q/k norms and windows; Qwen2's qkv bias; Phi-3's partial rotary and fused checkpoint;
Mistral's window; Gemma 3's sandwich norms, GeGLU and two ropes) on each of our GEMM kernels (int4; int8 with int8 or
float activations; float32 panels): every token id and logprob equal to an engine without the program, and the
serving loop's cut-in hook called between every two layers. Where a layer needs the Python loop (a float32 model on
oneDNN / aten GEMMs, experts, sinks), no program is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from tests.test_engine_correctness import workload
from tests.test_model_families import FAMILIES, save_random
from tests.tiny_model import make_tiny_llama

SERVED = ("llama", "qwen3", "qwen2", "phi3", "mistral", "gemma3_text")
KERNELS = [("int4", "q4_1_w4a8"), ("int8", "q8_0_w8a8"), ("int8", "q8_0"), ("none", "f32_panels")]  # forced


@pytest.fixture(scope="module", params=SERVED)
def model_dir(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    return make_tiny_llama(path) if request.param == "llama" else save_random(path, FAMILIES[request.param]())


def _engine(model_dir: Path, quantization: str, gemm_backend: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig.create(model=str(model_dir), quantization=quantization, gemm_backend=gemm_backend,
                                         max_num_batched_tokens=24, q_tile=4, enable_prefix_caching=True))


def _run(engine: LLMEngine, between_layers=None) -> dict[str, tuple[list[int], list[float]]]:
    """The workload greedily with each token's logprob: request -> (ids, logprobs)."""
    reqs = workload(engine.model_config.vocab_size)
    out: dict[str, tuple[list[int], list[float]]] = {}
    step = 0
    while step <= max(r.arrival_step for r in reqs) or engine.has_unfinished():
        for i, r in enumerate(reqs):
            if r.arrival_step == step:
                engine.add_request(str(i), r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True,
                                                                    logprobs=True))
                out[str(i)] = ([], [])
        for o in engine.step(between_layers):
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.new_logprobs)
        step += 1
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
    return out


@pytest.mark.parametrize("quantization, kernel", KERNELS)
def test_the_program_computes_the_python_loops_bits(model_dir, quantization, kernel):
    engines = [_engine(model_dir, quantization, kernel) for _ in range(2)]
    assert engines[0].runner.program is not None
    engines[1].runner.program = None  # the Python loop
    cut_ins = []
    with_program = _run(engines[0], between_layers=lambda: cut_ins.append(1))
    assert with_program == _run(engines[1])
    assert all(len(ids) for ids, _ in with_program.values())
    layers = engines[0].model_config.num_layers
    assert len(cut_ins) % (layers - 1) == 0 and cut_ins, "the hook runs between every two layers"


def test_no_program_where_a_layer_needs_the_python_loop(tmp_path):
    llama = make_tiny_llama(tmp_path / "llama")
    assert _engine(llama, "none", "aten").runner.program is None  # float32 on aten's GEMM
    moe = save_random(tmp_path / "moe", FAMILIES["qwen3_moe"]())
    assert _engine(moe, "int4").runner.program is None  # experts
    gpt_oss = save_random(tmp_path / "gpt_oss", FAMILIES["gpt_oss"]())
    assert _engine(gpt_oss, "int4").runner.program is None  # experts, sinks
