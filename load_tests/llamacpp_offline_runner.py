"""llama.cpp side of bench_offline: runs in .venv-llamacpp (load_tests/llama_cpp_env.sh), never imported by the main
venv. Serves a GGUF file as llama-server does: `streams` slots over one context, each step one `llama_decode` of a
batch holding every decoding slot's next token plus, while the budget allows, the prompts of newly filled slots
(continuous batching); greedy picks from the logits. A closed loop: a slot that finishes takes the next request.

Writes JSON: the timing (output ids included), time to first token per request, the settings and the peak RSS.

    .venv-llamacpp/bin/python -m load_tests.llamacpp_offline_runner --gguf FILE --workload w.json --threads 2 \
        --streams 16 --out report.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

N_BATCH = 512  # tokens per llama_decode: our engine's max_num_batched_tokens
N_CTX_PER_SLOT = 512  # prompts <= 256 + outputs <= 128


@dataclass
class Slot:
    seq_id: int
    request: int = -1  # index into the workload, -1: free
    tokens: list[int] = field(default_factory=list)  # fed so far (prompt + outputs)
    pending: list[int] = field(default_factory=list)  # to feed in the next batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    import llama_cpp as L

    from load_tests.bench_offline import Progress, peak_rss_mib, timed_run
    from load_tests.workload import Request, load_workload

    L.llama_backend_init()
    model = L.llama_model_load_from_file(args.gguf.encode(), L.llama_model_default_params())
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cparams = L.llama_context_default_params()
    cparams.n_ctx = N_CTX_PER_SLOT * args.streams
    cparams.n_batch = cparams.n_ubatch = N_BATCH
    cparams.n_seq_max = args.streams
    cparams.n_threads = cparams.n_threads_batch = args.threads
    cparams.kv_unified = False  # a KV stream per slot, as llama-server (a unified cache attends over all of it)
    ctx = L.llama_init_from_model(model, cparams)
    memory = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(N_BATCH, 0, 1)
    first_token_s: list[float] = []

    def generate(requests: list[Request], progress: Progress) -> list[list[int]]:
        outputs: list[list[int]] = [[] for _ in requests]
        waiting = list(range(len(requests)))[::-1]
        slots = [Slot(i) for i in range(min(args.streams, len(requests)))]
        submitted: dict[int, float] = {}

        def fill(slot: Slot) -> None:
            slot.request = waiting.pop()
            slot.tokens, slot.pending = [], list(requests[slot.request].prompt_token_ids)
            submitted[slot.request] = time.perf_counter()

        for slot in slots:
            fill(slot)
        while any(s.request >= 0 for s in slots):
            batch.n_tokens, budget, picks = 0, N_BATCH, []
            for slot in sorted((s for s in slots if s.request >= 0), key=lambda s: len(s.pending)):  # decodes first
                take = slot.pending[:budget]
                if not take:
                    continue
                for j, tok in enumerate(take):
                    n = batch.n_tokens
                    batch.token[n], batch.pos[n], batch.n_seq_id[n] = tok, len(slot.tokens) + j, 1
                    batch.seq_id[n][0] = slot.seq_id
                    batch.logits[n] = int(j == len(slot.pending) - 1)  # the prompt's (or output's) last token
                    batch.n_tokens += 1
                slot.tokens += take
                slot.pending = slot.pending[len(take):]
                budget -= len(take)
                if not slot.pending:
                    picks.append((slot, batch.n_tokens - 1))
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            now = time.perf_counter()
            for slot, index in picks:
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, index), shape=(vocab,))
                token = int(logits.argmax())
                out = outputs[slot.request]
                if not out:
                    first_token_s.append(now - submitted[slot.request])
                out.append(token)
                if len(out) < requests[slot.request].max_tokens:
                    slot.pending = [token]
                    continue
                progress.update()
                L.llama_memory_seq_rm(memory, slot.seq_id, -1, -1)
                slot.request = -1
                if waiting:
                    fill(slot)
        return outputs

    requests = load_workload(args.workload)
    timing = timed_run(generate, requests, f"llama.cpp x{args.streams}", args.threads)
    timed_first = first_token_s[-len(requests):]  # the warm-up's are before these
    settings = {"gguf": Path(args.gguf).name, "streams": args.streams, "n_batch": N_BATCH, "threads": args.threads,
                "system_info": L.llama_print_system_info().decode(),
                "ttft_ms_median": round(1000 * statistics.median(timed_first), 1)}
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    report = {"timing": asdict(timing), "peak_rss_mib": peak_rss_mib(), "settings": settings}
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
