"""Structured-output (guided decoding) shoot-out: xgrammar vs llguidance vs outlines-core.

One tokenizer (the project's default model, SmolLM2-135M-Instruct); masks are config.json
`vocab_size` (49152) wide, not len(tokenizer). Per library: 1. tokenizer setup; 2. compile ms
(cold / repeat of the same spec, i.e. cache / first mask of a fresh matcher) for any JSON object,
4 JSON schemas (+ s2 without maxLength), 2 regexes, a 3-way choice, an arithmetic grammar;
3. per step at batch 64 on s2 with and without maxLength, advanced by one valid instance + EOS:
fill a [64, V/32] int32 bitmask, accept a token in all 64 matchers (batch APIs where they exist),
apply the mask to [64, V] float32 logits; 4. seeded random walks (uniform over allowed tokens,
<= 200 steps, EOS once the library says it can end) checked by json.loads + jsonschema;
5. keyword screens: refused / enforced / SILENT (invalid instance accepted, token by token).
JSON is compact everywhere so walks can end: xgrammar any_whitespace=False + (",", ":"),
llguidance whitespace_flexible=false, outlines-core whitespace_pattern="".

    .venv/bin/python -m load_tests.bench_grammar_libs [--threads 1] [--batch 64] [--walks 10]
        [--seed 0] [--libs xgrammar,llguidance,outlines-core] [--json FILE]
Install: requirements-bench.txt (xgrammar goes in with --no-deps, see the comment there).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jsonschema
import torch
from transformers import AutoTokenizer

Schema = dict[str, Any]


def s(n: int) -> Schema:
    return {"type": "string", "maxLength": n}  # bounded strings: otherwise random walks never end


def obj(props: Schema, required: list[str] | None = None) -> Schema:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


def no_maxlen(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: no_maxlen(v) for k, v in x.items() if k != "maxLength"}
    return [no_maxlen(v) for v in x] if isinstance(x, list) else x


SCHEMAS: dict[str, Schema] = {
    "s1_flat": obj({"name": s(16), "age": {"type": "integer"}, "active": {"type": "boolean"}}),
    "s2_nested": obj({"id": {"type": "integer"}, "user": obj({"name": s(16), "email": s(24)}),
                      "tags": {"type": "array", "items": s(8), "minItems": 1, "maxItems": 3}}),
    "s3_enum_range_pattern": obj({"color": {"enum": ["red", "green", "blue"]},
                                  "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                                  "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                  "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}),
    "s4_anyof_optional_ref": {"$defs": {"point": obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
                              **obj({"kind": {"enum": ["circle", "label"]},
                                     "center": {"$ref": "#/$defs/point"},
                                     "value": {"anyOf": [{"type": "integer"}, s(12), {"type": "null"}]},
                                     "note": s(12), "extra": {"$ref": "#/$defs/point"}}, ["kind", "center"])},
}
S2_INSTANCE = {"id": 4217, "user": {"name": "Alice Smith", "email": "alice.smith@example.com"},
               "tags": ["admin", "beta", "eu-west"]}
ARITH_EBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n' \
             'factor ::= number | "(" expr ")"\nnumber ::= [0-9]+'
ARITH_LARK = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: factor (("*" | "/") factor)*\n' \
             'factor: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/'
SPECS: list[tuple[str, str, Any]] = [
    ("any_object", "json", {"type": "object"}), *((k, "json", v) for k, v in SCHEMAS.items()),
    ("s2_nested_nomaxlen", "json", no_maxlen(SCHEMAS["s2_nested"])), ("re_phone", "regex", r"\d{3}-\d{4}"),
    ("re_email", "regex", r"[a-z0-9._%+-]{1,20}@[a-z0-9-]{1,20}\.[a-z]{2,6}"),
    ("choice3", "regex", r"(red wine|green tea|blue cheese)"), ("arith_grammar", "grammar", None)]
STEP_SPECS = ("s2_nested", "s2_nested_nomaxlen")
SCREENS: dict[str, tuple[Schema, Any, Any]] = {  # schema, valid instance, invalid instance
    "oneOf": (obj({"v": {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}}),
              {"v": -3}, {"v": 5}),
    "not": (obj({"v": {"type": "string", "maxLength": 8, "not": {"enum": ["bad"]}}}), {"v": "ok"},
            {"v": "bad"}),
    "uniqueItems": (obj({"v": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}),
                    {"v": [1, 2]}, {"v": [1, 1]}),
    "format:email": (obj({"v": {"type": "string", "format": "email"}}), {"v": "a.b@example.com"},
                     {"v": "no email"}),
    "format:date-time": (obj({"v": {"type": "string", "format": "date-time"}}), {"v": "2024-01-02T03:04:05Z"},
                         {"v": "yesterday"}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, {"x_a": 1}, {"x_a": "s"}),
}
_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 bitmask -> [B, V] bool (bit j of word w = token 32*w+j)."""
    return ((mask.unsqueeze(-1) >> _SHIFTS) & 1).bool().view(mask.shape[0], -1)[:, :vocab]


