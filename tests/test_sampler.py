"""The sampler's filters (temperature, min_p, top-k, top-p), batched over a step's sampled rows: each row of a batch
is filtered as it would be alone, whatever filters its neighbours use, and each filter keeps what it should."""

from __future__ import annotations

import torch

from backend.engine.sampling import SamplingParams, _filter

INF = float("-inf")


def test_each_row_is_filtered_as_if_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=gen) * 3
    logits[:, :4] = logits[:, 4:5]  # ties at a cut
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, min_p=0.2),
              SamplingParams(temperature=2.0, top_k=50, top_p=0.9, min_p=0.01), SamplingParams(temperature=1.0, top_k=500)]
    together = _filter(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(together[i], _filter(logits[i:i + 1], [p])[0])


def test_each_filter_keeps_what_it_should():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 4)
    out = _filter(logits, [SamplingParams(temperature=2.0), SamplingParams(temperature=1.0, top_k=2),
                           SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=1.0, min_p=0.3)])
    assert torch.equal(out[0], logits[0] / 2)
    assert out[1].tolist() == [4.0, 3.0, INF, INF, INF]
    # softmax of 4..0: 0.636, 0.234, 0.086, ...: 0.636 < 0.7 <= 0.870, so the first two stay
    assert out[2].tolist() == [4.0, 3.0, INF, INF, INF]
    # min_p 0.3: kept where p >= 0.3 x 0.636 = 0.191: the first two
    assert out[3].tolist() == [4.0, 3.0, INF, INF, INF]


def test_argmax_kernel_is_torch_argmax():
    """kernels/argmax.cpp, the greedy pick on the CPU, returns torch.argmax's index: the first of equal maxima, the
    first NaN, -inf rows, a row shorter than a vector, vocabularies that are not whole vectors, strided rows."""
    from backend.engine.kernels import cpu_kernels

    cpu_kernels.load()
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 5, 16, 49152, 49157):
        x = torch.randn(24, vocab + 3, generator=gen)[:, 2:vocab + 2]  # rows with a stride of their own
        x[1] = 1.0  # all equal
        x[2, vocab // 2:] = 7.0  # ties after the first maximum
        x[3] = float("-inf")
        x[4, vocab - 1] = float("nan")
        x[5, vocab // 3] = float("nan")
        x[5, vocab - 1] = float("nan")
        x[6, vocab - 1] = 100.0  # the maximum in the tail past the last whole vector
        x[7, 0] = 100.0
        got = torch.ops.llm_kernels.argmax_rows(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), vocab
        assert torch.equal(cpu_kernels.argmax(x), got)
