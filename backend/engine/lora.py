"""LoRA adapters in PEFT's format, served beside the base model: many adapters and the base model in one batch.

An adapter adds (x A^T) B^T * scaling to the Linears it targets (PEFT's `lora_A`, `lora_B`, `lora_alpha / r`, or
`/ sqrt(r)` with rsLoRA). The model fuses q/k/v and gate/up into one Linear each (models/llama.py), so an adapter's
A matrices of a fused Linear are stacked ([sum of ranks, in]) and its B matrices placed block-diagonally ([out, sum of
ranks], the scaling folded in): one pair of small GEMMs per Linear and adapter of a step. A step's tokens are
grouped by adapter (`LoraBatch`); tokens without one pay nothing. The adapter's digest (its files' content, not its
name) enters its requests' block hashes, so a reload under the same name never reuses stale KV (vLLM #42125).

`LoraRegistry` holds the adapters by name: at most `max_loras` resident (loaded in memory), least recently used
first out when another must come in, never one that an unfinished request uses; an evicted adapter is reloaded
from its folder when a request names it again.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as load_safetensors

from backend.engine.models.config import ModelConfig

# PEFT's target module -> (the fused Linear of models/llama.py that holds it, its part of that Linear's output; None:
# all of it, an adapter trained on a fused module, as Phi-3's qkv_proj / gate_up_proj)
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
           "qkv_proj": ("qkv_proj", None), "gate_up_proj": ("gate_up_proj", None)}
WEIGHTS_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoraWeights:
    """One fused Linear's delta: out += (x @ a) @ b (stored transposed from PEFT's: plain GEMMs measured faster)."""

    a: torch.Tensor  # [in, sum of ranks]
    b: torch.Tensor  # [sum of ranks, out], scaling folded in


@dataclass
class LoraAdapter:
    name: str
    path: str
    digest: str  # sha256 of its config and weights files
    layers: list[dict[str, LoraWeights]]  # per layer: fused Linear name -> its delta


def _parts(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Fused Linear name -> (in features, the out features of each of its parts)."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"qkv_proj": (cfg.hidden_size, [q, kv, kv]), "o_proj": (q, [cfg.hidden_size]),
            "gate_up_proj": (cfg.hidden_size, [inter, inter]), "down_proj": (inter, [cfg.hidden_size])}


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, dtype: torch.dtype, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for a model of `cfg`.
    Raises ValueError saying what is wrong: a missing file, an option or target module not served, a rank over
    `max_rank`, a shape that does not fit the model."""
    folder = Path(path)

    def refuse(reason: str) -> ValueError:
        return ValueError(f"LoRA adapter {name!r} ({folder}): {reason}")

    if not (folder / CONFIG_FILE).is_file():
        raise refuse(f"no {CONFIG_FILE} (a PEFT LoRA adapter folder is expected)")
    if not (folder / WEIGHTS_FILE).is_file():
        raise refuse(f"no {WEIGHTS_FILE} (only safetensors adapters are read)")
    config_bytes, weights_bytes = (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as e:
        raise refuse(f"{CONFIG_FILE} is not JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, served in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"), ("lora_bias", False)):
        if config.get(key, served) != served:
            raise refuse(f"{key}: {config[key]!r} is not served (only {served!r})")
    for key in ("modules_to_save", "alpha_pattern", "layers_pattern", "megatron_config"):
        if config.get(key):
            raise refuse(f"{key}: {config[key]!r} is not served")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)):
        raise refuse(f"lora_alpha: expected a number, got {alpha!r}")
    try:
        state = load_safetensors(weights_bytes)  # the bytes the digest is taken of: the file is read once
    except Exception as e:  # a truncated or foreign file
        raise refuse(f"{WEIGHTS_FILE} does not load ({e})") from None

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in TARGETS or int(m.group(1)) >= cfg.num_layers:
            raise refuse(f"weight {key!r} is not a LoRA A/B of a served target module (target modules served: "
                         f"{sorted(TARGETS)} of layers 0..{cfg.num_layers - 1})")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    if not pairs:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA weights")
    parts = _parts(cfg)
    # per layer: fused Linear -> (first and last output row, A, B scaled) of each target in it
    per_layer: list[dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]]] = [{} for _ in range(cfg.num_layers)]
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise refuse(f"layer {layer} {module}: lora_A and lora_B are both needed")
        fused, part = TARGETS[module]
        in_features, outs = parts[fused]
        start = 0 if part is None else sum(outs[:part])
        end = sum(outs) if part is None else start + outs[part]
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if a.shape != (rank, in_features) or b.shape != (end - start, rank):
            raise refuse(f"layer {layer} {module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the "
                         f"model ([r, {in_features}] / [{end - start}, r])")
        if not 1 <= rank <= max_rank:
            raise refuse(f"rank {rank} (layer {layer} {module}) is over max_lora_rank {max_rank}")
        scaling = alpha / (rank ** 0.5 if config.get("use_rslora") else rank)
        per_layer[layer].setdefault(fused, []).append((start, end, a, b * scaling))

    layers = []
    for targets in per_layer:
        fused_weights = {}
        for fused, pieces in targets.items():
            b_full = torch.zeros(sum(parts[fused][1]), sum(a.shape[0] for _, _, a, _ in pieces), dtype=torch.float32)
            col = 0
            for start, end, a, b in pieces:
                b_full[start:end, col:col + a.shape[0]] = b
                col += a.shape[0]
            a_full = torch.cat([a for _, _, a, _ in pieces])
            fused_weights[fused] = LoraWeights(a_full.T.to(dtype).contiguous(), b_full.T.to(dtype).contiguous())
        layers.append(fused_weights)
    digest = hashlib.sha256(config_bytes + b"\x00" + weights_bytes).hexdigest()
    return LoraAdapter(name, str(folder), digest, layers)


