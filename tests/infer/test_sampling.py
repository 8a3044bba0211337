"""Batched sampling: exact top-k, top-p, min-p, per-row settings, distribution, greedy rows."""

from __future__ import annotations

import torch

from ftlm.infer.sampling import SamplingParams, filtered_logits, params_tensors, sample
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
