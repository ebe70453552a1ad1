"""The engine on CUDA (PyTorch runner) vs HF generate, greedy float32, seeded random Llamas (tiny, and Llama-3.2-1B-like
shapes): run on a GPU host from the repository root, `python scripts/cuda_check.py` (torch, transformers)."""
import tempfile, time, traceback
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from backend.engine import EngineConfig, LLMEngine, SamplingParams

print(torch.__version__, torch.cuda.get_device_name(0))
for name, shapes in [("tiny", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, initializer_range=0.5)),
                     ("1B-shapes", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                        num_attention_heads=32, num_key_value_heads=8, head_dim=64))]:
    cfg = LlamaConfig(vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, **shapes)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    d = tempfile.mkdtemp()
    model.save_pretrained(d)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 140)), [100] * 3, list(range(300, 317))]
    hf = model.cuda().eval()
    t = time.time()
    refs = [hf.generate(torch.tensor([p]).cuda(), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    print(name, "HF generate", round(time.time() - t, 2), "s")
    for attention in ("auto", "gather"):
        try:
            engine = LLMEngine(EngineConfig.create(model=d, device="cuda", attention=attention))
            t = time.time()
            outs = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
            torch.cuda.synchronize()
            same = [o == r for o, r in zip(outs, refs)]
            first = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(outs, refs)]
            print(name, attention, "engine", round(time.time() - t, 2), "s; equal to HF:", same, "first diff:", first)
        except Exception:
            print(name, attention, "FAILED:")
            traceback.print_exc()