@dataclass
class LoraBatch:
    """A step's tokens with an adapter, as runs of consecutive flat tokens: (adapter, start, end). The engine orders
    a batch by adapter, so each adapter is one run: two GEMMs per adapter and Linear, on row slices, with no gather
    or scatter (measured: 4 adapters at batch 32 went from 0.75x to 0.84x the base model's tok/s; docs/benchmarks-log.md,
    Multi-LoRA)."""

    runs: list[tuple[LoraAdapter, int, int]]

    @classmethod
    def of(cls, adapters: list[LoraAdapter | None], query_start: np.ndarray) -> LoraBatch | None:
        """The runs of a batch whose sequence s, tokens query_start[s]:query_start[s + 1], runs `adapters[s]`;
        None when no sequence has an adapter."""
        runs: list[tuple[LoraAdapter, int, int]] = []
        for s, adapter in enumerate(adapters):
            if adapter is None:
                continue
            start, end = int(query_start[s]), int(query_start[s + 1])
            if runs and runs[-1][0] is adapter and runs[-1][2] == start:
                start = runs.pop()[1]
            runs.append((adapter, start, end))
        return cls(runs) if runs else None

    def add(self, layer: int, linear: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the Linear `linear` of layer `layer` applied to `x`) plus each run's delta on its rows."""
        for adapter, start, end in self.runs:
            w = adapter.layers[layer].get(linear)
            if w is not None:
                out[start:end].addmm_(x[start:end] @ w.a, w.b)
        return out


def parse_lora_modules(text: str | None) -> dict[str, str]:
    """`name=path,name=path` (the `lora_modules` setting; vLLM's `--lora-modules`) -> {name: path}."""
    modules: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in (text or "").split(","))):
        name, sep, path = (s.strip() for s in entry.partition("="))
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: {entry!r}: expected NAME=PATH (several: NAME=PATH,NAME=PATH)")
        if name in modules:
            raise ValueError(f"lora_modules: {name!r} is named twice")
        modules[name] = path
    return modules


@dataclass
class LoraRegistry:
    """Adapters by name: registered (a folder each) and, at most `max_loras` of them, resident (loaded)."""

    model_config: ModelConfig
    dtype: torch.dtype
    max_loras: int
    max_rank: int
    paths: dict[str, str] = field(default_factory=dict)
    task_ids: dict[str, int] = field(default_factory=dict)  # tensorrtllm_backend's lora_task_id, from 1, never reused
    resident: OrderedDict[str, LoraAdapter] = field(default_factory=OrderedDict)  # least recently used first
    num_loads: int = 0
    num_evictions: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # requests per adapter name, ever
    _next_task_id: int = 1

    def register(self, name: str, path: str, in_use: set[str]) -> LoraAdapter:
        """Load and check the adapter at `path` under `name` (a name already registered is replaced, when no
        unfinished request uses it)."""
        if not name or name != name.strip():
            raise ValueError(f"LoRA adapter name {name!r}: expected a non-empty name without outer spaces")
        if name in in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by unfinished requests; it can be replaced after them")
        if (cfg := self.model_config).num_experts:
            raise ValueError(f"LoRA adapter {name!r}: adapters on a mixture-of-experts model ({cfg.model_type}) are "
                             "not served")
        adapter = self._load(name, path, in_use)
        self.paths[name] = str(path)
        if name not in self.task_ids:
            self.task_ids[name], self._next_task_id = self._next_task_id, self._next_task_id + 1
        return adapter

    def unregister(self, name: str, in_use: set[str]) -> None:
        """Forget an adapter. Refused while an unfinished request uses it (its requests are not cut short)."""
        if name not in self.paths:
            raise KeyError(self._unknown(name))
        if name in in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by unfinished requests; unload it after them")
        del self.paths[name], self.task_ids[name]
        self.resident.pop(name, None)

    def acquire(self, name: str, in_use: set[str]) -> LoraAdapter:
        """The adapter named `name` for a new request: resident (most recently used now), loaded again from its
        folder if it was evicted."""
        if name not in self.paths:
            raise KeyError(self._unknown(name))
        if name in self.resident:
            self.resident.move_to_end(name)
            adapter = self.resident[name]
        else:
            adapter = self._load(name, self.paths[name], in_use)
        self.requests[name] = self.requests.get(name, 0) + 1  # a request refused above does not count
        return adapter

    def name_of_task(self, task_id: int) -> str:
        for name, tid in self.task_ids.items():
            if tid == task_id:
                return name
        raise KeyError(f"no LoRA adapter has lora_task_id {task_id} (loaded: {self.task_ids})")

    def _load(self, name: str, path: str, in_use: set[str]) -> LoraAdapter:
        adapter = load_adapter(name, path, self.model_config, self.dtype, self.max_rank)
        self.resident.pop(name, None)
        while len(self.resident) >= self.max_loras:
            victim = next((n for n in self.resident if n not in in_use), None)
            if victim is None:
                raise ValueError(f"max_loras ({self.max_loras}) adapters are resident and in use by unfinished "
                                 f"requests; {name!r} can be loaded once one of theirs ends")
            del self.resident[victim]
            self.num_evictions += 1
        self.resident[name] = adapter
        self.num_loads += 1
        return adapter

    def _unknown(self, name: str) -> str:
        return f"unknown LoRA adapter {name!r} (loaded: {sorted(self.paths)})"
