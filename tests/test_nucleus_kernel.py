"""kernels/nucleus.c: the sampler's top-p filter without a sort of the row.

The reference is the definition, in float64: sort the row (descending, ties by index), keep a
token while the probability of the tokens before it is below top_p. The kernel's probabilities
are float32 exps summed in double, so rows where top_p lies within 1e-5 of a prefix sum (where
rounding may decide) are left out of the exact comparisons, and counted so that they stay rare.
"""

from __future__ import annotations

import pytest
import torch

import minserve.engine.sampler as sampler_mod
from minserve.kernels import nucleus
from minserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(nucleus._library() is None, reason="no C compiler: the torch path serves")
MARGIN = 1e-5


def nucleus_by_sort(row: torch.Tensor, top_p: float) -> tuple[torch.Tensor, float]:
    """The kept tokens by the definition, and how far top_p is from the nearest prefix sum."""
    x = row.double()
    order = sorted(range(len(x)), key=lambda i: (-x[i].item(), i))
    finite = [i for i in order if x[i] != float("-inf")]
    probs = torch.softmax(x[finite], 0)
    above = torch.cumsum(probs, 0) - probs
    keep = torch.zeros(len(x), dtype=torch.bool)
    keep[[i for i, a in zip(finite, above.tolist()) if a < top_p]] = True
    return keep, (above - top_p).abs().min().item()


