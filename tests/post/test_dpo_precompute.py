"""DPO with the reference's log-probs computed once at start equals DPO with the reference model."""

from __future__ import annotations

import copy

import numpy as np
import torch

from ftlm.post import run
from ftlm.post.objectives import DPO, reference_table, with_row_index
from ftlm.post.pairs import write_pairs


def _pairs(seed: int, n: int = 5, width: int = 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.full((n, 4, width), 2, dtype=torch.long)
    rows[:, 1::2] = 0
    for i in range(n):
        for side in (0, 2):
            length = int(torch.randint(8, width + 1, (1,), generator=g))
            rows[i, side, :length] = torch.randint(10, 1000, (length,), generator=g)
            rows[i, side, :5] = rows[i, 0, :5]
            rows[i, side + 1, 5:length] = 1
    return rows


def test_precomputed_reference_gives_the_same_loss_and_gradient(model) -> None:
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    rows = _pairs(0)
    for loss_type, beta in (("sigmoid", 0.1), ("ipo", 0.5)):
        live = DPO(reference, 19, beta=beta, loss_type=loss_type, nll_coef=0.3)
        table = reference_table(reference, rows, loss_type, batch=2)
        assert table.shape == (5, 2)
        cached = DPO(None, 19, beta=beta, loss_type=loss_type, nll_coef=0.3, reference_logps=table)
        indexed = torch.from_numpy(with_row_index(rows.numpy()))
        order = torch.tensor([3, 0, 4])  # a micro-batch of some rows, in another order
        model.zero_grad()
        a = live.loss(model, rows[order])
        a.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        b = cached.loss(model, indexed[order])
        b.backward()
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-8)


def test_dpo_precompute_builds_no_reference_model(post_config, demo_data, tmp_path, model) -> None:
    from safetensors.torch import save_model
    weights = tmp_path / "model.safetensors"
    save_model(model, str(weights))
    pairs = write_pairs([{"prompt": f"What is {i} mod 3?", "chosen": f"Answer: {i % 3}",
                          "rejected": f"Answer: {(i + 1) % 3}"} for i in range(6)],
                        tmp_path / "pairs.jsonl")
    sections = dict(data={"tokenizer": str(demo_data / "tokenizer.json"), "eval_samples": 2},
                    train={"init_from": str(weights)}, post={"data": str(pairs)})
    live, live_data = run.build("dpo", post_config(tmp_path / "a", **sections))
    sections["post"]["dpo_precompute"] = True
    cached, data = run.build("dpo", post_config(tmp_path / "b", **sections))
    assert cached.reference is None and cached.reference_logps.shape == (6, 2)
    rows = data.train.samples(np.arange(len(data.train)))
    held = data.heldout.samples(np.arange(len(data.heldout)))
    assert rows[:, 4, 0].tolist() == [0, 1, 2, 3] and held[:, 4, 0].tolist() == [4, 5]
    for ours, theirs in ((rows, live_data.train), (held, live_data.heldout)):
        ours = torch.from_numpy(ours)
        plain = torch.from_numpy(theirs.samples(np.arange(len(theirs))))
        assert torch.equal(ours[:, :4], plain)
        with torch.no_grad():
            torch.testing.assert_close(cached.loss(model, ours), live.loss(model, plain))
