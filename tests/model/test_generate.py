"""Sampling and the decode loop: determinism, stopping, greedy parity, context cropping."""

from __future__ import annotations

import pytest
import torch

from ftlm.model import ModelConfig, Transformer
from ftlm.model.generate import generate, logits_to_probs, sample


@pytest.fixture(scope="module")
def model() -> Transformer:
    cfg = ModelConfig(size="tiny", vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1,
                      ffn_dim=64, max_seq_len=16)
    m = Transformer(cfg)
    m.init_weights(1)
    return m


def prompt() -> torch.Tensor:
    return torch.tensor([[3, 14, 15, 9]])


def greedy_by_hand(model: Transformer, tokens: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(steps):
            context = tokens[:, -model.cfg.max_seq_len:]
            nxt = model(context)[:, -1].argmax(dim=-1, keepdim=True)
            tokens = torch.cat((tokens, nxt), dim=1)
    return tokens


def test_seeded_generation_is_deterministic_and_extends_the_prompt(model):
    runs = [generate(model, prompt(), 10, temperature=1.0,
                     generator=torch.Generator().manual_seed(42)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape == (1, 4 + 10)
    assert torch.equal(runs[0][:, :4], prompt())
    other = [generate(model, prompt(), 10, generator=torch.Generator().manual_seed(s))
             for s in range(1, 6)]
    assert any(not torch.equal(runs[0], o) for o in other)


def test_zero_new_tokens_returns_the_prompt(model):
    assert torch.equal(generate(model, prompt(), 0), prompt())


def test_top_k_one_and_zero_temperature_are_greedy(model):
    want = greedy_by_hand(model, prompt(), 8)
    assert torch.equal(generate(model, prompt(), 8, top_k=1,
                                generator=torch.Generator().manual_seed(0)), want)
    assert torch.equal(generate(model, prompt(), 8, temperature=0.0), want)


def test_generation_stops_after_eos(model):
    free = greedy_by_hand(model, prompt(), 8)[0, 4:].tolist()
    eos = free[2]
    first = free.index(eos)  # the first time greedy decoding emits it
    out = generate(model, prompt(), 8, temperature=0.0, eos_id=eos)
    assert out[0, 4:].tolist() == free[:first + 1]


def test_context_is_cropped_to_max_seq_len(model):
    long_prompt = torch.randint(0, model.cfg.vocab_size, (1, model.cfg.max_seq_len + 5))
    out = generate(model, long_prompt, 3, temperature=0.0)
    assert out.shape == (1, model.cfg.max_seq_len + 8)
    assert torch.equal(out, greedy_by_hand(model, long_prompt, 3))


def test_train_mode_is_restored_even_on_error(model):
    model.train()
    generate(model, prompt(), 2)
    assert model.training
    model.eval()
    generate(model, prompt(), 2)
    assert not model.training
    model.train()
    out_of_vocab = torch.tensor([[model.cfg.vocab_size + 1]])
    with pytest.raises(IndexError):
        generate(model, out_of_vocab, 2)
    assert model.training


def test_generation_builds_no_autograd_graph(model):
    seen = []
    handle = model.output.register_forward_hook(lambda m, i, o: seen.append(o.requires_grad))
    try:
        generate(model, prompt(), 2)
    finally:
        handle.remove()
    assert seen == [False, False]


def test_bad_arguments_are_refused(model):
    with pytest.raises(ValueError, match="prompt"):
        generate(model, torch.tensor([1, 2]), 2)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, prompt(), 2, top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt(), 2, temperature=-1.0)


def test_top_k_restricts_samples_to_the_k_best():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0])
    probs = logits_to_probs(logits, temperature=1.0, top_k=2)
    assert probs.sum().item() == pytest.approx(1.0)
    assert set(torch.nonzero(probs).flatten().tolist()) == {1, 3}
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, 1.0, 2, g)) for _ in range(200)}
    assert draws == {1, 3}


def test_sample_follows_the_temperature_scaled_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    g = torch.Generator().manual_seed(0)
    draws = sample(logits.expand(20000, 3), 1.0, None, g)
    freq = torch.bincount(draws, minlength=3).float() / draws.numel()
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.015, rtol=0)
    cold = logits_to_probs(logits, temperature=0.5)
    torch.testing.assert_close(cold, torch.tensor([0.49, 0.04, 0.01]) / 0.54)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_samples_with_a_cpu_generator(model):
    gpu = Transformer(model.cfg).cuda()
    gpu.init_weights(1)
    runs = [generate(gpu, prompt().cuda(), 6, top_k=8, generator=torch.Generator().manual_seed(3))
            for _ in range(2)]
    assert runs[0].device.type == "cuda" and runs[0].shape == (1, 10)
    assert torch.equal(runs[0], runs[1])


def test_top_k_keeps_exactly_k_tokens_when_values_tie():
    # Before the fix every token tied with the k-th value was kept: here 4 tokens for k=2.
    logits = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.5])
    probs = logits_to_probs(logits, temperature=1.0, top_k=2)
    assert torch.count_nonzero(probs).item() == 2
    assert set(torch.nonzero(probs).flatten().tolist()) == {1, 2}  # ties keep the lower ids
    batch = logits_to_probs(torch.zeros(3, 10), temperature=1.0, top_k=4)
    assert torch.count_nonzero(batch, dim=-1).tolist() == [4, 4, 4]
