"""Batched sampling: exact top-k, top-p, min-p, per-row settings, distribution, greedy rows."""

from __future__ import annotations

import torch

import ftlm.infer.sampling as sampling
from ftlm.infer import Engine
from ftlm.infer.sampling import (
    SamplingParams,
    draw_uniform,
    filtered_logits,
    params_tensors,
    sample,
)
from ftlm.infer.text import TextStream, cut_at_stop


def kept(logits, **kw) -> set[int]:
    p = SamplingParams(**kw)
    scaled, order = filtered_logits(logits[None], *params_tensors([p]))
    return set(order[0][scaled[0] > float("-inf")].tolist())


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.5])
    assert kept(logits, top_k=2) == {1, 2}
    assert kept(torch.zeros(10), top_k=4) == {0, 1, 2, 3}


def test_top_p_keeps_the_nucleus_and_min_p_drops_the_unlikely():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    assert kept(logits, top_p=0.5) == {1}
    assert kept(logits, top_p=0.8) == {1, 2}
    assert kept(logits, top_p=0.81) == {1, 2, 3}
    assert kept(logits, top_p=1.0) == {0, 1, 2, 3}
    assert kept(logits, min_p=0.25) == {1, 2, 3}  # 0.05 < 0.25 * 0.5
    assert kept(logits, min_p=0.7) == {1}


def test_draws_follow_the_distribution_and_each_row_its_own_settings():
    probs = torch.tensor([0.7, 0.2, 0.1])
    n = 20000
    logits = torch.log(probs).expand(n, 3)
    params = [SamplingParams(temperature=1.0)] * n
    uniform = torch.rand(n, generator=torch.Generator().manual_seed(0))
    ids = sample(logits, *params_tensors(params), uniform)
    freq = torch.bincount(ids, minlength=3).float() / n
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
            SamplingParams(temperature=1.0)]
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    ids = sample(logits, *params_tensors(rows), torch.tensor([0.99, 0.99, 0.0]))
    assert ids.tolist() == [1, 0, 2]


def sorted_draw(logits, temperature, top_k, top_p, min_p, uniform):
    """The sampler as it was before unfiltered rows skipped the sort (written out again):
    inverse CDF over every row sorted descending by a stable sort; greedy rows take the argmax."""
    temp = temperature.clamp_min(1e-5)[:, None]
    scaled, order = torch.sort(logits.float() / temp, dim=-1, descending=True, stable=True)
    cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
    pos = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
    drawn = order.gather(-1, pos.clamp_max(logits.shape[-1] - 1))[:, 0]
    return torch.where(temperature > 0, drawn, logits.argmax(dim=-1))


def test_unfiltered_rows_draw_the_sorted_rows_tokens_without_sorting_most(monkeypatch):
    g = torch.Generator().manual_seed(0)
    n, vocab = 600, 4096
    # From flat rows (draws beyond the HEAD most likely tokens: the sorted path) to peaked ones.
    logits = torch.randn(n, vocab, generator=g) * torch.linspace(0.3, 8.0, n)[:, None]
    logits[5, 100:103] = logits[5].max() + 1.0  # tied at the top: the sorted path decides
    rows = [SamplingParams(temperature=t) for t in (0.7, 1.0, 0.0)] * (n // 3)
    uniform = draw_uniform([torch.Generator().manual_seed(i) for i in range(n)])
    sorted_rows = []
    real = sampling.filtered_logits
    monkeypatch.setattr(sampling, "filtered_logits",
                        lambda logits, *a: sorted_rows.append(len(logits)) or real(logits, *a))
    ids = sample(logits, *params_tensors(rows), uniform)
    assert torch.equal(ids, sorted_draw(logits, *params_tensors(rows), uniform))
    assert 0 < sum(sorted_rows) < n // 3, sorted_rows  # the tied row, a few flat ones
    assert ids[5].item() == 100
    # A row with a filter is sorted, and an unfiltered one next to it is not.
    sorted_rows.clear()
    mixed = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0)]
    sample(logits[-2:], *params_tensors(mixed), uniform[:2])
    assert sorted_rows == [1]


def test_engine_samples_the_same_tokens_as_the_sorted_sampler(model, monkeypatch):
    import ftlm.infer.engine as engine_module
    params = [SamplingParams(max_new_tokens=16, temperature=t, seed=s, ignore_eos=True)
              for t, s in ((1.0, 3), (0.7, 4), (1.5, 5), (0.0, None))]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    now = [s.tokens for s in Engine(model, max_batch=4).generate(prompts, params)]
    monkeypatch.setattr(engine_module, "sample", sorted_draw)
    before = [s.tokens for s in Engine(model, max_batch=4).generate(prompts, params)]
    assert now == before


def test_text_stream_holds_back_partial_stops_and_cuts_at_them():
    pieces = ["Hel", "lo", " wo", "rld", "!", "EN", "D", "more"]
    detok = lambda ids: "".join(pieces[i] for i in ids)
    stream = TextStream(detok, stops=("END",))
    deltas = [stream.update(list(range(n))) for n in range(1, len(pieces) + 1)]
    assert "".join(deltas) == "Hello world!"
    assert deltas[5] == ""  # "E" could start "END": held back, never emitted
    assert cut_at_stop("a END b END", ["END", " b"]) == ("a ", True)
    partial = TextStream(lambda ids: "ab\ufffd" if len(ids) == 1 else "abc")
    assert partial.update([1]) == "ab" and partial.update([1, 2]) == "c"
