"""LLMEngine: the one loop. schedule -> one forward over a flat batch -> sample -> scheduler.update.

Single-threaded by design: callers that serve requests from several threads (backend/serving/
engine_thread.py) hand requests to the thread that calls `step()`. Every state change after a step
(computed tokens, newly full blocks into the prefix cache, finish rules, freeing) is the scheduler's.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import FIRST_COMPLETED, wait
from collections.abc import Callable
from collections.abc import Sequence as PromptIds
from dataclasses import dataclass

import numpy as np
import torch

from backend.engine.batch import build_model_input
from backend.engine.config import EngineConfig
from backend.engine.cpu_share import CpuShare
from backend.engine.draft_model import DraftModel
from backend.engine.errors import InvalidRequestError, UnknownRequestError
from backend.engine.guided_decoding import GUIDE_FIELD, GrammarCompiler, GrammarState
from backend.engine.kv_cache import KVCacheManager, bytes_per_block
from backend.engine.kv_quantization import row_bytes
from backend.engine.kv_transfer import ExportedKV, read_blocks, write_blocks
from backend.engine.lora import LoraAdapter, LoraBatch, LoraRegistry, parse_lora_modules
from backend.engine.models.checkpoint_format import served_quantization
from backend.engine.models.config import ModelConfig, load_model_config
from backend.engine.runners.base import Runner, torch_dtype
from backend.engine.runners.factory import create_runner
from backend.engine.sampling import (NO_TOKEN, Sampled, SamplerRow, SamplingParams, SamplingState, sample,
                                    token_logprobs)
from backend.engine.scheduler import Scheduler, SchedulerOutput
from backend.engine.speculation import accepted_tokens
from backend.engine.step_load import StepLoad, step_load
from backend.engine.sequence import FinishReason, Sequence


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float | None]
    new_top_logprobs: list[list[tuple[int, float]]]  # per new token, likeliest first; empty lists when not asked
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # of the prompt, reused from the prefix cache (OpenAI's usage.cached_tokens)
    error: Exception | None = None  # with finish_reason "error": the request's error, for its front door
    index: int = 0  # the sample (n > 1)
    request_finished: bool = False  # the request's last sample has finished (`finished` with n = 1)
    # with the first token of a request that asks for them (of sample 0): the logprob of prompt tokens 1, 2, ...
    # given the tokens before (the first has none), each with its `prompt_logprobs` likeliest alternatives
    prompt_logprobs: list[Sampled] | None = None

    @classmethod
    def of(cls, seq: Sequence, picks: list[Sampled], request_finished: bool = False) -> RequestOutput:
        first = bool(picks) and len(seq.output_token_ids) == 1 and seq.params.prompt_logprobs is not None
        return cls(request_id=seq.sample_of or seq.request_id, new_token_ids=[p.token for p in picks],
                   new_logprobs=[p.logprob for p in picks], new_top_logprobs=[p.top_logprobs for p in picks],
                   finished=seq.finish_reason is not None,
                   finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                   num_prompt_tokens=len(seq.prompt_token_ids), num_output_tokens=len(seq.output_token_ids),
                   num_cached_tokens=seq.num_cached_tokens, error=seq.error, index=seq.index,
                   request_finished=request_finished, prompt_logprobs=seq.prompt_logprobs if first else None)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    last_step_tokens: int
    num_draft_tokens: int = 0  # speculative tokens verified so far, and accepted
    num_accepted_tokens: int = 0
    drafted_by_position: tuple[int, ...] = ()  # [j]: drafts at position j + 1 of their step verified, and accepted
    accepted_by_position: tuple[int, ...] = ()
    lora_resident: int = 0  # LoRA adapters loaded now; loads and evictions so far; requests per adapter so far
    lora_loads: int = 0
    lora_evictions: int = 0
    lora_requests: tuple[tuple[str, int], ...] = ()
    last_step: StepLoad = StepLoad()  # what the last step computed and what waited (Dynamo's forward-pass metrics)
    cpu_threads: int = 0  # threads the CPU forward runs on now (cpu_share.py); 0: the engine does not set them


def kv_pool_blocks(config: EngineConfig, model_cfg: ModelConfig) -> int:
    """Blocks in the KV pool: `num_kv_blocks`, or as many as `kv_cache_memory_gb` holds."""
    cache = config.cache
    return cache.num_blocks(bytes_per_block(model_cfg.num_layers, cache.block_size, model_cfg.num_kv_heads,
                                            row_bytes(model_cfg.head_dim, torch_dtype(config.dtype),
                                                      cache.kv_cache_dtype)))


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: Runner | None = None):
        # what serves the model, resolved once here: `auto` is the weights as shipped (a GGUF as stored, a quantized
        # checkpoint by its method), a quantized checkpoint's own quantization where its config.json names one
        served = served_quantization(config.model, config.quantization, config.runtime, config.device)
        config = self.config = dataclasses.replace(config, quantization=served)
        model_cfg = load_model_config(config.model)
        cache = config.cache
        num_blocks = kv_pool_blocks(config, model_cfg)
        self.runner = runner or create_runner(config, num_blocks)
        self.cpu_share = CpuShare.start() if (config.runtime, config.device) == ("torch", "cpu") else None
        if self.cpu_share is not None:
            self.cpu_share.idle()  # until its first step: what others do meanwhile (a server starting) does not count
        self.model_config = model_cfg
        self.max_model_len = min(config.scheduler.max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings, num_blocks * cache.block_size)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, cache.enable_kv_events,
                                 model_cfg.max_window)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, model_cfg.eos_token_ids,
                                   self._draft_model(num_blocks) if config.draft_model else None)
        self.requests: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # finals of aborted requests, sent by the next step
        self._arrivals = 0
        self._last_step_tokens = 0
        self._last_step = StepLoad()
        self._in_step = False  # a step's forward is in flight (cut_in is allowed)
        self._grammars: GrammarCompiler | None = None  # built by the first guided request
        self._compiling: dict[str, Sequence] = {}  # guided requests whose grammar has not compiled yet
        self._samples: dict[str, set[str]] = {}  # request id -> its unfinished samples' ids (requests with n > 1)
        self.num_draft_tokens = 0  # speculative tokens verified, and accepted (speculation.py)
        self.num_accepted_tokens = 0
        self.drafted_by_position = [0] * config.scheduler.num_speculative_tokens  # [j]: the step's (j + 1)-th draft
        self.accepted_by_position = [0] * config.scheduler.num_speculative_tokens
        self.loras = LoraRegistry(model_cfg, torch_dtype(config.dtype), config.max_loras, config.max_lora_rank)
        for name, path in parse_lora_modules(config.lora_modules).items():
            try:
                self.loras.register(name, path, set())
            except ValueError as e:
                raise ValueError(f"lora_modules: {e}") from None

    def _draft_model(self, num_blocks: int) -> DraftModel:
        """`speculative: draft`: the draft model on the torch runtime, with a pool of as many blocks as the model's."""
        from backend.engine.runners.torch_runner import TorchRunner

        c = self.config
        runner = TorchRunner(c.draft_model, c.dtype, num_blocks, c.cache.block_size, c.device, c.attention,
                             "auto", c.draft_quantization, c.cache.kv_cache_dtype)
        return DraftModel(self.model_config.vocab_size, runner, c.cache.block_size, c.q_tile)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: PromptIds[int],
                    sampling_params: SamplingParams | None = None, priority: int = 0,
                    tenant: str | None = None, cache_salt: str | None = None, lora_name: str | None = None) -> None:
        """Queue a request. Raises InvalidRequestError (naming the field) or QueueFullError. Its prompt shares cached
        KV blocks only with requests of the same `cache_salt` (and tenant, by `prefix_cache_scope`) and the same
        LoRA adapter (`lora_name`, loaded before: `lora_modules`, `load_lora`; none: the base model)."""
        params = sampling_params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        if self.has_request(request_id):
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        if not prompt:
            raise InvalidRequestError("prompt_token_ids", "the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InvalidRequestError("prompt_token_ids", f"token ids must be in [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError("prompt_token_ids", f"the prompt has {len(prompt)} tokens; the context "
                                      f"length is {self.max_model_len} (room for one output token is needed)")
        params.validate(vocab)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError("max_tokens", f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) "
                                      f"exceeds the context length {self.max_model_len}")
        quota = self.scheduler.quota(tenant)
        if quota and quota.max_blocks is not None and \
                self.kv.blocks_for(len(prompt) + params.max_tokens) > quota.max_blocks:
            raise InvalidRequestError("max_tokens", f"prompt + max_tokens exceed tenant {tenant!r}'s KV quota")
        lora = self._lora(lora_name)
        salt = self.cache_salt(tenant, cache_salt)
        if params.n == 1:
            self._add_sequence(request_id, prompt, params, priority, tenant, salt, lora=lora)
            return
        # n samples, each a sequence; the first computes the prompt (and its logprobs, when asked), the others wait
        # for it and take its blocks from the prefix cache. Sample i's seed is seed + i (vLLM's rule): each is
        # reproducible alone.
        ids, leader = [f"{request_id}/{i}" for i in range(params.n)], None
        try:
            for i, sample_id in enumerate(ids):
                sample = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                                             prompt_logprobs=params.prompt_logprobs if i == 0 else None)
                seq = self._add_sequence(sample_id, prompt, sample, priority, tenant, salt, sample_of=request_id,
                                         index=i, prefill_leader=leader, lora=lora)
                leader = leader or seq
        except Exception:
            for sample_id in ids[:i]:  # all or none
                self.finish(sample_id, FinishReason.CANCELLED)
            raise
        self._samples[request_id] = set(ids)

    def _add_sequence(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int,
                      tenant: str | None, salt: str | None, **sample) -> Sequence:
        state = SamplingState.create(params)
        if params.guided is not None:
            state.grammar = GrammarState(self.grammars, self.grammars.compile(params.guided), self._stop_ids(params))
            if (err := state.grammar.error) is not None:  # known bad (compiled before): refused now
                raise InvalidRequestError(err.field, err.reason) if isinstance(err, InvalidRequestError) else \
                    RuntimeError(f"guided decoding failed: {err!r}")
        seq = Sequence(request_id, prompt, params, arrival_index=self._arrivals, priority=priority, tenant=tenant,
                       sampling_state=state, cache_salt=salt, **sample)
        self.scheduler.add(seq)
        if state.grammar is not None and not state.grammar.done:
            self._compiling[request_id] = seq
        self._arrivals += 1
        self.requests[request_id] = seq
        return seq

    def _lora(self, name: str | None) -> LoraAdapter | None:
        """The adapter a new request names (loaded again if it was evicted), or None for the base model."""
        if name is None:
            return None
        try:
            return self.loras.acquire(name, self._loras_in_use())
        except (KeyError, ValueError) as e:
            raise InvalidRequestError("lora_name", e.args[0]) from None

    def _loras_in_use(self) -> set[str]:
        return {seq.lora.name for seq in self.requests.values() if seq.lora is not None}

    def load_lora(self, name: str, path: str) -> None:
        """Load (or replace) the PEFT LoRA adapter at `path` as `name` (vLLM's /v1/load_lora_adapter). Raises
        InvalidRequestError naming what is wrong; replacing an adapter that unfinished requests use is refused."""
        if why := self.config.torch_cpu_only("adapters are"):
            raise InvalidRequestError("lora_path", why)
        try:
            self.loras.register(name, path, self._loras_in_use())
        except ValueError as e:
            raise InvalidRequestError("lora_path", e.args[0]) from None

    def unload_lora(self, name: str) -> None:
        """Forget an adapter; refused (InvalidRequestError) while unfinished requests use it: they are not cut short."""
        try:
            self.loras.unregister(name, self._loras_in_use())
        except (KeyError, ValueError) as e:
            raise InvalidRequestError("lora_name", e.args[0]) from None

    def lora_of_task(self, task_id: int) -> str:
        """The name of the adapter with tensorrtllm_backend's `lora_task_id` (1, 2, ... in the order loaded)."""
        try:
            return self.loras.name_of_task(task_id)
        except KeyError as e:
            raise InvalidRequestError("lora_task_id", e.args[0]) from None

    def list_loras(self) -> dict[str, str]:
        """Adapter name -> its folder."""
        return dict(self.loras.paths)

    def has_request(self, request_id: str) -> bool:
        """Whether a request (a sequence, or a request of n samples) has not finished."""
        return request_id in self.requests or request_id in self._samples

    def sample_id(self, request_id: str, index: int) -> str:
        """The engine id of sample `index` of a request (the request's own id when it has one sample)."""
        return f"{request_id}/{index}" if request_id in self._samples else request_id

    @property
    def grammars(self) -> GrammarCompiler:
        """The guides' compiler, built by the first guided request (engines without any never load it)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.config.model, self.model_config.vocab_size)
        return self._grammars

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids that end a request's output: its stop ids, and EOS unless ignored. A guided output ends only
        through them once its guide is complete, or through the model's EOS where they are none."""
        ids = params.stop_token_ids + (() if params.ignore_eos else self.model_config.eos_token_ids)
        return ids or (self.model_config.eos_token_ids if params.guided is not None else ())

    def abort(self, request_id: str) -> None:
        """Cancel a request (all its samples): its blocks are freed now, its final outputs come with the next
        step()."""
        self._pending += self.end(request_id, FinishReason.CANCELLED)

    def end(self, request_id: str, reason: FinishReason) -> list[RequestOutput]:
        """End a request now, all its samples; their final outputs (with no new tokens), which the caller reports."""
        return [self.finish(sample_id, reason) for sample_id in sorted(self._samples.get(request_id, [request_id]))]

    def finish(self, request_id: str, reason: FinishReason) -> RequestOutput:
        """End a sequence (a request, or one sample of one) now, freeing its blocks; returns its final output (with
        no new tokens), which the caller reports."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            raise UnknownRequestError(request_id)
        self._compiling.pop(request_id, None)
        self.scheduler.finish(seq, reason)
        return RequestOutput.of(seq, [], self._last_of_request(seq))

    def _last_of_request(self, seq: Sequence) -> bool:
        """Called once a sequence has finished (and left `requests`): whether it was its request's last."""
        samples = self._samples.get(seq.sample_of)
        if samples is None:
            return True
        samples.discard(seq.request_id)
        if samples:
            return False
        del self._samples[seq.sample_of]
        return True

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        seq.error = error
        return self.finish(seq.request_id, FinishReason.ERROR)

    def cache_salt(self, tenant: str | None, cache_salt: str | None) -> str | None:
        """The salt of a request's block hashes: its own `cache_salt`, behind its tenant's name where the prefix
        cache is scoped by tenant; None (shared by all) for neither. (A LoRA adapter's digest enters them apart.)"""
        scoped = tenant if self.config.cache.prefix_cache_scope == "tenant" else None
        if scoped is None:
            return cache_salt
        return f"tenant={scoped}" + ("" if cache_salt is None else f"\x00{cache_salt}")

    def export_kv(self, token_ids: list[int], salt: str | None = None) -> ExportedKV:
        """A copy of the K/V of the longest cached run of `token_ids`' full blocks (after a prefill ran them), under
        `salt` (`cache_salt()`)."""
        block_ids = self.kv.cached_prefix_blocks(token_ids, salt)
        return ExportedKV(len(block_ids) * self.kv.block_size, self.kv.block_size,
                          read_blocks(self.runner.kv_cache, block_ids))

    def import_kv(self, token_ids: list[int], kv: ExportedKV, salt: str | None = None) -> int:
        """Enter K/V exported by another engine for `token_ids`' leading full blocks into the prefix cache;
        a request for these tokens then computes only the rest. Returns the tokens now cached."""
        cache = self.runner.kv_cache
        expected = (cache.shape[0], 2, kv.num_blocks, *cache.shape[3:])
        if kv.block_size != self.kv.block_size or tuple(kv.data.shape) != expected or kv.data.dtype != cache.dtype:
            raise InvalidRequestError("kv", f"blocks of shape {list(kv.data.shape)} {kv.data.dtype} do not fit this "
                                            f"pool ({list(expected)} {cache.dtype}, block_size {self.kv.block_size})")
        tokens = token_ids[:kv.num_tokens]
        return self.kv.block_size * self.kv.import_prefix(
            tokens, lambda positions, block_ids: write_blocks(cache, block_ids, kv.data[:, :, positions]), salt)

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._pending)

    @property
    def fills_the_cpus(self) -> bool:
        """Whether a step's forward runs on every CPU this process may use (a CPU runtime with a thread per CPU):
        then any other work of the process stretches the step (backend/serving/engine_thread.py)."""
        return self.config.device == "cpu" and torch.get_num_threads() >= len(os.sched_getaffinity(0))

    # -- the loop -------------------------------------------------------------------------------

    def step(self, between_layers: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One step. `between_layers`, when given, is called between the model's layers (by the runners that run
        layer by layer: PyTorch); the serving loop admits arrivals there and may run `cut_in()`."""
        try:
            return self._step(between_layers)
        finally:
            if self.cpu_share is not None and not self.has_unfinished():
                self.cpu_share.idle()

    def _step(self, between_layers: Callable[[], None] | None) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        for seq in [s for s in self._compiling.values() if s.sampling_state.grammar.done]:
            del self._compiling[seq.request_id]
            if (error := seq.sampling_state.grammar.error) is not None:
                outputs.append(self._fail(seq, error))
        if not self.scheduler.has_work():
            return outputs
        sched = self.scheduler.schedule()
        self._last_step_tokens = sched.num_tokens
        self._last_step = step_load(sched.scheduled, self.scheduler.waiting)
        if not sched.scheduled:
            if self._compiling and not outputs:  # nothing to run until a grammar compiles: wait for one, briefly
                wait([s.sampling_state.grammar.pending for s in self._compiling.values()], timeout=0.01,
                     return_when=FIRST_COMPLETED)
            return outputs
        if self.cpu_share is not None:
            self.cpu_share.update()
        self._in_step = True
        try:
            return outputs + self._run(sched, between_layers)
        finally:
            self._in_step = False

    def cut_in(self) -> list[RequestOutput]:
        """Called between the layers of a step in flight: runs the first chunk of a waiting sequence of a light
        tenant (Scheduler._heavier_tenant) as a step of its own, now, instead of after the step in flight (which
        on a small CPU beside a flood takes 3x such a request's whole solo TTFT). Its outputs; [] when there is
        none, it would need a preemption, or a step already had its cut-in (Scheduler.schedule_cut_in)."""
        if not self._in_step:
            raise RuntimeError("cut_in() runs only between the layers of a step in flight")
        sched = self.scheduler.schedule_cut_in()
        return self._run(sched, None) if sched else []

    def _run(self, sched: SchedulerOutput, between_layers: Callable[[], None] | None) -> list[RequestOutput]:
        """Forward, sample and update for a scheduled batch; its outputs."""
        if any(seq.lora is not None for seq, _ in sched.scheduled):  # each adapter's rows together (lora.LoraBatch)
            sched.scheduled.sort(key=lambda item: (item[0].lora is not None, item[0].lora and item[0].lora.name))
        batch = build_model_input(sched.scheduled, self.kv.block_size, self.config.q_tile,
                                  [n if seq.wants_prompt_logprobs else 1 + len(seq.draft_token_ids)
                                   for seq, n in sched.scheduled])
        batch.lora = LoraBatch.of([seq.lora for seq, _ in sched.scheduled], batch.query_start)
        logits = self.runner.forward(batch, between_layers)
        for i, (seq, n) in enumerate(sched.scheduled):
            if seq.wants_prompt_logprobs:
                self._prompt_logprobs(seq, logits[batch.logits_start[i]:batch.logits_start[i + 1]])
        # the sequences that yield tokens this step: those whose chunk reaches their last token (drafts beyond it)
        sampled = [i for i, (seq, n) in enumerate(sched.scheduled)
                   if seq.num_computed_tokens + n == seq.num_tokens + len(seq.draft_token_ids)]
        drafted = [i for i in sampled if sched.scheduled[i][0].draft_token_ids]
        plain = [i for i in sampled if not sched.scheduled[i][0].draft_token_ids]
        rows = [self._sampler_row(sched.scheduled[i][0]) for i in plain]
        last_rows = batch.logits_start[1:] - 1
        index = last_rows[np.asarray(plain, dtype=np.int64)]
        identity = len(index) == len(logits) and (index == np.arange(len(index))).all()  # a decode step's: no copy
        picks = sample(logits if identity else logits[index], rows) if rows else []
        dead = [sched.scheduled[i][0] for i, pick in zip(plain, picks) if pick.token == NO_TOKEN]
        tokens = {i: [pick] for i, pick in zip(plain, picks) if pick.token != NO_TOKEN}
        if drafted:  # every verified position sampled as it would be without speculation (speculation.py)
            verify_rows = np.concatenate([np.arange(batch.logits_start[i], batch.logits_start[i + 1]) for i in drafted])
            drafts = [sched.scheduled[i][0].draft_token_ids for i in drafted]
            positions = [self._sampler_row(sched.scheduled[i][0], d[:j]) for i, d in zip(drafted, drafts)
                         for j in range(len(d) + 1)]
            verified = sample(logits[verify_rows], positions)
            start = np.cumsum([0] + [len(d) + 1 for d in drafts])
            for i, row, draft, accepted in zip(drafted, start, drafts,
                                               accepted_tokens([v.token for v in verified], drafts)):
                picks = verified[row:row + len(accepted)]  # the accepted drafts are the picks at their positions
                if picks[-1].token == NO_TOKEN:  # a guide that allows nothing after the accepted drafts
                    picks.pop()
                if not picks:
                    dead.append(sched.scheduled[i][0])
                    continue
                tokens[i] = picks
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += len(accepted) - 1
                for j in range(len(draft)):
                    self.drafted_by_position[j] += 1
                    self.accepted_by_position[j] += j < len(accepted) - 1
        outputs = []
        for seq, picked in self.scheduler.update_from_output(sched, tokens):
            last = False
            if seq.finish_reason is not None:
                del self.requests[seq.request_id]
                last = self._last_of_request(seq)
            outputs.append(RequestOutput.of(seq, picked, last))
        return outputs + [self._fail(seq, InvalidRequestError(
            GUIDE_FIELD, f"no token is allowed after {len(seq.output_token_ids)} output tokens (the guide, "
                         "min_tokens and bad_words leave none)")) for seq in dead]

    @staticmethod
    def _prompt_logprobs(seq: Sequence, logits: torch.Tensor) -> None:
        """Add the prompt logprobs a chunk's logits [n, V] give (row j, at position computed + j, predicts the token
        after it), from the first not yet known: a chunk recomputed after a preemption adds none twice."""
        computed, prompt = seq.num_computed_tokens, seq.prompt_token_ids
        first = len(seq.prompt_logprobs) + 1  # the next prompt position to find a logprob for
        targets = range(max(first, computed + 1), min(len(prompt), computed + len(logits) + 1))
        if targets:
            seq.prompt_logprobs += token_logprobs(logits[targets.start - 1 - computed:targets.stop - 1 - computed],
                                                  prompt[targets.start:targets.stop], seq.params.prompt_logprobs)

    def _sampler_row(self, seq: Sequence, drafted: list[int] = ()) -> SamplerRow:
        """The sampler's view of a sequence that yields a token this step (after `drafted`, when it verifies drafts),
        with the ids it may not pick: eos/stop ids before min_tokens, and the last token of a bad word whose prefix
        was just generated."""
        p = seq.params
        output = seq.output_token_ids + list(drafted) if drafted else seq.output_token_ids
        banned = []
        if len(output) < p.min_tokens:
            banned += self._stop_ids(p)
        tokens = seq.prompt_token_ids + output if p.bad_words_ids else []
        for word in p.bad_words_ids:
            prefix = list(word[:-1])
            if not prefix or tokens[len(tokens) - len(prefix):] == prefix:
                banned.append(word[-1])
        state = seq.sampling_state
        if drafted and state.grammar is not None:
            state = dataclasses.replace(state, grammar=state.grammar.after(list(drafted)))
        return SamplerRow(p, state, seq.prompt_token_ids, output, banned)

    # -- conveniences -----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        """Offline batch generation: all prompts in flight at once; returns output ids in order."""
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        ids = [f"generate-{self._arrivals + i}" for i in range(len(prompts))]
        for rid, prompt, params in zip(ids, prompts, sampling_params):
            self.add_request(rid, prompt, params)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self.requests for rid in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_free=self.kv.num_free_blocks,
            kv_blocks_cached=self.kv.num_cached_blocks,
            prefix_cache_hit_rate=self.kv.stats.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            last_step_tokens=self._last_step_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            drafted_by_position=tuple(self.drafted_by_position),
            accepted_by_position=tuple(self.accepted_by_position),
            lora_resident=len(self.loras.resident),
            lora_loads=self.loras.num_loads,
            lora_evictions=self.loras.num_evictions,
            lora_requests=tuple(sorted(self.loras.requests.items())),
            last_step=self._last_step,
            cpu_threads=self.cpu_share.threads if self.cpu_share is not None else 0,
        )
