"""llama.cpp side of bench_quantization's `llamacpp` run: runs in .venv-llamacpp (load_tests/llama_cpp_env.sh), never
imported by the main venv. Teacher-forces token ids through a GGUF file as llama.cpp computes it: the perplexity of
`text`, and the argmax after each position of `sequences` from its `starts` on (the main venv compares them with
float32's greedy outputs).

    .venv-llamacpp/bin/python -m load_tests.llamacpp_quality --job job.json --out report.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

N_BATCH = 512


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", type=Path, required=True)  # {"gguf", "threads", "text", "sequences", "starts"}
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    job = json.loads(args.job.read_text())

    import llama_cpp as L

    L.llama_backend_init()
    model = L.llama_model_load_from_file(job["gguf"].encode(), L.llama_model_default_params())
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cparams = L.llama_context_default_params()
    cparams.n_ctx = max(len(t) for t in [job["text"], *job["sequences"]])
    cparams.n_batch = cparams.n_ubatch = N_BATCH
    cparams.n_threads = cparams.n_threads_batch = job["threads"]
    ctx = L.llama_init_from_model(model, cparams)
    batch = L.llama_batch_init(N_BATCH, 0, 1)

    def logits(tokens: list[int]) -> np.ndarray:
        """[len(tokens), vocab]: the logits after each token, one sequence from an empty cache."""
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        rows = []
        for start in range(0, len(tokens), N_BATCH):
            chunk = tokens[start:start + N_BATCH]
            batch.n_tokens = len(chunk)
            for j, tok in enumerate(chunk):
                batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = tok, start + j, 1, 1
                batch.seq_id[j][0] = 0
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            rows += [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, j), shape=(vocab,)).copy()
                     for j in range(len(chunk))]
        return np.stack(rows)

    text = job["text"]
    x = logits(text)[:-1].astype(np.float64)
    log_softmax = x - x.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    nll = -log_softmax[np.arange(len(text) - 1), text[1:]].mean()
    argmax = [logits(seq)[start - 1:-1].argmax(-1).tolist() for seq, start in zip(job["sequences"], job["starts"])]
    args.out.write_text(json.dumps({"perplexity": float(np.exp(nll)), "argmax": argmax,
                                    "llama_cpp": L.__version__}))


if __name__ == "__main__":
    main()