def torch_apply(logits: torch.Tensor, mask: torch.Tensor) -> None:
    logits.masked_fill_(~unpack(mask, logits.shape[1]), float("-inf"))


class Lib:
    """One library behind a common face: compile -> matcher(s); batch fill / accept; can_stop."""
    apply_note = "torch unpack bits + masked_fill_"

    def compile(self, kind: str, spec: Any) -> Any: raise NotImplementedError
    def matcher(self, compiled: Any) -> Any: raise NotImplementedError
    def fill(self, ms: list[Any], mask: torch.Tensor) -> None: raise NotImplementedError
    def accept(self, ms: list[Any], toks: list[int]) -> list[bool]: raise NotImplementedError
    def can_stop(self, m: Any) -> bool: raise NotImplementedError

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None: torch_apply(logits, mask)


class XGrammar(Lib):
    apply_note = "xgr.apply_token_bitmask_inplace (CPU)"

    def __init__(self, tok: Any, vocab: int, threads: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)  # model vocab = mask width
        self.comp = xgr.GrammarCompiler(info, max_threads=threads)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "json":  # strict_mode=False: plain JSON-Schema meaning ({"type":"object"} = any object)
            return self.comp.compile_json_schema(spec, any_whitespace=False, separators=(",", ":"),
                                                 strict_mode=False)
        return self.comp.compile_regex(spec) if kind == "regex" else self.comp.compile_grammar(ARITH_EBNF)

    def matcher(self, compiled: Any) -> Any: return self.xgr.GrammarMatcher(compiled)
    def fill(self, ms: list[Any], mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, mask)
    def accept(self, ms: list[Any], toks: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, toks)
    def can_stop(self, m: Any) -> bool: return bool(m.is_completed())
    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, mask)


