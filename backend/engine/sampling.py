"""Sampling parameters and the batched sampler.

Greedy rows (temperature 0) are one batched argmax. Random rows draw from their own `torch.Generator`, seeded
from (the sequence's seed, the token's position): a request with a seed yields the same tokens whatever else is in
the batch, and whether or not speculation drafted them (speculation.py samples each verified position with the draw
it would have made without).
Logprobs (and a prompt's, `token_logprobs`) are those of the model's raw distribution (log_softmax of the logits before
a guide's mask, penalties and temperature), as vLLM and TensorRT-LLM report them by default; a row with
`top_logprobs` N also gets that distribution's N likeliest (token id, logprob) pairs, likeliest first.

Order per row, as in vLLM: a guide's mask (guided_decoding.py), penalties, banned ids, temperature, min_p,
top-k, top-p, then the draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.engine.errors import InvalidRequestError
from backend.engine.guided_decoding import GrammarState, Guide, apply_masks
from backend.engine.kernels.cpu_kernels import argmax, loaded

NO_TOKEN = -1  # sample()'s token for a guided row that allows none (its grammar, min_tokens and bad words)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_SAMPLES = 16  # n: samples of one request


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p x the likeliest's probability; 0: off
    seed: int | None = None
    repetition_penalty: float = 1.0  # HF semantics, over prompt and output
    presence_penalty: float = 0.0  # OpenAI semantics, over output
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences that must not be generated
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # report the N likeliest tokens of each step, with their logprobs; 0: off
    prompt_logprobs: int | None = None  # report each prompt token's logprob and its N likeliest (vLLM's); None: off
    n: int = 1  # samples of the prompt, each its own sequence (sample i's seed: seed + i)
    guided: Guide | None = None

    def validate(self, vocab_size: int) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 1 <= self.n <= MAX_SAMPLES:
            raise InvalidRequestError("n", f"must be in [1, {MAX_SAMPLES}], got {self.n}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got "
                                                         f"{self.prompt_logprobs}")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("bad_words_ids", [t for w in self.bad_words_ids for t in w])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(name, f"token ids outside [0, {vocab_size}): {bad[:5]}")
        if any(len(w) == 0 for w in self.bad_words_ids):
            raise InvalidRequestError("bad_words_ids", "empty word")
        if self.guided is not None:
            self.guided.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class SamplingState:
    """Per-sequence sampler state: the seed of the generator that makes seeded sampling batch-independent (drawn at
    creation when the request names none; None for greedy), and the matcher of a guided request. The generator
    lives where the logits do (CPU or GPU) and is made there on first use."""

    seed: int | None = None
    grammar: GrammarState | None = None
    _generator: torch.Generator | None = None

    @property
    def ready(self) -> bool:
        """Whether the sequence may be scheduled: its grammar, if any, has compiled."""
        return self.grammar is None or self.grammar.ready

    @classmethod
    def create(cls, params: SamplingParams) -> "SamplingState":
        if params.greedy:
            return cls()
        return cls(seed=params.seed if params.seed is not None else torch.Generator().seed())

    def generator(self, device: torch.device, position: int) -> torch.Generator:
        """The generator for the token at `position` of the sequence, seeded from (seed, position)."""
        if self._generator is None:
            self._generator = torch.Generator(device)
        return self._generator.manual_seed(hash((self.seed, position)) & (2**63 - 1))


@dataclass
class Sampled:
    """sample()'s pick for one row: the token (NO_TOKEN for a guided row that allows none), its logprob when the row
    asks for `logprobs`, and its `top_logprobs` likeliest (token id, logprob) pairs, likeliest first (else empty)."""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SamplerRow:
    """What the sampler needs to know about one sequence this step."""

    params: SamplingParams
    state: SamplingState
    prompt_ids: list[int]
    output_ids: list[int]
    banned_ids: list[int] = field(default_factory=list)  # eos/stop ids under min_tokens, bad-word tails

    @property
    def position(self) -> int:
        """The position of the token this row picks (output_ids: a verified position's include the drafts before it)."""
        return len(self.prompt_ids) + len(self.output_ids)


def _apply_penalties(logits: torch.Tensor, row: SamplerRow) -> None:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if row.output_ids and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.unique(torch.tensor(row.output_ids, dtype=torch.long, device=logits.device),
                                   return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows of logits [R, V], each scaled by its temperature, with its min_p, top-k and top-p applied (dropped tokens
    at -inf): batched over the rows (a row with a filter off is left as it is)."""
    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]

    logits = logits / column([p.temperature for p in params])
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < column([p.min_p for p in params]) * probs.max(-1, keepdim=True).values,
                                    float("-inf"))
    V = logits.shape[-1]
    ks = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    if any(ks):
        values = torch.topk(logits, max(ks), dim=-1).values
        kth = values.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=logits.device)[:, None])
        kth = kth.masked_fill(column(ks) == 0, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        logits = _top_p(logits, column([p.top_p for p in params]))
    return logits


TOP_P_PREFIXES = (256, 4096)  # the likeliest tokens _top_p looks for a row's nucleus among, before a full sort


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest set of likeliest tokens whose probability reaches its top_p [R, 1] (and every token tied
    with the last of them), the rest at -inf; a row with top_p 1 as it is. The set is looked for among the likeliest
    256, then 4,096 tokens (torch.topk), sorting the whole row only where it reaches past them: a real model's nucleus
    rarely does, and sorting 16 rows of a 128k vocabulary took 75 ms (2-core Xeon, 2026-12-06), where the 1B model's
    whole decode step at 16 rows took 112."""
    probs = torch.softmax(logits, dim=-1)
    on = top_p < 1.0
    for k in (*(k for k in TOP_P_PREFIXES if k < probs.shape[-1]), probs.shape[-1]):
        whole = k == probs.shape[-1]
        likeliest = (torch.sort(probs, dim=-1, descending=True) if whole else torch.topk(probs, k, dim=-1)).values
        kept = (likeliest.cumsum(-1) - likeliest < top_p) | ~on  # the mass of the likelier ones short of top_p
        if whole or not kept[:, -1:][on].any():  # every row's set ends inside the prefix
            break
    count = kept.long().cumprod(-1).sum(-1, keepdim=True).clamp(min=1)  # 0: a row of NaN (a guide allowed nothing)
    last = likeliest.gather(1, count - 1)  # the set's least likely token
    return logits.masked_fill((probs < last) & on, float("-inf"))


def _top_logprobs(raw_logprobs: torch.Tensor, tokens: list[int], rows: list[SamplerRow]
                  ) -> list[list[tuple[int, float]]]:
    """Each row's `top_logprobs` likeliest (token id, logprob) pairs: one topk over the rows that ask."""
    asking = [i for i, (t, r) in enumerate(zip(tokens, rows)) if r.params.top_logprobs and t != NO_TOKEN]
    tops: list[list[tuple[int, float]]] = [[] for _ in rows]
    if asking:
        k = min(max(rows[i].params.top_logprobs for i in asking), raw_logprobs.shape[-1])
        values, ids = torch.topk(raw_logprobs[asking], k, dim=-1)
        for i, row_ids, row_values in zip(asking, ids.tolist(), values.tolist()):
            n = rows[i].params.top_logprobs
            tops[i] = list(zip(row_ids[:n], row_values[:n]))
    return tops


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int, rows_per_pass: int = 256) -> list[Sampled]:
    """The logprob of `tokens[i]` under row i of `logits` [N, V], with that row's `top` likeliest (token id, logprob)
    pairs (a prompt's logprobs). A pass takes `rows_per_pass` rows: a long chunk's log_softmax is not held whole."""
    out: list[Sampled] = []
    for a in range(0, len(tokens), rows_per_pass):
        logprobs = torch.log_softmax(logits[a:a + rows_per_pass].float(), dim=-1)
        ids = torch.tensor(tokens[a:a + rows_per_pass], dtype=torch.long)
        picked = logprobs.gather(1, ids[:, None])[:, 0].tolist()
        if top:
            values, top_ids = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
        else:
            tops = [[] for _ in picked]
        out += [Sampled(t, lp, tp) for t, lp, tp in zip(ids.tolist(), picked, tops)]
    return out


def _draw(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row of filtered logits [R, V] draws a token by its uniform in [0, 1) [R]: the first token whose
    cumulative probability passes the uniform times the row's sum (inverse transform), never one at -inf. On the CPU
    kernels/draw.cpp, else torch ops (_inverse_transform). One random number a row: the exponential race (argmax of
    probs over Exp(1) noise) drew one per token, ~3 ms a row of a 128k vocabulary (2-core Xeon, 2026-12-06)."""
    if logits.device.type == "cpu" and loaded():
        return torch.ops.llm_kernels.draw_rows(logits.contiguous(), uniforms)
    return _inverse_transform(torch.softmax(logits, dim=-1), uniforms)


def _inverse_transform(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """_draw on probabilities [R, V], in torch ops (the sums in float64)."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:].contiguous()
    pick = torch.searchsorted(cdf, uniforms[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total)  # the last token of any probability: where the sum reaches its total
    return torch.minimum(pick, last)[:, 0].clamp(max=probs.shape[-1] - 1)  # a row of NaN (no token allowed): any


def sample(logits: torch.Tensor, rows: list[SamplerRow]) -> list[Sampled]:
    """Pick one token per row of `logits` [S, V] (float32, on the CPU or the GPU), with the logprobs each row asks
    for. The picks (and their logprobs) reach the host in one copy."""
    logits = logits.float()
    want_logprobs = any(r.params.logprobs or r.params.top_logprobs for r in rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    processed = logits
    guided = {i: r.state.grammar for i, r in enumerate(rows) if r.state.grammar is not None}
    if guided or any(r.params.penalized or r.banned_ids for r in rows):
        processed = logits.clone()
        if guided:
            apply_masks(processed, guided)
        for i, row in enumerate(rows):
            if row.params.penalized:
                _apply_penalties(processed[i], row)
            if row.banned_ids:
                processed[i, row.banned_ids] = float("-inf")
    picks = argmax(processed)
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if drawn:
        filtered = _filter(processed if len(drawn) == len(rows) else processed[drawn], [rows[i].params for i in drawn])
        uniforms = torch.cat([torch.rand(1, dtype=torch.float64, device=filtered.device,
                                         generator=rows[i].state.generator(filtered.device, rows[i].position))
                              for i in drawn])  # one a row, seeded by the row's sequence and position
        picks[drawn] = _draw(filtered, uniforms)
    columns = [picks]
    if guided:  # a row whose every token is masked or banned picks one at -inf: it has none
        columns.append(processed.gather(1, picks[:, None])[:, 0])
    if raw_logprobs is not None:
        columns.append(raw_logprobs.gather(1, picks[:, None])[:, 0])
    host = torch.stack([c.double() for c in columns]).tolist()  # the one copy (float64 holds every id exactly)
    tokens = [int(t) for t in host[0]]
    if guided:
        for i in guided:
            if host[1][i] == float("-inf"):
                tokens[i] = NO_TOKEN
    if raw_logprobs is None:
        return [Sampled(t) for t in tokens]
    picked = host[-1]
    return [Sampled(t, picked[i] if r.params.logprobs and t != NO_TOKEN else None, top)
            for i, (t, r, top) in enumerate(zip(tokens, rows, _top_logprobs(raw_logprobs, tokens, rows)))]
