"""Packed weights in 2 MiB pages (kernels/huge_pages.cpp, runners/gemm.py `in_huge_pages`): the same values in a
mapping of their own that Linux may back with transparent huge pages, released with the tensor; the kernels read it
to the same bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine.kernels import cpu_kernels
from backend.engine.runners import gemm

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.fixture(autouse=True, scope="module")
def kernels():
    cpu_kernels.load()


def mapping_of(t: torch.Tensor) -> dict[str, str] | None:
    """The /proc/self/smaps entry of the mapping that holds t's first byte: its range and fields; None if none."""
    address, entry = t.data_ptr(), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(v, 16) for v in head.split("-"))
            entry = {"start": start, "end": end} if start <= address < end else None
        elif entry is not None and ":" in head:
            entry[head.rstrip(":")] = line.split(":", 1)[1].strip()
            if head == "VmFlags:":
                return entry
    return None


def test_a_tensor_of_2_mib_and_more_is_copied_into_a_mapping_of_its_own_that_may_have_huge_pages():
    t = torch.randn(3 << 18)  # 3 MiB: one whole huge page and a tail of small ones
    copy = gemm.in_huge_pages(t)
    assert copy.data_ptr() != t.data_ptr() and torch.equal(copy, t) and copy.dtype == t.dtype
    entry = mapping_of(copy)
    assert entry["start"] == copy.data_ptr() and copy.data_ptr() % gemm.HUGE_PAGE == 0
    assert entry["end"] - entry["start"] == t.nbytes  # its own, as long as the tensor: nothing beside it
    assert "hg" in entry["VmFlags"].split()  # madvise(MADV_HUGEPAGE) asked for
    if "[never]" not in THP.read_text():
        assert entry["THPeligible"] == "1"
    start = entry["start"]
    del copy
    after = mapping_of(torch.empty(0))  # any lookup: the freed range must be gone
    assert after is None or after["start"] != start
    assert all(not line.startswith(f"{start:x}-") for line in Path("/proc/self/maps").read_text().splitlines())


def test_a_smaller_tensor_stays_where_it_is():
    t = torch.randn(1000)
    assert gemm.in_huge_pages(t) is t


@pytest.mark.parametrize("tactic", ["q8_0_w8a8", "q4_1_w4a8", "q8_0"])
def test_the_kernels_read_a_packed_weight_in_huge_pages_to_the_same_bits(tactic):
    if gemm.why_not(tactic, torch.float32) is not None:
        return  # a CPU without the kernel's ISA: refused by name, tested in test_quantization.py
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(2048, 2048, generator=g) * 0.02, torch.randn(3, 2048, generator=g)
    run = gemm.TACTICS[tactic].prepare(w, None)
    kernel = run.gemm if isinstance(run, gemm.FloatBias) else None
    if isinstance(kernel, gemm.PackedKernel):
        packed = kernel.panels[0]
        assert mapping_of(packed)["start"] == packed.data_ptr()  # the panels moved
        as_allocated = gemm.PackedKernel(kernel.op, kernel.experts_op, tuple(p.clone() for p in kernel.panels),
                                         kernel.shared, kernel.out_features)  # torch's allocator's copies
        assert torch.equal(run(x), as_allocated(x))
    else:  # q8_0: a closure over its packed weight and scales
        cells = [c.cell_contents for c in run.gemm.__closure__]
        packed = next(c for c in cells if isinstance(c, torch.Tensor) and c.nbytes >= gemm.HUGE_PAGE)
        assert mapping_of(packed)["start"] == packed.data_ptr()
        scales = next(c for c in cells if isinstance(c, torch.Tensor) and c is not packed and c.numel())
        assert torch.equal(run(x), torch.ops.llm_kernels.q8_0_linear(x, packed.clone(), scales, torch.empty(0), 2048))
