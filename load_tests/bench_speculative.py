"""What `speculative: ngram | draft` gives: offline greedy tokens/s with and without it, in one run, on the same
prompts.

Three prompt sets: chat turns whose answers copy their prompt (code editing, rewriting a paragraph), code- and
list-like prompts that repeat themselves (what prompt lookup is for), and the benchmarks' seeded random prompts
(which do not). Batch 1, 4 and 16 (batches of that many prompts, one after another, until every prompt of the set
ran: batch 1 is each prompt alone in turn; 16 cycles through the set), each editing answer up to its EOS, 64 new
tokens with EOS ignored on the other sets; each
configuration once warm, then timed; the output of every speculating run is checked equal to the plain run's.
Prints tok/s, the ratio to no speculation and the acceptance rate; the CPU named.
--draft-model adds `speculative: draft` runs (`self`: the model itself, with --draft-quantization int4 a 3x cheaper
copy whose greedy picks mostly agree).

    python -m load_tests.bench_speculative [--model default|DIR] [--tokens 64] [--k 3,5] [--batches 1,4,16]
        [--sets editing,repeating,random]
        [--draft-model self|DIR --draft-quantization none|int8|int4]
"""

from __future__ import annotations

import argparse
import time

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.serving.tokenizer import encode, load_tokenizer
from load_tests.bench_offline import resolve_model
from load_tests.machine import cpu_summary
from load_tests.workload import make_workload, model_vocab

REPEATING = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
             "List the numbers from 1 to 40: 1, 2, 3, 4,",
             "<ul>\n  <li>apple</li>\n  <li>banana</li>\n  <li>cherry</li>\n",
             "SELECT id, name FROM users WHERE id = 1;\nSELECT id, name FROM users WHERE id = 2;\n"]

CODE = ("def total(items):\n    x = 0\n    for item in items:\n        x += item.price * item.quantity\n"
        "    return x\n\n\ndef average(items):\n    if not items:\n        return 0\n"
        "    return total(items) / len(items)\n")
TEXT = ("The printing press was invented by Johannes Gutenberg around 1440. It made books cheaper and faster to "
        "produce, and within fifty years presses were working in more than two hundred cities across Europe.")
CLASS = ("class Cart:\n    def __init__(self):\n        self.items = []\n\n    def add(self, item):\n"
         "        self.items.append(item)\n\n    def remove(self, item):\n        self.items.remove(item)\n\n"
         "    def count(self):\n        return len(self.items)\n")
JSON = ('{"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "known_for": ["Analytical Engine notes", '
        '"first published algorithm"], "country": "England"}')
# answers that copy their prompt (chat turns): code editing and rewriting, prompt lookup's case in vLLM's docs
EDITING = [f"Rename the variable x to subtotal in this code and give the whole code back:\n{CODE}",
           f"Fix the spelling and give the whole paragraph back:\n{TEXT.replace('invented', 'invnted')}",
           f"Add a docstring to each function and give the whole code back:\n{CODE}",
           f"Repeat this paragraph word for word, then say how many cities it names:\n{TEXT}",
           f"Rename the method count to size in this class and give the whole class back:\n{CLASS}",
           f"Add type hints to this class and give the whole class back:\n{CLASS}",
           f"Change the country to United Kingdom in this JSON and give the whole JSON back:\n{JSON}",
           f"Put this paragraph in the past perfect where it fits and give it back:\n{TEXT}"]
EDITING_TOKENS = 256  # the editing answers end where the model ends them (EOS): past it, a model writes what no
# user reads (a 64-token cut with EOS ignored had half its tokens in an invented next chat turn)


def timed(engine: LLMEngine, prompts: list[list[int]], batch: int, params: SamplingParams
          ) -> tuple[float, list[list[int]]]:
    """tok/s over batches of `batch` prompts run one after another: every prompt of a set at least once (batch 1 is
    each prompt alone in turn)."""
    engine.generate(prompts[:2], params)  # warm
    cycled = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
    start = time.perf_counter()
    outs = [out for i in range(0, len(cycled), batch) for out in engine.generate(cycled[i:i + batch], params)]
    return sum(map(len, outs)) / (time.perf_counter() - start), outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=64, help="new tokens (EOS ignored) on the repeating and random sets")
    p.add_argument("--sets", default="editing,repeating,random")
    p.add_argument("--k", default="3,5", help="num_speculative_tokens values")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--draft-model", default=None, help="self (the model) or a folder: also run speculative: draft")
    p.add_argument("--draft-quantization", default="none")
    p.add_argument("--no-ngram", action="store_true")
    args = p.parse_args()
    model = resolve_model(None if args.model == "default" else args.model)
    ks = list(map(int, args.k.split(",")))
    variants = [] if args.no_ngram else [(f"ngram k={k}", dict(speculative="ngram", num_speculative_tokens=k))
                                         for k in ks]
    if args.draft_model:
        draft = {"speculative": "draft", "draft_model": str(model if args.draft_model == "self" else args.draft_model),
                 "draft_quantization": args.draft_quantization}
        variants += [(f"draft k={k}", dict(draft, num_speculative_tokens=k)) for k in ks]
    tokenizer = load_tokenizer(model)
    vocab, special = model_vocab(model)
    fixed = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    sets = {"editing": ([encode(tokenizer, t, True) for t in EDITING], SamplingParams(max_tokens=EDITING_TOKENS)),
            "repeating": ([encode(tokenizer, t, False) for t in REPEATING], fixed),
            "random": ([r.prompt_token_ids for r in make_workload(16, vocab_size=vocab, seed=0, exclude_ids=special)],
                       fixed)}
    sets = {name: sets[name] for name in args.sets.split(",")}
    print(f"{cpu_summary()} | {model.name} | greedy, editing to EOS, else {args.tokens} new tokens | draft model: "
          f"{args.draft_model or 'none'} ({args.draft_quantization})")
    for name, (prompts, params) in sets.items():
        for batch in map(int, args.batches.split(",")):
            base_tps, base_outs = timed(LLMEngine(EngineConfig.create(model=str(model))), prompts, batch, params)
            line = f"{name:9} batch {batch:2}: none {base_tps:7.1f} tok/s"
            for label, settings in variants:
                engine = LLMEngine(EngineConfig.create(model=str(model), **settings))
                tps, outs = timed(engine, prompts, batch, params)
                assert outs == base_outs, f"{label} changed the output"
                rate = engine.num_accepted_tokens / max(engine.num_draft_tokens, 1)
                line += f" | {label} {tps:7.1f} tok/s ({tps / base_tps:.2f}x, {100 * rate:.0f} % of drafts accepted)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