class LLGuidance(Lib):
    def __init__(self, tok: Any, vocab: int, threads: int) -> None:
        import llguidance.hf
        import llguidance.torch
        self.llg, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.ex = llguidance.LLExecutor(num_threads=threads)

    def compile(self, kind: str, spec: Any) -> Any:  # "compiled" = grammar string; LLMatcher() compiles it
        M = self.llg.LLMatcher
        g = (M.grammar_from_json_schema(spec, overrides={"whitespace_flexible": False}) if kind == "json"
             else M.grammar_from_regex(spec) if kind == "regex" else M.grammar_from_lark(ARITH_LARK))
        self.matcher(g)
        return g

    def matcher(self, compiled: Any) -> Any:  # one LLMatcher per request, as a server would
        m = self.llg.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():  # LLMatcher never raises on grammar errors: it enters an error state
            raise ValueError(m.get_error())
        return m

    def fill(self, ms: list[Any], mask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(self.ex, [(m, i) for i, m in enumerate(ms)], mask)
    def accept(self, ms: list[Any], toks: list[int]) -> list[bool]:
        return self.llt.consume_token_par(self.ex, list(zip(ms, toks)))
    def can_stop(self, m: Any) -> bool: return bool(m.is_accepting())


class OutlinesCore(Lib):
    def __init__(self, tok: Any, vocab: int, threads: int) -> None:
        import outlines_core as oc
        bs = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2 bytes_to_unicode, inverted
        dec = {chr(c): b for b, c in zip([*bs, *(b for b in range(256) if b not in bs)],
                                         [*bs, *range(256, 324)])}
        self.oc, self.eos, m = oc, int(tok.eos_token_id), {}  # type: ignore[var-annotated]
        for piece, i in tok.get_vocab().items():  # as from_pretrained: no added/special tokens, no EOS
            if i not in tok.added_tokens_decoder and i < vocab:
                m.setdefault(bytes(dec[c] for c in piece), []).append(i)
        self.vocab = oc.Vocabulary(self.eos, m)

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "grammar":
            raise NotImplementedError("n/a (regex only, no CFG)")
        rx = self.oc.json_schema.build_regex_from_schema(json.dumps(spec), whitespace_pattern="") \
            if kind == "json" else spec
        return self.oc.Index(rx, self.vocab)

    def matcher(self, compiled: Any) -> Any: return self.oc.Guide(compiled)

    def fill(self, ms: list[Any], mask: torch.Tensor) -> None:  # no batch API: one row at a time
        words, base = mask.shape[1], mask.data_ptr()
        for i, g in enumerate(ms):
            g.write_mask_into(base + 4 * words * i, words, 4)

    def accept(self, ms: list[Any], toks: list[int]) -> list[bool]:
        out = []
        for g, t in zip(ms, toks):
            try:  # EOS is in a final state's mask, but advance(EOS) raises: treat EOS there as the stop
                if not (t == self.eos and g.is_finished()):
                    g.advance(t, False)
                out.append(True)
            except ValueError:
                out.append(False)
        return out

    def can_stop(self, m: Any) -> bool: return bool(m.is_finished())


def timed(f: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = f()
    return (time.perf_counter() - t0) * 1e3, r


def feed(lib: Lib, m: Any, toks: list[int], words: int) -> int:
    """Advance m token by token, each first checked in the mask; index of the first refusal or -1."""
    mask = torch.empty((1, words), dtype=torch.int32)
    for i, t in enumerate(toks):
        lib.fill([m], mask)
        if not (int(mask[0, t // 32]) >> (t % 32)) & 1 or not lib.accept([m], [t])[0]:
            return i
    return -1


def step_bench(lib: Lib, c: Any, seq: list[int], batch: int, vocab: int) -> dict[str, Any]:
    ms = [lib.matcher(c) for _ in range(batch)]
    mask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    fills, accs, keep = [], [], mask.clone()
    for i, t in enumerate(seq):
        fills.append(timed(lambda: lib.fill(ms, mask))[0])
        keep = mask.clone() if i == len(seq) // 2 else keep
        dt, ok = timed(lambda: lib.accept(ms, [t] * batch))
        accs.append(dt)
        assert all(ok), f"batch accept failed at step {i}"
    logits = torch.randn(batch, vocab)
    app = statistics.median(timed(lambda: lib.apply(logits, keep))[0] for _ in range(20))
    ref = statistics.median(timed(lambda: torch_apply(logits, keep))[0] for _ in range(20))
    p90 = lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))]  # noqa: E731
    return {"fill_med_ms": statistics.median(fills), "fill_p90_ms": p90(fills), "fill_sum_ms": sum(fills),
            "accept_med_ms": statistics.median(accs), "accept_p90_ms": p90(accs), "apply_med_ms": app,
            "apply_how": lib.apply_note, "torch_apply_med_ms": ref, "fills_ms": fills}


def walk(lib: Lib, c: Any, eos: int, vocab: int, rng: random.Random) -> tuple[list[int], bool]:
    """Uniform random allowed tokens until can_stop, then EOS. Returns (tokens, ended with EOS accepted)."""
    m, mask, out = lib.matcher(c), torch.empty((1, (vocab + 31) // 32), dtype=torch.int32), []
    for _ in range(200):
        lib.fill([m], mask)
        bits = unpack(mask, vocab)[0]
        if lib.can_stop(m):
            return out, bool(bits[eos]) and lib.accept([m], [eos])[0]
        allowed = [t for t in bits.nonzero().flatten().tolist() if t != eos]
        if not allowed:
            break
        out.append(rng.choice(allowed))
        if not lib.accept([m], [out[-1]])[0]:
            break
    return out, False


def bench(lib: Lib, tok: Any, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    words, eos, res, compiled = (vocab + 31) // 32, tok.eos_token_id, {}, {}  # type: ignore[var-annotated]
    def enc(x: Any) -> list[int]:
        return tok.encode(json.dumps(x, separators=(",", ":")), add_special_tokens=False) + [eos]

    one = torch.empty((1, words), dtype=torch.int32)
    for name, kind, spec in SPECS:  # 2. compile
        try:
            cold, compiled[name] = timed(lambda: lib.compile(kind, spec))
            warm, _ = timed(lambda: lib.compile(kind, spec))
            m = lib.matcher(compiled[name])
            first, _ = timed(lambda: lib.fill([m], one))
            res[f"compile/{name}"] = {"cold_ms": cold, "warm_ms": warm, "first_mask_ms": first}
        except NotImplementedError as e:
            res[f"compile/{name}"] = {"status": str(e)}
        except Exception as e:
            res[f"compile/{name}"] = {"status": f"error: {str(e)[:100]}"}
    seq = enc(S2_INSTANCE)
    for name in STEP_SPECS:  # 3. per step at batch B
        bad = feed(lib, lib.matcher(compiled[name]), seq, words)
        res[f"step/{name}"] = {"tokens": len(seq), "seq_accepted": "yes" if bad < 0 else
                               f"NO at {bad} {tok.convert_ids_to_tokens(seq[bad])!r}"}
        if bad < 0:
            res[f"step/{name}"].update(step_bench(lib, compiled[name], seq, args.batch, vocab))
    special = set(tok.added_tokens_decoder)
    for name, sch in SCHEMAS.items():  # 4. random walks
        rng, done, valid, nsp, errs = random.Random(f"{args.seed}/{name}"), 0, 0, 0, []
        for _ in range(args.walks):
            toks, ended = walk(lib, compiled[name], eos, vocab, rng)
            done, nsp = done + ended, nsp + sum(t in special for t in toks)
            try:
                jsonschema.validate(json.loads(tok.decode(toks, skip_special_tokens=False)), sch)
                valid += 1
            except Exception as e:
                errs.append(f"{type(e).__name__}: {str(e).splitlines()[0][:80]}" if ended else "unfinished")
        res[f"walk/{name}"] = {"completed": done, "valid": valid, "of": args.walks, "special": nsp,
                               "errors": errs[:3]}
    for kw, (sch, good, bad_inst) in SCREENS.items():  # 5. screens
        try:
            c = lib.compile("json", sch)
            ok_good, ok_bad = (feed(lib, lib.matcher(c), enc(x), words) < 0 for x in (good, bad_inst))
            res[f"screen/{kw}"] = ("SILENT (invalid accepted)" if ok_bad else "enforced") if ok_good \
                else "rejects valid instance"
        except Exception as e:
            res[f"screen/{kw}"] = f"refused: {' '.join(str(e).split())[:100]}"
    return res


def table(title: str, head: list[str], rows: list[list[str]]) -> None:
    w = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print(f"\n== {title}")
    for r in [head, *rows]:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())


def f1(x: Any) -> str:
    return x if isinstance(x, str) else str(x) if isinstance(x, int) else \
        f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads and the libraries' own pools")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--walks", type=int, default=10, help="random walks per library and schema")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--libs", default="xgrammar,llguidance,outlines-core")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from backend.serving.model_store import prepare_default_model
    path = Path(prepare_default_model(verbose=False))
    tok = AutoTokenizer.from_pretrained(path)
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    vers = {k: version(k) for k in ("torch", "xgrammar", "llguidance", "outlines-core", "apache-tvm-ffi")}
    print(f"CPU: {cpu} | torch threads: {torch.get_num_threads()} | library threads: {args.threads}"
          f" | batch {args.batch}")
    print("versions: " + ", ".join(f"{k} {x}" for k, x in vers.items()))
    print(f"tokenizer {path.name}: len(tokenizer)={len(tok)}, model vocab_size={vocab} (mask width), "
          f"eos={tok.eos_token_id} {tok.eos_token!r}")
    classes: dict[str, Callable[..., Lib]] = {"xgrammar": XGrammar, "llguidance": LLGuidance,
                                              "outlines-core": OutlinesCore}
    libs = [n for n in args.libs.split(",") if n]
    out: dict[str, Any] = {"cpu": cpu, "threads": args.threads, "batch": args.batch, "versions": vers}
    for n in libs:
        setup, lib = timed(lambda: classes[n](tok, vocab, args.threads))
        out[n] = {"setup_ms": setup, **bench(lib, tok, vocab, args)}
    table("1. tokenizer setup (ms)", ["", *libs], [["setup", *(f1(out[n]["setup_ms"]) for n in libs)]])
    table("2. compile ms: cold / repeat of same spec / first mask", ["spec", *libs],
          [[sp, *(" / ".join(f1(r[k]) for k in ("cold_ms", "warm_ms", "first_mask_ms")) if "cold_ms" in r
                  else r["status"][:48] for r in (out[n][f"compile/{sp}"] for n in libs))]
           for sp, _, _ in SPECS])
    keys = ("tokens", "seq_accepted", "fill_med_ms", "fill_p90_ms", "fill_sum_ms", "accept_med_ms",
            "accept_p90_ms", "apply_med_ms", "apply_how", "torch_apply_med_ms")
    table(f"3. per step, batch {args.batch} (ms for all {args.batch} rows; sum = whole sequence)",
          ["", *libs], [[f"{sp} {k}", *(f1(out[n][f"step/{sp}"].get(k, "-")) for n in libs)]
                        for sp in STEP_SPECS for k in keys])
    table(f"4. random walks x{args.walks} (<=200 tokens): completed / json+jsonschema valid / special tokens",
          ["schema", *libs], [[sn, *(f"{w['completed']}/{w['of']} done, {w['valid']}/{w['of']} valid, "
                                     f"{w['special']} sp" for w in (out[n][f"walk/{sn}"] for n in libs))]
                              for sn in SCHEMAS])
    print("\n".join(f"   {n} {sn}: {e}" for n in libs for sn in SCHEMAS
                    for e in out[n][f"walk/{sn}"]["errors"]))
    table("5. keyword screens", ["keyword", *libs],
          [[kw, *(out[n][f"screen/{kw}"][:52] for n in libs)] for kw in SCREENS])
    print("\n".join(f"   {n} {kw}: {out[n][f'screen/{kw}']}" for n in libs for kw in SCREENS
                    if out[n][f"screen/{kw}"].startswith("refused")))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
