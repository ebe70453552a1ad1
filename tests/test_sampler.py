"""The sampler's filters (temperature, min_p, top-k, top-p), batched over a step's sampled rows: each row of a batch
is filtered as it would be alone, whatever filters its neighbours use, and each filter keeps what it should."""

from __future__ import annotations

import pytest
import torch

from backend.engine.sampling import (TOP_P_PREFIXES, SamplingParams, _draw, _filter, _inverse_transform,
                                     _top_p)

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


def _top_p_by_sorting(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: the whole row sorted, the smallest prefix whose probability reaches top_p kept."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = probs.cumsum(-1) - probs >= top_p
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, INF))


def test_top_p_finds_the_nucleus_the_full_sort_finds():
    """_top_p looks among the likeliest 256, then 4,096 tokens before it sorts a whole row: peaked rows (a real
    model's), flat ones whose nucleus reaches past 4,096 tokens, and a batch of both keep what sorting each row keeps
    (no ties here); a row with top_p 1 keeps everything."""
    gen = torch.Generator().manual_seed(3)
    vocab = 3 * TOP_P_PREFIXES[-1]
    peaked = torch.randn(4, vocab, generator=gen) * 8  # the nucleus: a handful of tokens
    flat = torch.randn(3, vocab, generator=gen) * 0.1  # past every prefix
    middle = torch.randn(2, vocab, generator=gen) * 2.5  # past the first prefix, inside the second
    for rows in (peaked, flat, middle, torch.cat([peaked, flat, middle])):
        for top_p in (0.5, 0.9, 0.99):
            want = _top_p_by_sorting(rows, top_p)
            got = _top_p(rows, torch.full((len(rows), 1), top_p))
            assert torch.equal(got, want), (len(rows), top_p)
    kept = (_top_p(middle, torch.full((2, 1), 0.9)) > INF).sum(-1)
    assert (kept > TOP_P_PREFIXES[0]).all() and (kept < TOP_P_PREFIXES[1]).all()  # the case it claims to cover
    mixed = _top_p(torch.cat([peaked, flat]), torch.tensor([[0.9]] * 4 + [[1.0]] * 3))
    assert torch.equal(mixed[4:], flat) and torch.equal(mixed[:4], _top_p_by_sorting(peaked, 0.9))


def test_top_p_keeps_every_token_tied_with_the_last_one_it_needs():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    probs = torch.softmax(logits, dim=-1)[0]
    top_p = float(probs[0] + probs[1] / 2)  # the first 1.0 reaches it
    assert _top_p(logits, torch.tensor([[top_p]])).tolist() == [[3.0, 1.0, 1.0, 1.0, INF]]


def _kernel_draw(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    from backend.engine.kernels import cpu_kernels

    cpu_kernels.load()
    return _draw(logits, uniforms)  # kernels/draw.cpp, now that they are loaded


def _torch_draw(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    return _inverse_transform(torch.softmax(logits, dim=-1), uniforms)  # what the GPU runs


@pytest.mark.parametrize("draw", [_kernel_draw, _torch_draw])
def test_draw_is_the_inverse_transform_and_never_picks_a_dropped_token(draw):
    """Each row's token is the first whose cumulative probability passes uniform x sum, a row at a time: a token at
    -inf is never drawn, at u = 0 nor at the largest float64 below 1; draws over a grid of uniforms land on each
    token as often as its probability says, in a row of 37 tokens (the kernel's vectors and a padded tail) and one of
    a 128k vocabulary."""
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0], [0.25, 0.25, 0.0, 0.0, 0.0, 0.5]])
    logits = torch.log(probs) + 3.0  # -inf where 0; logits, not log-probabilities
    below_one = 1.0 - 2.0 ** -53
    assert draw(logits, torch.tensor([0.0, 0.0], dtype=torch.float64)).tolist() == [1, 0]
    assert draw(logits, torch.tensor([below_one, below_one], dtype=torch.float64)).tolist() == [4, 5]
    grid = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    counts = torch.bincount(draw(logits[:1].expand(1000, -1).contiguous(), grid), minlength=6)
    assert counts.tolist() == [0, 200, 0, 500, 300, 0]
    for vocab in (37, 128256):
        row = torch.full((1, vocab), float("-inf"))
        at = torch.tensor([3, vocab // 2, vocab - 1])
        row[0, at] = torch.log(torch.tensor([0.25, 0.5, 0.25]))
        counts = torch.bincount(draw(row.expand(1000, -1).contiguous(), grid), minlength=vocab)
        assert counts[at].tolist() == [250, 500, 250] and counts.sum() == 1000
    nothing = torch.full((1, 6), float("-inf"))  # a guided row that allows no token: some index, no error
    assert 0 <= int(draw(nothing, torch.tensor([0.3], dtype=torch.float64))[0]) < 6


def test_the_kernels_draws_are_the_torch_ops_draws():
    """kernels/draw.cpp and the torch ops (the GPU's) draw the same tokens from the same logits and uniforms, but
    where a uniform falls within float rounding of a boundary (none among these)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 49157, generator=gen) * 4
    logits[::3, ::2] = float("-inf")  # filtered rows
    uniforms = torch.rand(64, dtype=torch.float64, generator=gen)
    assert torch.equal(_kernel_draw(logits, uniforms), _torch_draw(logits, uniforms))


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
