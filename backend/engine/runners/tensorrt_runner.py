"""TensorRT runner: the plan built from the exported graph, same contract as TorchRunner (CUDA only).

The cache and the outputs are torch CUDA tensors bound by pointer (`set_tensor_address`); the plan
runs on the runner's own torch CUDA stream, and the new K/V go into the cache in place with
`index_copy_` on that stream, so the next step's plan sees them in order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from backend.engine.batch import ModelInput
from backend.engine.models.config import load_model_config
from backend.engine.runners.base import allocate_kv_cache, graph_outputs, torch_dtype, write_new_kv
from backend.engine.runners.manifest import (CACHE_INPUT, INPUT_NAMES, OUTPUT_NAMES, EngineManifest, EngineMismatchError,
                                      axis_maxima, max_blocks_per_seq)


class TensorRTRunner:
    def __init__(self, engine_dir: str | Path, model_dir: str | Path, dtype: str, num_blocks: int, block_size: int,
                 *, max_num_tokens: int, q_tile: int, max_model_len: int | None = None,
                 device: str = "cuda"):
        import tensorrt as trt

        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"device: TensorRT needs CUDA (device={device!r}, "
                               f"CUDA available: {torch.cuda.is_available()})")
        manifest = EngineManifest.load(engine_dir)
        manifest.verify(load_model_config(model_dir), dtype)
        if manifest.tensorrt is None:
            raise EngineMismatchError(f"{engine_dir} has no TensorRT plan (build_engine --runtime tensorrt)")
        self.model_config = cfg = manifest.model_config
        blocks = max_blocks_per_seq(cfg, num_blocks, block_size, max_model_len)
        manifest.tensorrt.verify(trt.__version__, axis_maxima(max_num_tokens, q_tile, blocks,
                                                              num_blocks, block_size))
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        plan = (Path(engine_dir) / manifest.tensorrt.plan_file).read_bytes()
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not load the plan in {engine_dir} (see its log above)")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        if sorted(names) != sorted((*INPUT_NAMES, *OUTPUT_NAMES)):
            raise EngineMismatchError(f"plan tensors {names} are not the graph's {INPUT_NAMES} -> {OUTPUT_NAMES}")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream(self.device)

        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = torch_dtype(dtype)
        self.kv_cache = allocate_kv_cache(cfg, num_blocks, block_size, self.dtype, self.device)
        self._bind(CACHE_INPUT, self.kv_cache, is_input=True)

    def _bind(self, name: str, tensor: torch.Tensor, is_input: bool) -> None:
        if is_input and not self.context.set_input_shape(name, tuple(tensor.shape)):
            raise RuntimeError(f"TensorRT refused shape {tuple(tensor.shape)} for {name}")
        self.context.set_tensor_address(name, tensor.data_ptr())

    @torch.inference_mode()
    def forward(self, batch: ModelInput, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """The graph runs whole: `between_layers` is never called."""
        with torch.cuda.stream(self.stream):
            inputs = {k: torch.from_numpy(v).to(self.device) for k, v in batch.graph_inputs().items()}
            for name, tensor in inputs.items():
                self._bind(name, tensor, is_input=True)
            logits, new_kv = graph_outputs(self.model_config, batch, self.dtype, self.device)
            for name, tensor in zip(OUTPUT_NAMES, (logits, new_kv)):
                self._bind(name, tensor, is_input=False)
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed (see its log above)")
            write_new_kv(self.kv_cache, batch, new_kv)
            return logits.cpu()  # waits for the stream
