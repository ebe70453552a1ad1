"""LLMEngine: the one loop. schedule -> one forward over a flat batch -> sample -> outputs.

Single-threaded by design: callers that serve requests from several threads (the Triton `llm`
model) hand requests to the thread that calls `step()`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from backend.batch import build_model_input
from backend.kv_cache import KVCacheManager, bytes_per_block
from backend.models.llama import load_model_config
from backend.runners.base import Runner, torch_dtype
from backend.sampling import InvalidRequestError, SamplerRow, SamplingParams, SamplingState, sample
from backend.scheduler import AdmissionPolicy, Scheduler, SchedulerConfig, TenantQuota
from backend.sequence import FinishReason, Sequence


class UnknownRequestError(KeyError):
    def __str__(self) -> str:
        return f"request_id: no unfinished request {self.args[0]!r}"


@dataclass
class EngineConfig:
    model: str  # HF safetensors folder
    dtype: str = "float32"
    runtime: str = "torch"  # torch | onnxruntime | tensorrt
    device: str = "cpu"
    attention: str = "auto"  # torch runtime: kernel (CPU C++) | gather (the exported graph) | auto
    engine_dir: str | None = None  # compiled graph / plan for onnxruntime and tensorrt
    block_size: int = 16
    num_kv_blocks: int | None = None  # else from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's, capped by the KV pool
    enable_prefix_caching: bool = True
    admission_policy: AdmissionPolicy = "max_utilization"
    max_waiting: int = 1024
    tenant_quotas: dict[str, TenantQuota] = field(default_factory=dict)
    q_tile: int = 16  # attention row width for prefill chunks (see backend/batch.py)

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "EngineConfig":
        """From string settings (config.pbtxt `parameters`); unknown keys are an error naming the key."""
        from build_engine.prepare_model import resolve_model_dir

        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict = {}
        for key, text in params.items():
            if key not in fields or key == "tenant_quotas":
                raise ValueError(f"{key}: not an engine setting (known: {sorted(fields)})")
            kind = str(fields[key].type)
            if text.strip().lower() in ("", "none") and "None" in kind:
                kwargs[key] = None
            elif kind.startswith("bool"):
                kwargs[key] = text.strip().lower() in ("1", "true", "yes", "on")
            elif kind.startswith("int"):
                kwargs[key] = int(text)
            elif kind.startswith("float"):
                kwargs[key] = float(text)
            else:
                kwargs[key] = text
        kwargs["model"] = str(resolve_model_dir(kwargs.get("model", "default")))
        return cls(**kwargs)

    def num_blocks(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        per_block = bytes_per_block(num_layers, self.block_size, num_kv_heads, head_dim,
                                    torch_dtype(self.dtype).itemsize)
        return max(1, int(self.kv_cache_memory_gb * 2**30) // per_block)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float | None]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int


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


def create_runner(config: EngineConfig, num_blocks: int) -> Runner:
    if config.runtime == "torch":
        from backend.runners.torch_runner import TorchRunner

        return TorchRunner(config.model, config.dtype, num_blocks, config.block_size, config.device,
                           config.attention)
    if config.attention == "kernel":
        raise ValueError(f"attention: the kernel is for runtime torch; {config.runtime} runs the gather graph")
    if config.runtime == "onnxruntime":
        from backend.runners.onnx_runner import OnnxRunner, check_supported
        from build_engine.export_onnx import cached_engine_dir

        check_supported(config.device, config.dtype)  # before minutes of export
        engine_dir = config.engine_dir or cached_engine_dir(config.model, config.dtype)
        return OnnxRunner(engine_dir, config.model, config.dtype, num_blocks, config.block_size, config.device)
    if config.runtime == "tensorrt":
        if config.engine_dir is None:
            raise ValueError("engine_dir: runtime tensorrt needs a built plan "
                             "(python -m build_engine --runtime tensorrt --output DIR)")
        from backend.runners.tensorrt_runner import TensorRTRunner

        return TensorRTRunner(config.engine_dir, config.model, config.dtype, num_blocks, config.block_size,
                              max_num_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                              q_tile=config.q_tile, max_model_len=config.max_model_len, device=config.device)
    raise ValueError(f"runtime: unknown runtime {config.runtime!r} (expected torch, onnxruntime or tensorrt)")


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: Runner | None = None):
        self.config = config
        model_cfg = load_model_config(config.model)
        num_blocks = config.num_blocks(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.runner = runner or create_runner(config, num_blocks)
        self.model_config = model_cfg
        self.max_model_len = min(config.max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings, num_blocks * config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            admission_policy=config.admission_policy,
            max_waiting=config.max_waiting,
            tenant_quotas=config.tenant_quotas,
        ), self.kv)
        self.requests: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # finals of aborted requests, sent by the next step
        self._arrivals = 0
        self._last_step_tokens = 0

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], sampling_params: SamplingParams | None = None,
                    priority: int = 0, tenant: str | None = None) -> None:
        """Queue a request. Raises InvalidRequestError (naming the field) or QueueFullError."""
        params = sampling_params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        if request_id in self.requests:
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
        seq = Sequence(request_id, prompt, params, arrival_index=self._arrivals, priority=priority, tenant=tenant,
                       sampling_state=SamplingState.create(params))
        self.scheduler.add(seq)
        self._arrivals += 1
        self.requests[request_id] = seq

    def abort(self, request_id: str) -> None:
        """Cancel a request: its blocks are freed now, its final output comes with the next step()."""
        seq = self.finish(request_id, FinishReason.CANCELLED)
        self._pending.append(self._output(seq, [], []))

    def finish(self, request_id: str, reason: FinishReason) -> Sequence:
        """End a request now, freeing its blocks, without emitting an output (the caller reports it)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            raise UnknownRequestError(request_id)
        self.scheduler.remove(seq)
        seq.finish_reason = reason
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._pending)

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if not self.scheduler.has_work():
            return outputs
        sched = self.scheduler.schedule()
        self._last_step_tokens = sched.num_tokens
        if not sched.scheduled:
            return outputs
        batch = build_model_input(sched.scheduled, self.kv.block_size, self.config.q_tile)
        logits = self.runner.forward(batch)

        rows, row_seqs, row_index = [], [], []
        for i, (seq, n) in enumerate(sched.scheduled):
            seq.num_computed_tokens += n
            self.kv.cache_computed_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:  # caught up: this step yields its next token
                rows.append(SamplerRow(seq.params, seq.sampling_state, seq.prompt_token_ids,
                                       seq.output_token_ids, self._banned_ids(seq)))
                row_seqs.append(seq)
                row_index.append(i)
        if not rows:
            return outputs
        tokens, logprobs = sample(logits[np.asarray(row_index)], rows)
        now = time.monotonic()
        for seq, token, logprob in zip(row_seqs, tokens, logprobs):
            seq.append_token(token, logprob, now)
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.finish_reason is not None:
                self.scheduler.remove(seq)
                del self.requests[seq.request_id]
            outputs.append(self._output(seq, [token], [logprob]))
        return outputs

    def _banned_ids(self, seq: Sequence) -> list[int]:
        p = seq.params
        banned = []
        if len(seq.output_token_ids) < p.min_tokens:
            banned += list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.model_config.eos_token_ids))
        tokens = seq.token_ids
        for word in p.bad_words_ids:
            prefix = list(word[:-1])
            if not prefix or tokens[len(tokens) - len(prefix):] == prefix:
                banned.append(word[-1])
        return banned

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        n = len(seq.output_token_ids)
        if n >= p.min_tokens and (token in p.stop_token_ids or
                                  (not p.ignore_eos and token in self.model_config.eos_token_ids)):
            return FinishReason.STOP
        if n >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _output(seq: Sequence, tokens: list[int], logprobs: list[float | None]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
        )

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
        )
