"""llama.cpp side of bench_scale: runs in .venv-llamacpp (load_tests/llama_cpp_env.sh), never imported by the main
venv. For each point (batch B, prompt length P): B random prompts of P tokens prefilled (llama_decode batches of up to
512 tokens, as llama-server fills a slot's prompt), then `steps` decode steps of one token for each of the B sequences
(one llama_decode each, greedy picks from the logits), timed apart. The same protocol as bench_scale's engine side.

    .venv-llamacpp/bin/python -m load_tests.llamacpp_scale_runner --gguf FILE --points '[[1, 128], [16, 128]]' \
        --steps 32 --threads 2 --out report.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

N_BATCH = 512  # tokens per llama_decode: our engine's max_num_batched_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--points", required=True, help="JSON [[batch, prompt_len], ...]")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    import llama_cpp as L

    L.llama_backend_init()
    model = L.llama_model_load_from_file(args.gguf.encode(), L.llama_model_default_params())
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    rng = np.random.default_rng(args.seed)
    results = []
    for batch_size, prompt_len in [(1, 16), *json.loads(args.points)]:  # the first: a warm-up, not reported
        cparams = L.llama_context_default_params()
        cparams.n_ctx = batch_size * (prompt_len + args.steps + 16)
        cparams.n_batch = cparams.n_ubatch = N_BATCH
        cparams.n_seq_max = batch_size
        cparams.n_threads = cparams.n_threads_batch = args.threads
        cparams.kv_unified = False  # a KV stream per sequence, as llama-server's slots
        ctx = L.llama_init_from_model(model, cparams)
        batch = L.llama_batch_init(max(N_BATCH, batch_size), 0, 1)

        def decode(tokens: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits?)
            batch.n_tokens = len(tokens)
            for n, (tok, pos, seq, logits) in enumerate(tokens):
                batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = tok, pos, 1, int(logits)
                batch.seq_id[n][0] = seq
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

        def pick(index: int) -> int:
            return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, index), shape=(vocab,)).argmax())

        prompts = rng.integers(100, min(vocab, 32000), (batch_size, prompt_len)).tolist()
        feed = [(tok, pos, seq, pos == prompt_len - 1) for seq, prompt in enumerate(prompts)
                for pos, tok in enumerate(prompt)]
        start = time.perf_counter()
        last: list[int] = []
        for i in range(0, len(feed), N_BATCH):
            chunk = feed[i:i + N_BATCH]
            decode(chunk)
            last += [pick(j) for j, t in enumerate(chunk) if t[3]]
        prefill_s = time.perf_counter() - start
        steps_s = []
        for step in range(args.steps):
            start = time.perf_counter()
            decode([(tok, prompt_len + step, seq, True) for seq, tok in enumerate(last)])
            last = [pick(j) for j in range(batch_size)]
            steps_s.append(time.perf_counter() - start)
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        results.append({"batch": batch_size, "prompt_len": prompt_len, "prefill_s": prefill_s,
                        "decode_step_s": statistics.median(steps_s)})
    L.llama_model_free(model)
    report = {"points": results[1:], "system_info": L.llama_print_system_info().decode()}
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
