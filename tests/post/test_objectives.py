"""The objectives on fixed batches, each against an independent implementation of its formula."""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from ftlm.post.data import pack
from ftlm.post.forward import packed_logits
from ftlm.post.objectives import DPO, GRPO, SFT, dpo_losses, group_advantages, grpo_loss
from ftlm.post.rewards import checker_reward
from ftlm.tasks import generate


def _docs(seed: int, lengths=(9, 14, 6, 11)):
    rng = np.random.default_rng(seed)
    docs = []
    for n in lengths:
        ids = rng.integers(10, 1000, size=n).tolist()
        cut = n // 2
        docs.append((ids, [0] * cut + [1] * (n - cut)))
    return docs


def test_document_masking_keeps_documents_apart(model) -> None:
    tokens = torch.randint(10, 1000, (2, 24))
    docs = torch.tensor([[0] * 10 + [1] * 14] * 2)
    changed = tokens.clone()
    changed[:, :10] = torch.randint(10, 1000, (2, 10))  # rewrite document A
    with torch.no_grad():
        a, b = packed_logits(model, tokens, docs), packed_logits(model, changed, docs)
        plain = model(changed)
        alone = model(tokens[:, 10:])
    assert torch.equal(a[:, 10:], b[:, 10:]), "document B saw document A"
    assert not torch.allclose(plain[:, 10:], a[:, 10:]), "the unmasked model does see A"
    torch.testing.assert_close(a[:, 10:], alone, rtol=0, atol=1e-5)  # as if B were alone


def test_sft_loss_is_the_mean_over_completion_tokens_of_separate_documents(model) -> None:
    docs = _docs(0)
    rows = torch.from_numpy(pack(docs, seq_len=23, pad_id=2))  # 2 rows of 2 documents
    loss = SFT(23).loss(model, rows)
    # Independently: each document alone through the model, CE on its completion targets only.
    total, count = 0.0, 0
    for ids, mask in docs:
        t = torch.tensor([ids])
        logits = model(t[:, :-1])[0]
        ce = F.cross_entropy(logits, t[0, 1:], reduction="none")
        m = torch.tensor(mask[1:], dtype=torch.float32)
        total, count = total + (ce * m).sum(), count + m.sum()
    torch.testing.assert_close(loss, total / count, rtol=1e-5, atol=1e-6)
    # Changing a prompt token's target (position with mask 0) changes nothing but what it
    # conditions: the loss of the first row's first prompt token as a target is not counted.
    sums = SFT(23).eval_sums(model, rows)
    assert sums[1].item() == sum(sum(m[1:]) for _, m in docs)


def _trl_style_logps(model, tokens, mask, average: bool):
    """Sequence log-probs as TRL computes them: log_softmax, gather labels, mask, sum (or mean)."""
    logits = model(tokens[:, :-1]).float()
    labels = tokens[:, 1:].clone()
    loss_mask = mask[:, 1:].bool()
    labels[~loss_mask] = 0
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    s = (per_token * loss_mask).sum(-1)
    return s / loss_mask.sum(-1) if average else s


def _trl_dpo_loss(pc, pr, rc, rr, beta, loss_type):
    """TRL's DPOTrainer.dpo_loss (label_smoothing 0) for sigmoid and ipo, written out again."""
    logits = (pc - pr) - (rc - rr)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * logits) * (1 - 0.0) - F.logsigmoid(-beta * logits) * 0.0
    return (logits - 1 / (2 * beta)) ** 2


def _pairs(seed: int, n: int = 3, width: int = 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.zeros(n, 4, width, dtype=torch.long)
    for i in range(n):
        for side in (0, 2):
            length = int(torch.randint(8, width + 1, (1,), generator=g))
            prompt = 5
            rows[i, side, :length] = torch.randint(10, 1000, (length,), generator=g)
            rows[i, side, :prompt] = rows[i, 0, :prompt]  # both sides share the prompt
            rows[i, side + 1, prompt:length] = 1
            rows[i, side, length:] = 2
    return rows


def test_dpo_loss_and_gradients_equal_trl_formula(model) -> None:
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():  # the policy moved away from the reference
            p.add_(torch.randn_like(p) * 0.02)
    rows = _pairs(0)
    for loss_type, beta in (("sigmoid", 0.1), ("ipo", 0.5)):
        objective = DPO(reference, seq_len=19, beta=beta, loss_type=loss_type)
        model.zero_grad()
        ours = objective.loss(model, rows)
        ours.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        avg = loss_type == "ipo"
        pc = _trl_style_logps(model, rows[:, 0], rows[:, 1], avg)
        pr = _trl_style_logps(model, rows[:, 2], rows[:, 3], avg)
        with torch.no_grad():
            rc = _trl_style_logps(reference, rows[:, 0], rows[:, 1], avg)
            rr = _trl_style_logps(reference, rows[:, 2], rows[:, 3], avg)
        theirs = _trl_dpo_loss(pc, pr, rc, rr, beta, loss_type).mean()
        theirs.backward()
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)
    # At the reference itself the sigmoid loss is log 2 for every pair.
    at_ref = DPO(reference, 19, beta=0.1).losses(copy.deepcopy(reference), rows)
    torch.testing.assert_close(at_ref, torch.full((3,), float(np.log(2))), rtol=1e-5, atol=1e-6)


