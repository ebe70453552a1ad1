"""The engine's one settings object: EngineConfig, composed of the scheduler's and the KV cache's configs.

Each setting has one default, here. The scheduler and the cache manager read their part by reference.
Front doors build it from their own settings (strings: backend/serving/settings.py) with
`EngineConfig.create`, which routes each flat key to the part that owns it; paths come in resolved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from backend.engine.kv_quantization import KV_CACHE_DTYPES

AdmissionPolicy = Literal["max_utilization", "guaranteed_no_evict"]
ADMISSION_POLICIES = ("max_utilization", "guaranteed_no_evict")
PrefixCacheScope = Literal["tenant", "global"]
PREFIX_CACHE_SCOPES = ("tenant", "global")
SPECULATIVE = ("none", "ngram", "draft")


@dataclass(frozen=True)
class TenantQuota:
    max_running: int | None = None
    max_blocks: int | None = None


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    # ngram | draft (EngineConfig.draft_model): greedy rows verify up to num_speculative_tokens drafts a step
    # (speculation.py, draft_model.py); 5 gained at least as much as 3 in every set, batch and drafter measured
    # (docs/benchmarks-log.md, speculative decoding: Zen 5 and Xeon)
    speculative: str = "none"
    num_speculative_tokens: int = 5
    # no drafts while more sequences than this run: a larger step is compute-bound and pays for every rejected
    # draft. None: by drafter, as measured (speculation.AUTO_MAX_BATCH; docs/benchmarks-log.md, speculative decoding)
    speculative_max_batch: int | None = None
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's, capped by the KV pool
    admission_policy: AdmissionPolicy = "max_utilization"
    max_waiting: int = 256  # beyond the free running slots; more are refused "overloaded"
    tenant_quotas: dict[str, TenantQuota] = field(default_factory=dict)  # "*" applies to every named tenant

    def __post_init__(self) -> None:
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission_policy: unknown policy {self.admission_policy!r} "
                             f"(expected one of {list(ADMISSION_POLICIES)})")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting: must be >= 0, got {self.max_waiting}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative: expected one of {list(SPECULATIVE)}, got {self.speculative!r}")
        if self.speculative_max_batch is not None and self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch: must be >= 1, got {self.speculative_max_batch}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens: must be in [1, 16], got {self.num_speculative_tokens}")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # else from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False  # record prefix-cache stores/evictions for a KV-aware router
    # tenant: a tenant's requests share cached prefixes only among themselves (the tenant enters the first block's
    # hash, so no tenant can time another's prompts); global: everyone's requests share them
    prefix_cache_scope: PrefixCacheScope = "tenant"
    # auto: the model's dtype; float16 (a float32 model's; llama.cpp's default cache): 2x the tokens per GB; int8: a
    # scale per (token, KV head) row, 3.8x (kv_quantization.py)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"prefix_cache_scope: expected one of {list(PREFIX_CACHE_SCOPES)}, got "
                             f"{self.prefix_cache_scope!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")

    def num_blocks(self, bytes_per_block: int) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(1, int(self.kv_cache_memory_gb * 2**30) // bytes_per_block)


@dataclass
class EngineConfig:
    model: str  # HF safetensors folder, resolved
    dtype: str = "float32"
    runtime: str = "torch"  # torch | onnxruntime | tensorrt
    device: str = "cpu"
    attention: str = "auto"  # torch runtime: kernel (CPU C++) | triton (GPU) | gather (the exported graph) | auto
    cuda_graphs: bool = True  # torch runtime on CUDA with triton attention: decode steps replay CUDA graphs
    gemm_backend: str = "auto"  # torch runtime: auto (measured per shape) | a tactic's name (runners/gemm.py)
    # auto: the weights as shipped (the folder's GGUF as stored on the CPU, so the default model; a quantized
    # checkpoint by its method; else none). CPU: none (float) | int8 | int4 (runtime torch: rounded at load;
    # onnxruntime: the engine_dir built with it) | gguf (torch: the folder's GGUF as stored) | compressed-tensors |
    # gptq | awq (torch: an int4/int8 checkpoint as stored; its config.json sets it). CUDA (runtime torch): none |
    # int8 | int4, the same rounding (kernels/triton_linear.py)
    quantization: str = "auto"
    engine_dir: str | None = None  # compiled graph / plan for onnxruntime and tensorrt
    draft_model: str | None = None  # speculative: draft: a small model folder with the model's tokenizer (or itself)
    draft_quantization: str = "none"  # the draft model's weights, as `quantization` (the model's own, int4: 3x faster)
    # LoRA adapters (lora.py): `name=path,...` loaded at start (PEFT folders); more at run time (LLMEngine.load_lora).
    # At most max_loras resident (an evicted one reloads when named again), ranks up to max_lora_rank
    lora_modules: str | None = None
    max_loras: int = 4
    max_lora_rank: int = 16
    q_tile: int = 16  # attention row width for prefill chunks (see backend/engine/batch.py)
    # served streams: after its first, a sequence's outputs go out N steps at a time (the serving loop applies it,
    # backend/serving/engine_thread.py; a request's own stream_interval input overrides it)
    stream_interval: int = 1
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval: must be >= 1, got {self.stream_interval}")
        for key in ("max_loras", "max_lora_rank"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.lora_modules and (why := self.torch_cpu_only("adapters are")):
            raise ValueError(f"lora_modules: {why}")
        if self.cache.kv_cache_dtype != "auto" and (why := self.torch_cpu_only(f"{self.cache.kv_cache_dtype} is")):
            raise ValueError(f"kv_cache_dtype: {why}")
        if self.cache.kv_cache_dtype == "float16" and self.dtype == "bfloat16":
            raise ValueError("kv_cache_dtype: float16 stores a float32 model's K/V; a bfloat16 model's cache is "
                             "bfloat16 (auto) or int8")
        if (self.scheduler.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model: set it (a model folder with the model's tokenizer) exactly when "
                             f"speculative is draft (speculative: {self.scheduler.speculative})")

    def torch_cpu_only(self, subject: str) -> str | None:
        """The refusal of a feature only runtime torch on the CPU serves (LoRA adapters, an int8 KV cache), `subject`
        naming it ("adapters are"); None when this engine is runtime torch on the CPU."""
        if (self.runtime, self.device) == ("torch", "cpu"):
            return None
        return f"{subject} served by runtime torch on the CPU, not {self.runtime} on {self.device}"

    @classmethod
    def create(cls, **settings: Any) -> EngineConfig:
        """From flat settings (`max_num_seqs=8`, `block_size=32`, ...), each routed to the part that owns it;
        an unknown key is an error naming it."""
        parts: dict[str, dict[str, Any]] = {"": {}, "scheduler": {}, "cache": {}}
        owners = setting_owners()
        for key, value in settings.items():
            if key not in owners:
                raise ValueError(f"{key}: not an engine setting (known: {sorted(owners)})")
            parts[owners[key]][key] = value
        return cls(**parts[""], scheduler=SchedulerConfig(**parts["scheduler"]), cache=CacheConfig(**parts["cache"]))


def setting_owners() -> dict[str, str]:
    """Every flat setting name -> the EngineConfig part that owns it ("" for EngineConfig itself)."""
    owners = {f.name: "" for f in dataclasses.fields(EngineConfig) if f.name not in ("scheduler", "cache")}
    owners.update({f.name: "scheduler" for f in dataclasses.fields(SchedulerConfig)})
    owners.update({f.name: "cache" for f in dataclasses.fields(CacheConfig)})
    return owners


def setting_fields() -> dict[str, dataclasses.Field]:
    """Every flat setting name -> its dataclass field (for typed parsing of string settings)."""
    fields = {}
    for cls in (EngineConfig, SchedulerConfig, CacheConfig):
        fields.update({f.name: f for f in dataclasses.fields(cls) if f.name not in ("scheduler", "cache")})
    return fields
