"""What guided decoding costs the engine (backend/engine/guided_decoding.py), offline, one process, one run:

1. tokens/s of 64 sequences decoding together, each held to a JSON schema, against the same 64 prompts with no
   guide, alternating A/B `--rounds` times. Every sequence runs to max_tokens both ways (the unguided ones ignore
   EOS; the schema is an array of at least 50 objects, longer than max_tokens), so both sides run the same steps
   at the same batch sizes and differ only by the guides' masks and matcher updates.
2. The delay a guide adds to a request's first token: the first guided request after start (it builds
   llguidance's view of the vocabulary), then a schema never seen before, then the same schema again (cached),
   each against the same request with no guide; medians of `--trials`.

    .venv/bin/python -m load_tests.bench_guided [--model default] [--sequences 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import torch

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.guided_decoding import Guide
from backend.serving.model_store import resolve_model_dir
from backend.serving.tokenizer import encode, load_tokenizer
from load_tests.machine import cpu_summary
from load_tests.prompts import make_prompts

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
        "required": ["name", "age"], "additionalProperties": False}
LONG = {"type": "array", "items": ITEM, "minItems": 50}


def throughput(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, guide: Guide | None) -> float:
    """Output tokens per second of `prompts` decoded together, each to max_tokens."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=guide is None, guided=guide)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o) == max_tokens for o in outputs), [len(o) for o in outputs]
    return sum(map(len, outputs)) / elapsed


def first_token_seconds(engine: LLMEngine, prompt: list[int], guide: Guide | None) -> float:
    engine.add_request("ttft", prompt, SamplingParams(max_tokens=1, ignore_eos=True, guided=guide))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def fresh_schema() -> Guide:
    """A schema no request has used: its own property name."""
    schema = {**ITEM, "properties": {**ITEM["properties"], f"k{uuid.uuid4().hex[:8]}": {"type": "boolean"}}}
    return Guide("json_schema", json.dumps(schema))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args(argv)

    model = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(model)
    prompts = [encode(tokenizer, pr.text, pr.chat) for pr in make_prompts("chat", args.sequences, seed=0)]
    engine = LLMEngine(EngineConfig.create(model=str(model), max_num_seqs=args.sequences))
    print(f"{cpu_summary()}, {torch.get_num_threads()} threads, {model.name}, {args.sequences} sequences x "
          f"{args.max_tokens} tokens, torch {torch.__version__}", flush=True)

    one = prompts[0]
    first = first_token_seconds(engine, one, fresh_schema())
    plain, new, cached = [], [], []
    for _ in range(args.trials):
        plain.append(first_token_seconds(engine, one, None))
        guide = fresh_schema()
        new.append(first_token_seconds(engine, one, guide))
        cached.append(first_token_seconds(engine, one, guide))
    print(f"first token, 1 request: no guide {1e3 * statistics.median(plain):.1f} ms; first guided request after "
          f"start {1e3 * first:.0f} ms; a new schema {1e3 * statistics.median(new):.1f} ms; the same schema again "
          f"{1e3 * statistics.median(cached):.1f} ms (medians of {args.trials})", flush=True)

    guide = Guide("json_schema", json.dumps(LONG))
    throughput(engine, prompts[:4], 8, guide)  # warm: compile, first matchers
    ratios = []
    for i in range(args.rounds):
        free = throughput(engine, prompts, args.max_tokens, None)
        held = throughput(engine, prompts, args.max_tokens, guide)
        ratios.append(held / free)
        print(f"round {i + 1}: no guide {free:.1f} tok/s, JSON schema on every sequence {held:.1f} tok/s, "
              f"ratio {held / free:.3f}", flush=True)
    print(f"guided/unguided tokens per second, median of {args.rounds}: {statistics.median(ratios):.3f} "
          "(target >= 0.95)")


if __name__ == "__main__":
    main()
