"""The GPU runner: PagedLlama on CUDA with OpenAI Triton kernels, one host-to-device copy per step, CUDA graphs
for decode.

- Attention and the KV write are the paged kernels of kernels/triton_attention.py (no gather, no padding), the
  elementwise ops those of kernels/triton_ops.py; the GEMMs are cuBLAS (F.linear), or with `quantization: int8 |
  int4` the weight-only kernels of kernels/triton_linear.py (runners/gemm.py's tactics for CUDA), captured in the
  graphs like the rest.
- A step's index tensors (token ids, positions, slots, sequence bounds, context lengths, block tables, logits
  rows) are packed into one pinned int64 buffer and sent in one copy; the kernels read views of it.
- Decode steps (one new token per sequence, one logits row each) replay a CUDA graph captured at load for the
  smallest batch size bucket that holds them (vLLM's buckets: 1, 2, 4, then multiples of 8 up to max_num_seqs),
  padded with rows that write no KV (slot -1) and attend to nothing (context 0). Prefill and mixed steps run
  eagerly, and so does every step with `cuda_graphs` off.
- `between_layers` is never called: a GPU step takes milliseconds, and the engine's cut-in (a light tenant's prefill
  run between the layers of a long CPU step) would run a forward inside this one, over its input buffers.
- Logits stay on the GPU: the sampler runs there and copies the picked ids to the host once (sampling.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from backend.engine.batch import ModelInput
from backend.engine.kernels.triton_attention import multiprocessors, segments_for
from backend.engine.models.config import load_model_config, refuse_beyond_llama
from backend.engine.models.llama import PagedLlama, TritonLayout, load_model
from backend.engine.runners.base import allocate_kv_cache, torch_dtype
from backend.engine.runners.gemm import use_tactics

def graph_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes a graph is captured for (vLLM's rule)."""
    return [n for n in [1, 2, 4] + list(range(8, max_num_seqs + 8, 8)) if n < max_num_seqs] + [max_num_seqs]


def _sections(T: int, S: int, L: int, B: int) -> dict[str, tuple[int, int]]:
    """Each field's (offset, length) in the packed buffer, in this order."""
    lengths = {"token_ids": T, "positions": T, "slot_mapping": T, "query_start": S + 1, "context_lens": S,
               "logits_index": L, "block_tables": S * B}
    offsets = np.cumsum([0, *lengths.values()])
    return {name: (int(offset), n) for (name, n), offset in zip(lengths.items(), offsets)}