def test_dpo_losses_are_the_published_formulas() -> None:
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-3.0, -5.0, -4.0, -4.5))
    h = (-3.0 + 5.0) - (-4.0 + 4.5)
    assert torch.allclose(dpo_losses(pc, pr, rc, rr, 0.2), torch.tensor([np.log1p(np.exp(-0.2 * h))],
                                                                        dtype=torch.float32))
    assert torch.allclose(dpo_losses(pc, pr, rc, rr, 0.2, "ipo"), torch.tensor([(h - 2.5) ** 2]))


def _grpo_by_hand(logp, old, ref, adv, mask, clip, kl, nll=0.0, correct=()):
    """GRPO (DeepSeekMath eq. 3 with the k3 KL estimate), one token at a time; plus ``nll``
    times the mean negative log-prob over the tokens of the sequences in ``correct``."""
    seqs, anchor = [], []
    for i in range(logp.shape[0]):
        terms = []
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            rho = torch.exp(logp[i, t] - old[i, t])
            unclipped, clipped = rho * adv[i], torch.clamp(rho, 1 - clip, 1 + clip) * adv[i]
            r = ref[i, t] - logp[i, t]
            terms.append(-torch.minimum(unclipped, clipped) + kl * (torch.exp(r) - r - 1))
            if i in correct:
                anchor.append(-logp[i, t])
        seqs.append(torch.stack(terms).mean())
    loss = torch.stack(seqs).mean()
    return loss + nll * torch.stack(anchor).mean() if anchor else loss


def test_grpo_loss_and_gradient_equal_the_formula_by_hand() -> None:
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(6, 7, generator=g) * 3).requires_grad_(True)
    old = logp.detach() + torch.randn(6, 7, generator=g) * 0.3  # ratios in and out of the clip
    ref = logp.detach() + torch.randn(6, 7, generator=g) * 0.5
    mask = (torch.rand(6, 7, generator=g) > 0.3).float()
    mask[:, 0] = 1
    rewards = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    adv = group_advantages(rewards).reshape(-1)
    ours = grpo_loss(logp, old, ref, adv, mask, clip=0.2, kl_coef=0.04)
    (grad_ours,) = torch.autograd.grad(ours, logp)
    theirs = _grpo_by_hand(logp, old, ref, adv, mask, 0.2, 0.04)
    (grad_theirs,) = torch.autograd.grad(theirs, logp)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad_ours, grad_theirs)
    # Group-normalised advantages: (r - mean) / (unbiased std + 1e-4) within each group.
    std = (((1 - 1 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2) ** 0.5
    expected = [(r - 1 / 3) / (std + 1e-4) for r in (1, 0, 0)] + \
               [(r - 2 / 3) / (std + 1e-4) for r in (1, 1, 0)]
    torch.testing.assert_close(adv, torch.tensor(expected))
    # An all-equal group carries no signal: zero advantages, not a division by zero.
    assert torch.equal(group_advantages(torch.ones(1, 4)), torch.zeros(1, 4))
    # The NLL anchor: the mean NLL per token of the rewarded samples, weighted.
    correct = rewards.reshape(-1) > 0
    ours = grpo_loss(logp, old, ref, adv, mask, 0.2, 0.04, nll_coef=0.5, correct=correct)
    (grad_ours,) = torch.autograd.grad(ours, logp)
    theirs = _grpo_by_hand(logp, old, ref, adv, mask, 0.2, 0.04, 0.5,
                           correct.nonzero()[:, 0].tolist())
    (grad_theirs,) = torch.autograd.grad(theirs, logp)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad_ours, grad_theirs)
    none_right = grpo_loss(logp, old, ref, adv, mask, 0.2, 0.04, 0.5, torch.zeros(6, dtype=torch.bool))
    torch.testing.assert_close(none_right, grpo_loss(logp, old, ref, adv, mask, 0.2, 0.04))


def test_grpo_samples_are_seeded_by_step_and_task(model, tokenizer) -> None:
    tasks = generate("mod,count", "train", 4, 0)
    objective = GRPO(tasks, tokenizer, copy.deepcopy(model), seq_len=96, seed=7, group_size=3,
                     clip=0.2, kl_coef=0.04, max_new_tokens=6)
    rows = torch.tensor([[0], [2]])
    first = objective.samples(model, rows)
    again = objective.samples(model, rows)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "a retried step samples the same"
    objective.clock = lambda: 5
    later = objective.samples(model, rows)
    assert not torch.equal(first[0], later[0]), "another step samples afresh"
    tokens, _, rewards, _ = first
    assert tokens.shape[0] == 6 and rewards.shape == (2, 3)
    # The reward is the verifier's verdict on each completion.
    objective.reward = checker_reward(lambda task, completion: task is tasks[2])
    assert objective.samples(model, rows)[2].tolist() == [[0.0] * 3, [1.0] * 3]
    loss = objective.loss(model, rows)
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None for p in model.parameters())
    # With the anchor, the rewarded samples' NLL (> 0) is added: the same samples, a larger loss.
    objective.nll_coef = 1.0
    assert objective.loss(model, rows).item() > loss.item()


