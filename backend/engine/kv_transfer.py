"""KV blocks leaving one engine's pool and entering another's (disaggregated prefill and decode).

The prefill side exports the K/V of a prompt's full blocks from its prefix cache after the prompt ran;
the decode side imports them into its own prefix cache, so admission finds them as a cached prefix and
computes only the rest (at least the last prompt token, whose logits give the first output token). Only
full blocks travel: a partial last block is recomputed, which costs less than a block's worth of prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExportedKV:
    num_tokens: int  # full blocks only: a multiple of block_size
    block_size: int
    data: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim], in the pool's dtype, on the host

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]


def read_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """A copy of these blocks' K/V, on the host: [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    return kv_cache.index_select(2, index).cpu()


def write_blocks(kv_cache: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    kv_cache.index_copy_(2, index, data.to(kv_cache.device, kv_cache.dtype))
