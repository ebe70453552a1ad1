"""The fused CPU ops (backend/engine/kernels/fused_ops.cpp) equal the torch ops they replace
(models/llama.py TorchOps, the reference the exported graph runs) within float rounding, in every dtype."""

from __future__ import annotations

import pytest
import torch

from backend.engine.kernels import cpu_kernels
from backend.engine.models.llama import KernelOps, RMSNorm, TorchOps

# float32: only the order of the sum of squares differs; bf16/fp16: one rounding step of the dtype
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    cpu_kernels.load()


def test_the_build_has_the_vector_width_of_its_target():
    flags = cpu_kernels.cpu_flags()
    wide = "avx512f" in flags if cpu_kernels.march() == "native" else cpu_kernels.march() == "x86-64-v4"
    assert torch.ops.llm_kernels.lanes() == (16 if wide else 8)


def norm(size: int, dtype: torch.dtype) -> RMSNorm:
    n = RMSNorm(size, 1e-5)
    n.weight.data = (1 + 0.1 * torch.randn(size)).to(dtype)
    return n


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_rms_norm_and_add_rms_norm_equal_torch(dtype):
    torch.manual_seed(0)
    x, delta, n = torch.randn(37, 96).to(dtype), torch.randn(37, 96).to(dtype), norm(96, dtype)
    close(KernelOps.rms_norm(x, n), TorchOps.rms_norm(x, n), dtype)
    residual = x.clone()
    ref_residual, ref_h = TorchOps.add_rms_norm(delta, x, n)
    out_residual, out_h = KernelOps.add_rms_norm(delta, residual, n)
    assert out_residual is residual, "the kernel updates the residual stream in place"
    close(out_residual, ref_residual, dtype)
    close(out_h, ref_h, dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_rotary_in_place_on_qkv_views_equals_torch(dtype):
    """q and k as the model passes them: strided views into one fused qkv output."""
    torch.manual_seed(1)
    T, H, KVH, D = 23, 6, 2, 16
    qkv = torch.randn(T, (H + 2 * KVH) * D).to(dtype)
    angles = torch.rand(T, D // 2) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    q, k, _ = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    ref_q, ref_k = TorchOps.rotary(q.reshape(T, H, D), k.reshape(T, KVH, D), cos, sin)
    out_q, out_k = KernelOps.rotary(q.view(T, H, D), k.view(T, KVH, D), cos, sin)
    close(out_q, ref_q, dtype)
    close(out_k, ref_k, dtype)
    close(qkv[:, :H * D].view(T, H, D), ref_q, dtype)  # written in place


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("width", [2 * 96, 2 * 101])  # whole vectors, and a row with a partial last vector
def test_silu_mul_equals_torch(dtype, width):
    torch.manual_seed(2)
    gate_up = (4 * torch.randn(19, width)).to(dtype)  # large |x| too: exp(-|x|) must not overflow
    close(KernelOps.silu_mul(gate_up), TorchOps.silu_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("width", [2 * 96, 2 * 101])
def test_clamped_swiglu_mul_equals_torch(dtype, width):
    torch.manual_seed(3)
    gate_up = (6 * torch.randn(19, width)).to(dtype)  # past gpt-oss's limit of 7 both ways, in gate and up
    assert (gate_up.abs() > 7).any()
    close(KernelOps.clamped_swiglu_mul(gate_up, 1.702, 7.0), TorchOps.clamped_swiglu_mul(gate_up, 1.702, 7.0), dtype)


def test_bad_shapes_are_refused_by_the_op_name():
    with pytest.raises(RuntimeError, match="rms_norm: x"):
        torch.ops.llm_kernels.rms_norm(torch.randn(4, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="rotary: q, k, cos and sin must share a dtype"):
        torch.ops.llm_kernels.rotary(torch.randn(2, 1, 4), torch.randn(2, 1, 4), torch.randn(2, 4).double(),
                                     torch.randn(2, 4).double())
