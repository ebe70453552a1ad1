"""python -m client "Write a haiku about GPUs" --stream   (prints text as it arrives, then latency stats)

Structured output: --json, --json-schema FILE, --regex RE, --choice A --choice B, --grammar FILE.
Log probabilities: --top-logprobs N (each new token's N likeliest), --prompt-logprobs N (each prompt token's), as
token ids and logprobs on stderr after the text."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from client.client import LLMClient

# outputs whose values each response adds to (the others: the last response's value stands)
ACCUMULATED = ("output_log_probs", "output_top_logprobs", "output_top_logprob_ids", "output_prompt_logprobs",
               "output_prompt_top_logprobs", "output_prompt_top_logprob_ids")


def guided_inputs(args: argparse.Namespace) -> dict[str, str]:
    """guided_decoding_guide_type / guided_decoding_guide from the CLI's guide flags (none: no guide)."""
    if args.json:
        return {"guided_decoding_guide_type": "json"}
    for kind, spec in (("json_schema", args.json_schema and args.json_schema.read_text()), ("regex", args.regex),
                       ("choice", args.choice and json.dumps(args.choice)),
                       ("ebnf_grammar", args.grammar and args.grammar.read_text())):
        if spec:
            return {"guided_decoding_guide_type": kind, "guided_decoding_guide": spec}
    return {}


def print_logprobs(label: str, first: int, logprobs: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray
                   ) -> None:
    """One line per token (numbered from `first`): its logprob, then its likeliest alternatives as id:logprob."""
    width = top_ids.size // max(logprobs.size, 1)
    for i, logprob in enumerate(logprobs):
        alternatives = " ".join(f"{t}:{lp:.3f}" for t, lp in zip(top_ids[i * width:(i + 1) * width],
                                                                 top_logprobs[i * width:(i + 1) * width]))
        print(f"{label} {first + i}: {logprob:.4f}" + (f" | {alternatives}" if alternatives else ""), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client", description=__doc__)
    p.add_argument("prompt")
    p.add_argument("--url", default="localhost:8001", help="gRPC host:port (default %(default)s)")
    p.add_argument("--model", default="llm", help="llm | llm_bls | ensemble (default %(default)s: text in one hop; "
                   "llm and llm_bls stop generating when the client goes away, the ensemble does not in Triton 2.51)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--min-p", type=float)
    p.add_argument("--stream-interval", type=int, metavar="N",
                   help="after the first token, one response per N tokens (default: the server's)")
    p.add_argument("--lora", metavar="NAME", help="the LoRA adapter to run with (one the llm loaded: lora_modules)")
    p.add_argument("-n", type=int, default=1, help="samples of the prompt (printed one by one at the end when > 1)")
    p.add_argument("--top-logprobs", type=int, metavar="N", help="print each new token's logprob and N likeliest")
    p.add_argument("--prompt-logprobs", type=int, metavar="N", help="print each prompt token's logprob and N likeliest")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt with the model's chat template (default on)")
    guide = p.add_mutually_exclusive_group()
    guide.add_argument("--json", action="store_true", help="the output is a JSON object")
    guide.add_argument("--json-schema", type=Path, metavar="FILE", help="the output validates against this schema")
    guide.add_argument("--regex", help="the output matches this regular expression")
    guide.add_argument("--choice", action="append", help="the output is one of these (repeatable)")
    guide.add_argument("--grammar", type=Path, metavar="FILE", help="the output parses with this GBNF/Lark grammar")
    args = p.parse_args(argv)

    options = dict(max_tokens=args.max_tokens, stream=args.stream, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop_words=args.stop,
                   apply_chat_template=args.chat_template, exclude_input_in_output=True, return_num_output_tokens=True,
                   return_finish_reason=True, num_return_sequences=args.n if args.n > 1 else None,
                   top_logprobs=args.top_logprobs, return_log_probs=args.top_logprobs is not None or None,
                   prompt_logprobs=args.prompt_logprobs, stream_interval=args.stream_interval, lora_name=args.lora,
                   **guided_inputs(args))
    client = LLMClient(args.url, args.model)
    start = time.monotonic()
    times, outputs, samples = [], {}, {}
    added: dict[str, list[np.ndarray]] = {name: [] for name in ACCUMULATED}
    chunks = client.stream(args.prompt, **options)
    try:
        for chunk in chunks:
            if chunk.text and args.n > 1:
                index = int(chunk.outputs["sequence_index"].reshape(-1)[0])
                samples[index] = samples.get(index, "") + chunk.text
            elif chunk.text:
                print(chunk.text, end="", flush=True)
            if chunk.text:
                times.append(chunk.time)
            outputs.update(chunk.outputs)
            for name in ACCUMULATED:
                if name in chunk.outputs:
                    added[name].append(chunk.outputs[name].reshape(-1))
        for index in sorted(samples):
            print(f"[{index}] {samples[index]}")
    except KeyboardInterrupt:
        chunks.close()  # sends the `stop` for this request
        print("\n[cancelled]", file=sys.stderr)
        return 130
    finally:
        client.close()
    print(flush=True)
    values = {name: np.concatenate(arrays) if arrays else np.empty(0) for name, arrays in added.items()}
    if args.prompt_logprobs is not None:
        print_logprobs("prompt token", 2, values["output_prompt_logprobs"], values["output_prompt_top_logprob_ids"],
                       values["output_prompt_top_logprobs"])
    if args.top_logprobs is not None:
        print_logprobs("token", 1, values["output_log_probs"], values["output_top_logprob_ids"],
                       values["output_top_logprobs"])
    elapsed = time.monotonic() - start
    n = int(outputs["num_output_tokens"].reshape(-1)[0]) if "num_output_tokens" in outputs else len(times)
    reason = outputs["finish_reason"].reshape(-1)[0].decode() if "finish_reason" in outputs else "?"
    itl = [b - a for a, b in zip(times, times[1:])]
    stats = [f"{n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s)", f"finish: {reason}"]
    if times:
        stats.insert(0, f"TTFT {1000 * (times[0] - start):.0f} ms")
    if itl:
        stats.insert(1, f"ITL mean {1000 * statistics.fmean(itl):.1f} ms")
    print(" | ".join(stats), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
