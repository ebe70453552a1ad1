"""vLLM side of bench_offline: runs in .venv-vllm, never imported by the main venv.

Reads a workload JSON (load_tests.workload), loads `vllm.LLM`, warms up, times one
`generate` over all requests (EOS ignored, each with its own max_tokens) and writes a
JSON report with the timing (output ids included), the settings used and the peak RSS of
its process tree (vLLM runs its engine core and worker in child processes).

    .venv-vllm/bin/python -m load_tests.vllm_offline_runner --model DIR --dtype float32 \
        --workload w.json --threads 2 --out report.json
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

# KV cache: the default is 4 GiB; 2 GiB holds all 64 requests at once for both models and dtypes
# (SmolLM2 in fp32 needs ~46 KiB per token, 64 x 384 tokens ~ 1.1 GiB).
KV_CACHE_GIB = 2
MAX_MODEL_LEN = 512  # prompts <= 256 + outputs <= 128 (the models' own 2048/8192 only cost warm-up)


def cpu_env(threads: int) -> dict[str, str]:
    """vLLM CPU variables: KV cache size, and `threads` OpenMP threads bound to cores 0..threads-1.

    The default binding, "auto", reserves one core per rank for vLLM's scheduler process, which on
    a 2-core box leaves a single compute thread; the benchmark gives every system the same threads.
    A step may take longer than vLLM's 300 s RPC timeout: bfloat16 on a CPU without avx512_bf16 (AMD Zen 3)
    prefilled 4,096 tokens in one step for over 300 s, and the engine died (TimeoutError) at 64 requests.
    """
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3600",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    env = cpu_env(args.threads)
    os.environ.update(env)  # before vllm reads its environment

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from load_tests.bench_offline import Progress, peak_rss_mib, timed_run
    from load_tests.workload import Request, load_workload

    llm_args = {"dtype": args.dtype, "max_model_len": MAX_MODEL_LEN, "skip_tokenizer_init": True, "seed": 0}
    llm = LLM(model=args.model, **llm_args)

    def generate(batch: list[Request], progress: Progress) -> list[list[int]]:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in batch],
            [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
             for r in batch],
            use_tqdm=not progress.quiet,
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    requests = load_workload(args.workload)
    timing = timed_run(generate, requests, f"vllm {args.dtype}", args.threads)
    sched = llm.llm_engine.vllm_config.scheduler_config
    settings = {**env, **llm_args, "max_num_seqs": sched.max_num_seqs,
                "max_num_batched_tokens": sched.max_num_batched_tokens}
    report = {"timing": asdict(timing), "peak_rss_mib": peak_rss_mib(), "settings": settings}
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
