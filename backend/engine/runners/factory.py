"""Build the runner an EngineConfig names. Compiled graphs come in built: exporting or building them is
`python -m build_engine`'s job, never the engine's."""

from __future__ import annotations

import logging

from backend.engine.config import EngineConfig
from backend.engine.models.checkpoint_format import AS_STORED, served_quantization
from backend.engine.runners.base import Runner

log = logging.getLogger(__name__)


def create_runner(config: EngineConfig, num_blocks: int) -> Runner:
    block_size = config.cache.block_size
    quantization = served_quantization(config.model, config.quantization, config.runtime, config.device)
    if config.runtime == "torch" and config.device.startswith("cuda") and config.attention in ("auto", "triton") \
            and quantization in ("none", "int8", "int4") and triton_error(config.attention) is None:
        from backend.engine.runners.cuda_runner import CudaRunner

        sched = config.scheduler
        return CudaRunner.load(config.model, config.dtype, num_blocks, block_size, sched.max_num_seqs,
                               sched.max_model_len, config.cuda_graphs, config.device, config.gemm_backend,
                               quantization)
    if config.runtime == "torch":
        from backend.engine.runners.torch_runner import TorchRunner

        # rope tables as long as the pool (no sequence gets further), not the model's 32k-128k positions
        return TorchRunner(config.model, config.dtype, num_blocks, block_size, config.device, config.attention,
                           config.gemm_backend, quantization, config.cache.kv_cache_dtype, num_blocks * block_size)
    if quantization in AS_STORED or (quantization != "none" and config.runtime == "tensorrt"):
        raise ValueError(f"quantization: {quantization} is served by runtime torch"
                         f"{'' if quantization in AS_STORED else ' and onnxruntime'}, not {config.runtime}")
    if config.attention == "kernel":
        raise ValueError(f"attention: the kernel is for runtime torch; {config.runtime} runs the gather graph")
    if config.runtime not in ("onnxruntime", "tensorrt"):
        raise ValueError(f"runtime: unknown runtime {config.runtime!r} (expected torch, onnxruntime or tensorrt)")
    if config.engine_dir is None:
        raise ValueError(f"engine_dir: runtime {config.runtime} needs a built engine folder "
                         f"(python -m build_engine --runtime {config.runtime} --output DIR)")
    if config.runtime == "onnxruntime":
        from backend.engine.runners.onnx_runner import OnnxRunner

        return OnnxRunner(config.engine_dir, config.model, config.dtype, num_blocks, block_size, config.device,
                          quantization)
    from backend.engine.runners.tensorrt_runner import TensorRTRunner

    sched = config.scheduler
    return TensorRTRunner(config.engine_dir, config.model, config.dtype, num_blocks, block_size,
                          max_num_tokens=sched.max_num_batched_tokens,
                          q_tile=config.q_tile, max_model_len=sched.max_model_len, device=config.device)


def triton_error(attention: str) -> str | None:
    """Why the GPU kernels cannot run here (OpenAI Triton missing), None when they can; raised when asked for by
    name, a warning for `auto`, which then runs the gather graph."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        if attention == "triton":
            raise ValueError(f"attention: triton needs the `triton` package ({e})") from e
        log.warning("attention: OpenAI Triton is not installed (%s); using the gather path on the GPU", e)
        return str(e)
    return None