def random_rows(n: int, seed: int):
    """Rows of many shapes: sizes, spreads from flat to peaked, ties, banned tokens, a constant row."""
    g = torch.Generator().manual_seed(seed)
    for trial in range(n):
        vocab = int(torch.randint(2, 4000, (1,), generator=g))
        row = torch.randn(vocab, generator=g) * [0.05, 0.5, 2.0, 8.0, 60.0][trial % 5]
        if trial % 3 == 0:
            row = (row * 4).round() / 4          # many exact ties, -0.0 beside 0.0 among them
        if trial % 7 == 0:
            row[torch.randint(0, vocab, (vocab // 3,), generator=g)] = float("-inf")
        if trial % 13 == 0:
            row[:] = 0.75
        yield row, [0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999][trial % 8]


def test_the_kept_tokens_are_the_sorted_definitions():
    checked = near = 0
    for row, top_p in random_rows(240, seed=0):
        want, margin = nucleus_by_sort(row, top_p)
        if margin < MARGIN:
            near += 1
            continue
        got = row.clone().unsqueeze(0)
        assert nucleus.top_p_(got, [0], [top_p])
        kept = got[0] > float("-inf")
        assert torch.equal(kept, want), f"vocab {len(row)}, top_p {top_p}: kept {kept.sum()} want {want.sum()}"
        assert torch.equal(got[0][kept], row[kept]), "a kept logit changed"
        checked += 1
    assert checked >= 220 and near <= 20, (checked, near)


def test_tied_tokens_at_the_boundary_stay_lowest_index_first():
    row = torch.tensor([[0.0, 3.0, 1.0, 1.0, 1.0, 1.0, -2.0]])
    p = torch.softmax(row[0].double(), 0)
    # The 3.0 token, then the tied 1.0 tokens in index order: keep 2 of the 4 ties.
    top_p = float(p[1] + p[2] + 0.5 * p[3])
    nucleus.top_p_(row, [0], [top_p])
    assert (row[0] > float("-inf")).tolist() == [False, True, True, True, False, False, False]


def test_a_full_vocabulary_batch_matches_the_definition_row_by_row():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 49152, generator=g) * torch.tensor([[0.3], [1.0], [3.0], [8.0], [0.3], [1.0]])
    top_ps = [0.95, 0.9, 0.5, 0.99, 0.6, 0.999]
    want = [nucleus_by_sort(logits[r], top_ps[r]) for r in range(6)]
    got = logits.clone()
    # rows given out of order and one row left alone: only the listed rows change
    assert nucleus.top_p_(got, [5, 0, 3, 1, 2], [top_ps[5], top_ps[0], top_ps[3], top_ps[1], top_ps[2]])
    for r in (0, 1, 2, 3, 5):
        if want[r][1] >= MARGIN:
            assert torch.equal(got[r] > float("-inf"), want[r][0]), f"row {r}"
    assert torch.equal(got[4], logits[4])
    assert 30_000 < int((got[0] > float("-inf")).sum()) < 49_152   # a wide nucleus, no window limit


def test_rows_it_cannot_filter_are_left_as_they_are():
    banned = torch.full((1, 8), float("-inf"))
    nan = torch.tensor([[0.0, float("nan"), 1.0]])
    for row in (banned, nan):
        before = row.clone()
        assert nucleus.top_p_(row, [0], [0.5])
        assert torch.equal(row.isnan(), before.isnan()) and torch.equal(row.nan_to_num(), before.nan_to_num())
    one = torch.tensor([[0.25, 0.125]])
    assert nucleus.top_p_(one, [0], [1.0]) and one.tolist() == [[0.25, 0.125]]   # top_p 1: untouched


def test_what_the_kernel_does_not_take_goes_back_to_the_caller(monkeypatch):
    assert not nucleus.top_p_(torch.zeros(2, 8, dtype=torch.bfloat16), [0], [0.5])
    assert not nucleus.top_p_(torch.zeros(8, 2).t(), [0], [0.5])   # columns not contiguous
    monkeypatch.setenv("MINSERVE_SAMPLER_FILTERS", "torch")
    row = torch.tensor([[3.0, 0.0, -3.0]])
    assert not nucleus.top_p_(row, [0], [0.5]) and row.tolist() == [[3.0, 0.0, -3.0]]
    monkeypatch.setenv("MINSERVE_SAMPLER_FILTERS", "fast")
    with pytest.raises(ValueError, match="MINSERVE_SAMPLER_FILTERS must be one of c, torch"):
        nucleus.top_p_(row, [0], [0.5])


def test_bad_arguments_are_refused():
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"rows must be in \[0, 2\)"):
        nucleus.top_p_(logits, [2], [0.5])
    with pytest.raises(ValueError, match="2 rows but 1 top_p"):
        nucleus.top_p_(logits, [0, 1], [0.5])
    with pytest.raises(ValueError, match="rows must be distinct"):
        nucleus.top_p_(logits, [1, 1], [0.5, 0.9])


@pytest.mark.parametrize("seed", [1, 2])
def test_the_sampler_keeps_the_same_tokens_with_the_kernel_and_with_the_windows(monkeypatch, seed):
    """apply_top_k_top_p with the kernel (top-p rows) and with the torch windows, on a batch that
    mixes top-p rows, top-k rows (torch either way), both, and rows with neither."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 3000, generator=g) * torch.tensor([[0.2], [1.0], [4.0], [1.0], [0.5], [2.0], [1.0], [9.0]])
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5), SamplingParams(top_k=20),
              SamplingParams(top_k=200, top_p=0.8), SamplingParams(), SamplingParams(top_p=0.97),
              SamplingParams(top_p=0.3, top_k=5), SamplingParams(top_p=0.99)]
    with_kernel, with_windows = logits.clone(), logits.clone()
    sampler_mod.apply_top_k_top_p(with_kernel, params)
    monkeypatch.setenv("MINSERVE_SAMPLER_FILTERS", "torch")
    sampler_mod.apply_top_k_top_p(with_windows, params)
    for r, p in enumerate(params):
        if p.top_k <= 0 and p.top_p < 1 and nucleus_by_sort(logits[r], p.top_p)[1] < MARGIN:
            continue   # rounding may decide this row's boundary in either path
        assert torch.equal(with_kernel[r] > float("-inf"), with_windows[r] > float("-inf")), f"row {r}: {p}"