class CudaRunner:
    def __init__(self, model: PagedLlama, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_model_len: int | None = None, cuda_graphs: bool = True, gemm_backend: str = "auto",
                 quantization: str = "none"):
        self.model = model
        self.model_config = cfg = model.cfg
        self.device = model.embed_tokens.weight.device
        self.gemm_tactics = use_tactics(model, self.device, gemm_backend, quantization)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_cache = allocate_kv_cache(cfg, num_blocks, block_size, model.embed_tokens.weight.dtype, self.device)
        self.multiprocessors = multiprocessors(self.device)
        max_len = min(max_model_len or cfg.max_position_embeddings, num_blocks * block_size)
        self.max_blocks = -(-max_len // block_size)  # block table width of a graph's batch
        self._host = torch.empty(0, dtype=torch.int64)
        self._eager = torch.empty(0, dtype=torch.int64, device=self.device)
        self._sent = torch.cuda.Event()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if cuda_graphs:
            self._capture(graph_sizes(max_num_seqs))

    @classmethod
    def load(cls, model_dir: str | Path, dtype: str, num_blocks: int, block_size: int, max_num_seqs: int,
             max_model_len: int | None = None, cuda_graphs: bool = True, device: str = "cuda",
             gemm_backend: str = "auto", quantization: str = "none") -> CudaRunner:
        refuse_beyond_llama(load_model_config(model_dir), "device cuda (the GPU kernels)")
        return cls(load_model(model_dir, torch_dtype(dtype), device), num_blocks, block_size, max_num_seqs,
                   max_model_len, cuda_graphs, gemm_backend, quantization)

    @torch.inference_mode()
    def forward(self, batch: ModelInput, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """Logits [L, vocab] float32, on the GPU (a replayed graph's: valid until the next forward)."""
        S = batch.num_seqs
        size = self._graph_size(batch)
        if size:
            graph, logits = self.graphs[size]
            self._send(self._graph_inputs, self._pack_padded(batch, size))
            graph.replay()
            return logits[:S]
        T, L, B = batch.num_tokens, len(batch.logits_index), batch.block_tables.shape[1]
        sections = _sections(T, S, L, B)
        host = self._stage(sum(n for _, n in sections.values()))
        for name, (offset, n) in sections.items():
            host[offset:offset + n] = getattr(batch, name).reshape(-1)
        if self._eager.numel() < len(host):
            self._eager = torch.empty(2 * len(host), dtype=torch.int64, device=self.device)
        self._send(self._eager, host)
        max_query_len = int(np.diff(batch.query_start).max())
        return self._run(self._views(self._eager, sections, B), max_query_len)

    def _run(self, inputs: dict[str, torch.Tensor], max_query_len: int) -> torch.Tensor:
        S = inputs["context_lens"].shape[0]
        layout = TritonLayout(inputs["block_tables"], inputs["query_start"], inputs["context_lens"],
                              inputs["slot_mapping"], max_query_len,
                              segments_for(S, self.model_config.num_kv_heads, max_query_len, self.multiprocessors))
        logits, _ = self.model(inputs["token_ids"], inputs["positions"], None, None, None, None, None,
                               inputs["logits_index"], kv_cache=self.kv_cache, kernel=layout)
        return logits

    # -- CUDA graphs ------------------------------------------------------------------------------

    def _graph_size(self, batch: ModelInput) -> int | None:
        """The bucket whose graph runs this batch: decode only, within the captured sizes and table width."""
        S = batch.num_seqs
        if not self.graphs or batch.num_tokens != S or len(batch.logits_index) != S or \
                batch.block_tables.shape[1] > self.max_blocks:
            return None
        return next((n for n in self.graphs if n >= S), None)

    def _capture(self, sizes: list[int]) -> None:
        largest = max(sizes)
        self._graph_inputs = torch.zeros(sum(n for _, n in _sections(largest, largest, largest, self.max_blocks).values()),
                                         dtype=torch.int64, device=self.device)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for n in sorted(sizes, reverse=True):  # the largest first: the others reuse its pool's memory
                inputs = self._views(self._graph_inputs, _sections(n, n, n, self.max_blocks), self.max_blocks)
                self._send(self._graph_inputs, self._pack_padded(None, n))
                self._run(inputs, 1)  # compiles the kernels of this shape outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._run(inputs, 1)
                self.graphs[n] = (graph, logits)
        self.graphs = dict(sorted(self.graphs.items()))

    def _pack_padded(self, batch: ModelInput | None, n: int) -> np.ndarray:
        """A decode batch of S <= n sequences (none: only padding) in the packed layout of bucket n: rows S..n-1
        write and read nothing."""
        sections = _sections(n, n, n, self.max_blocks)
        host = self._stage(sum(length for _, length in sections.values()))
        fields = {name: host[offset:offset + length] for name, (offset, length) in sections.items()}
        host[:] = 0
        fields["slot_mapping"][:] = -1
        fields["query_start"][:] = np.arange(n + 1)
        fields["logits_index"][:] = np.arange(n)
        if batch is not None:
            S, B = batch.num_seqs, batch.block_tables.shape[1]
            for name in ("token_ids", "positions", "context_lens", "slot_mapping"):
                fields[name][:S] = getattr(batch, name)
            fields["block_tables"].reshape(n, self.max_blocks)[:S, :B] = batch.block_tables
        return host

    # -- the one copy -----------------------------------------------------------------------------

    def _stage(self, size: int) -> np.ndarray:
        """The pinned host buffer's first `size` entries, once the last step's copy has left it."""
        self._sent.synchronize()
        if self._host.numel() < size:
            self._host = torch.empty(2 * size, dtype=torch.int64, pin_memory=True)
        return self._host.numpy()[:size]

    def _send(self, device_buffer: torch.Tensor, host: np.ndarray) -> None:
        device_buffer[:len(host)].copy_(self._host[:len(host)], non_blocking=True)
        self._sent.record()

    @staticmethod
    def _views(buffer: torch.Tensor, sections: dict[str, tuple[int, int]], B: int) -> dict[str, torch.Tensor]:
        views = {name: buffer[offset:offset + n] for name, (offset, n) in sections.items()}
        views["block_tables"] = views["block_tables"].view(-1, B)
        return views
