"""ONNX Runtime runner: the exported PagedLlama graph, same contract as TorchRunner.

The KV cache is one torch tensor, allocated once (host memory, or CUDA memory with device="cuda"),
and bound to the graph by pointer through IOBinding: ONNX Runtime reads it where it lies, nothing
is copied per step (tests/test_onnx_runner.py writes into the tensor and sees it through the graph).
The outputs are torch tensors of their exact shapes (input-defined), bound the same way; after the
run the new K/V go into the cache at `slot_mapping` with `index_copy_`, as in TorchRunner.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnxruntime as ort
import torch
from onnx import TensorProto

from backend.engine.batch import ModelInput
from backend.engine.models.config import load_model_config
from backend.engine.runners.base import allocate_kv_cache, graph_outputs, torch_dtype, write_new_kv
from backend.engine.runners.manifest import CACHE_INPUT, OUTPUT_NAMES, EngineManifest

ONNX_TYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
              torch.bfloat16: TensorProto.BFLOAT16, torch.int64: TensorProto.INT64}
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def session_options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Idle pool threads sleep instead of spinning: the engine shares its cores with Triton's other
    # stubs (tokenizer, detokenizer). With other work on the cores, spinning pools made SmolLM2 decode
    # steps ~2x slower here (2 threads on 2 busy cores).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def check_supported(device: str, dtype: str) -> str:
    """The execution provider for `device`, or the reason this onnxruntime cannot run `dtype` there."""
    provider = PROVIDERS[torch.device(device).type]
    if provider == "CPUExecutionProvider" and dtype == "bfloat16":
        raise ValueError("dtype: onnxruntime's CPU provider has no bfloat16 kernels (Mul, MatMul); "
                         "use float32 (or float16) on CPU, bfloat16 with device='cuda'")
    if provider not in ort.get_available_providers():
        raise RuntimeError(f"onnxruntime {ort.__version__} here has no {provider} "
                           f"(available: {ort.get_available_providers()})")
    return provider


class OnnxRunner:
    def __init__(self, engine_dir: str | Path, model_dir: str | Path, dtype: str, num_blocks: int, block_size: int,
                 device: str = "cpu", quantization: str = "none"):
        self.device = torch.device(device)
        provider = check_supported(device, dtype)
        manifest = EngineManifest.load(engine_dir)
        manifest.verify(load_model_config(model_dir), dtype, quantization)
        self.session = ort.InferenceSession(str(Path(engine_dir) / manifest.onnx_file), session_options(),
                                            providers=[provider])
        self.model_config = cfg = manifest.model_config
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = torch_dtype(dtype)
        self.kv_cache = allocate_kv_cache(cfg, num_blocks, block_size, self.dtype, self.device)
        self.binding = self.session.io_binding()
        self._bind(CACHE_INPUT, self.kv_cache, self.binding.bind_input)

    def _bind(self, name: str, tensor: torch.Tensor, bind: Callable[..., None]) -> None:
        bind(name, self.device.type, self.device.index or 0, ONNX_TYPES[tensor.dtype],
             tuple(tensor.shape), tensor.data_ptr())

    @torch.inference_mode()
    def forward(self, batch: ModelInput, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """The graph runs whole: `between_layers` is never called."""
        inputs = {k: torch.from_numpy(v).to(self.device) for k, v in batch.graph_inputs().items()}
        for name, tensor in inputs.items():
            self._bind(name, tensor, self.binding.bind_input)
        logits, new_kv = graph_outputs(self.model_config, batch, self.dtype, self.device)
        for name, tensor in zip(OUTPUT_NAMES, (logits, new_kv)):
            self._bind(name, tensor, self.binding.bind_output)
        # ORT synchronizes its CUDA stream at the end of the run; torch's stream (the input copies, the
        # cache write) is synchronized by the blocking `.to()` and `.cpu()`, so each run sees the last write.
        self.session.run_with_iobinding(self.binding)
        write_new_kv(self.kv_cache, batch, new_kv)
        return logits.cpu()