def test_dpo_nll_term_is_the_mean_nll_per_chosen_token(model) -> None:
    reference = copy.deepcopy(model)
    rows = _pairs(1)
    plain = DPO(reference, 19, beta=0.1).loss(model, rows)
    rpo = DPO(reference, 19, beta=0.1, nll_coef=0.5).loss(model, rows)
    logits = model(rows[:, 0, :-1]).float()
    per_token = torch.gather(logits.log_softmax(-1), 2, rows[:, 0, 1:, None]).squeeze(2)
    m = rows[:, 1, 1:].float()
    nll = -(per_token * m).sum() / m.sum()
    torch.testing.assert_close(rpo, plain + 0.5 * nll, rtol=1e-5, atol=1e-6)


def test_grpo_trains_on_the_log_probs_the_sampler_drew_from(model, tokenizer) -> None:
    """The engine's log-prob of each sampled token equals the training forward's (temperature 1),
    and the loss at temperature T uses log_softmax(logits / T) of the same tokens."""
    from ftlm.data.chat import prompt_ids
    from ftlm.post.forward import completion_logprobs
    from ftlm.post.rollout import sample_group
    task = generate("count", "train", 1, 0)[0]
    prompt = prompt_ids(tokenizer, task.prompt)
    end = tokenizer.token_id("<|end|>")
    completions, sampler = sample_group(model, prompt, 4, 10, end, tokenizer.pad_id, 1.0, 0, 3)
    again, _ = sample_group(model, prompt, 4, 10, end, tokenizer.pad_id, 1.0, 0, 3)
    assert completions == again, "the same seed draws the same group"
    width = len(prompt) + max(map(len, completions))
    tokens = torch.full((4, width), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((4, width), dtype=torch.long)
    for i, c in enumerate(completions):
        tokens[i, :len(prompt) + len(c)] = torch.tensor(prompt + c)
        mask[i, len(prompt):len(prompt) + len(c)] = 1
    with torch.no_grad():
        logp, m = completion_logprobs(model, tokens, mask)
        hot, _ = completion_logprobs(model, tokens, mask, 0.7)
        logits = model(tokens[:, :-1]).float() / 0.7
    for i, c in enumerate(completions):
        drawn = logp[i, len(prompt) - 1:len(prompt) - 1 + len(sampler[i])]
        torch.testing.assert_close(drawn, torch.tensor(sampler[i]), rtol=0, atol=1e-4)
        if len(c) > len(sampler[i]):  # stopped: <|end|> is the last target, counted in the mask
            assert c[-1] == end and m[i, len(prompt) - 2 + len(c)] == 1
    expected = torch.gather(logits.log_softmax(-1), 2, tokens[:, 1:, None]).squeeze(2)
    torch.testing.assert_close(hot * m, expected * m, rtol=1e-5, atol=1e-5)


def test_grpo_decodes_its_micro_batch_together_with_each_prompts_own_seeds(model, tokenizer) -> None:
    """``sample_groups`` runs every prompt's group in one engine batch; each group equals the
    group that prompt draws alone with the same seed (the seed, not the batch, picks the draws),
    and different prompts' budgets are kept."""
    from ftlm.data.chat import prompt_ids
    from ftlm.post.rollout import sample_group, sample_groups
    tasks = generate("mod,count", "train", 3, 0)
    prompts = [prompt_ids(tokenizer, t.prompt) for t in tasks]
    end = tokenizer.token_id("<|end|>")
    together, logprobs = sample_groups(model, prompts, 3, 8, end, tokenizer.pad_id, 1.0, 0,
                                       [11, 12, 13])
    assert len(together) == 3 and all(len(g) == 3 for g in together)
    for prompt, seed, group, lp in zip(prompts, (11, 12, 13), together, logprobs):
        alone, alone_lp = sample_group(model, prompt, 3, 8, end, tokenizer.pad_id, 1.0, 0, seed)
        assert group == alone
        for a, b in zip(lp, alone_lp):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    assert together[0] != together[1], "each prompt draws from its own seeds"
    assert all(len(c) <= 8 + 1 for g in together for c in g)
