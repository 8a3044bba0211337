"""GRPO's loss types, filters, optimisation passes and user rewards, each against a hand computation."""

from __future__ import annotations

import copy
import sys
import textwrap

import pytest
import torch

from ftlm.errors import ConfigError
from ftlm.observe.events import read_events
from ftlm.post.config import PostConfig
from ftlm.post.grpo import GRPO, group_advantages, grpo_loss, varied_groups
from ftlm.post.rewards import reward_function
from ftlm.tasks import generate


def _by_hand(logp, old, ref, adv, mask, clip, kl, loss_type, max_tokens=0, keep=None):
    """The GRPO objective one token at a time, reduced as TRL's loss_type (module docstring)."""
    n, t = logp.shape
    keep = [True] * n if keep is None else keep
    per_seq, total, tokens = [], 0.0, 0
    for i in range(n):
        if not keep[i]:
            continue
        terms = []
        for j in range(t):
            if mask[i, j] == 0:
                continue
            rho = torch.exp(logp[i, j] - old[i, j])
            term = -torch.minimum(rho * adv[i], torch.clamp(rho, 1 - clip, 1 + clip) * adv[i])
            if kl:
                r = ref[i, j] - logp[i, j]
                term = term + kl * (torch.exp(r) - r - 1)
            terms.append(term)
        total = total + sum(terms)
        tokens += len(terms)
        per_seq.append(torch.stack(terms).mean() if terms else torch.zeros(()))
    kept = sum(keep)
    if loss_type == "grpo":
        return torch.stack(per_seq).sum() / kept
    if loss_type == "dapo":
        return total / tokens
    return total / (kept * max_tokens)


def _batch(seed=0, n=6, t=7):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(n, t, generator=g) * 3).requires_grad_(True)
    old = logp.detach() + torch.randn(n, t, generator=g) * 0.3  # ratios in and out of the clip
    ref = logp.detach() + torch.randn(n, t, generator=g) * 0.5
    mask = (torch.rand(n, t, generator=g) > 0.3).float()
    mask[:, 0] = 1
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])).reshape(-1)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_each_loss_type_and_its_gradient_equal_the_hand_computation(loss_type) -> None:
    logp, old, ref, adv, mask = _batch()
    for kl, keep in ((0.04, None), (0.0, torch.tensor([True, True, True, False, False, False]))):
        ours = grpo_loss(logp, old, ref if kl else None, adv, mask, 0.2, kl, loss_type=loss_type,
                         max_tokens=10, keep=keep)
        theirs = _by_hand(logp, old, ref, adv, mask, 0.2, kl, loss_type, 10,
                          None if keep is None else keep.tolist())
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(torch.autograd.grad(ours, logp)[0],
                                   torch.autograd.grad(theirs, logp)[0])


def test_the_loss_types_differ_where_sequence_lengths_differ() -> None:
    logp, old, ref, adv, mask = _batch(1)
    mask[0, 1:] = 0  # one short sequence: per-sequence and token-level means disagree
    grpo, dapo, dr = (grpo_loss(logp, old, ref, adv, mask, 0.2, 0.04, loss_type=k, max_tokens=7)
                      for k in ("grpo", "dapo", "dr_grpo"))
    assert len({round(float(x.detach()), 6) for x in (grpo, dapo, dr)}) == 3
    # dr_grpo's normaliser is the constant sequences x budget, whatever the lengths.
    torch.testing.assert_close(dr * 6 * 7, (dapo * mask.sum()))
    with pytest.raises(ValueError, match="needs max_tokens"):
        grpo_loss(logp, old, ref, adv, mask, 0.2, 0.04, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="needs ref_logp"):
        grpo_loss(logp, old, None, adv, mask, 0.2, 0.04)


def test_zero_variance_groups_are_found() -> None:
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.5]])
    assert varied_groups(rewards).tolist() == [False, True, False, False]


def _objective(model, tokenizer, **kwargs):
    tasks = generate("mod,count", "train", 6, 0)
    settings = dict(seq_len=96, seed=7, group_size=2, clip=0.2, kl_coef=0.0, max_new_tokens=6)
    settings.update(kwargs)
    return GRPO(tasks, tokenizer, None, **settings), tasks


def _by_length(tasks, completions):
    return [float(len(c)) for c in completions]  # varied within most groups


def test_filtered_and_truncated_samples_get_no_loss(model, tokenizer) -> None:
    objective, tasks = _objective(model, tokenizer, max_new_tokens=3, reward=_by_length,
                                  filter_zero_variance=True, mask_truncated=True)
    rows = torch.tensor([[0], [1], [2]])
    tokens, mask, rewards, cut = objective.samples(model, rows)
    assert cut.any(), "a budget of 3 tokens cuts some completions"
    rollout = objective.rollout(model, rows)
    varied = varied_groups(rewards).repeat_interleave(2)
    assert rollout.keep.tolist() == varied.tolist()
    assert torch.equal(rollout.mask, mask[:, 1:].float() * (~cut).float()[:, None])
    assert objective.stats["truncated"] == float(cut.float().mean())
    # step_stats: the mean over the micro-batches since the last call, then nothing.
    first = objective.step_stats()
    assert first["truncated"] == float(cut.float().mean())
    assert first["reward"] == float(rewards.mean()) and objective.step_stats() == {}
    # The loss is the hand computation over the kept, unmasked tokens only.
    loss = objective.loss(model, rows)
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens[:, :-1]).float(), -1).gather(
            2, tokens[:, 1:, None]).squeeze(2)
    expected = _by_hand(logp, logp, None, group_advantages(rewards).reshape(-1), rollout.mask,
                        0.2, 0.0, "grpo", keep=varied.tolist()) if varied.any() else torch.zeros(())
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def test_later_passes_use_the_first_pass_log_probs_and_the_clip_acts(model, tokenizer) -> None:
    """With ppo_epochs 2, step 1 trains its fresh rollout and step 0's again: step 0's old
    log-probs are those of the model that sampled it, so after an update its ratio is not 1,
    some tokens fall outside the clip, and the loss is the hand computation with those."""
    objective, tasks = _objective(model, tokenizer, reward=_by_length, ppo_epochs=2)
    first, second = torch.tensor([[0], [1]]), torch.tensor([[2], [3]])
    objective.clock = lambda: 0
    objective.loss(model, first).backward()
    sampler = copy.deepcopy(model)
    with torch.no_grad():  # an update large enough to push ratios past the clip
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    objective.clock = lambda: 1
    loss = objective.loss(model, second)
    assert objective.stats["clipped"] > 0, "the policy moved: some ratios are clipped"
    # By hand: step 1's samples (ratio 1), then step 0's (old = the sampling model's log-probs).
    parts = []
    for step, rows, old_model in ((1, second, model), (0, first, sampler)):
        objective.clock = lambda step=step: step
        tokens, mask, rewards, _ = objective.samples(old_model if step == 0 else model, rows)
        with torch.no_grad():
            def logp_of(m):
                out = torch.log_softmax(m(tokens[:, :-1]).float(), -1)
                return out.gather(2, tokens[:, 1:, None]).squeeze(2)
            parts.append((logp_of(model), logp_of(old_model), mask[:, 1:].float(),
                          group_advantages(rewards).reshape(-1)))
    width = max(p[0].shape[1] for p in parts)
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
    logp, old, mask = (torch.cat([pad(p[k]) for p in parts]) for k in range(3))
    adv = torch.cat([p[3] for p in parts])
    ratio = torch.exp(logp - old)[len(parts[0][0]):]
    assert ((ratio - 1).abs() * mask[len(parts[0][0]):]).max() > 0.2
    torch.testing.assert_close(loss.detach(), _by_hand(logp, old, None, adv, mask, 0.2, 0.0, "grpo"),
                               rtol=1e-4, atol=1e-5)
    # A retried step 1 (same rows) recomputes the same loss; step 2 drops step 0's rollout.
    objective.clock = lambda: 1
    torch.testing.assert_close(objective.loss(model, second).detach(), loss.detach())
    objective.clock = lambda: 3
    objective.loss(model, first)
    assert "clipped" not in objective.stats and list(objective._window) == [3], \
        "step 1's rollout had its two passes: out of the window"


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def exact(prompts, completions, *, answer, **_):
            return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]
        def too_few(prompts, completions, **_):
            return [0.5]
        def positional(a, b):
            return []
        def not_numbers(prompts, completions, **_):
            return ["yes"] * len(completions)
        def fails(prompts, completions, **_):
            raise KeyError("score")
        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_a_user_reward_function_is_called_with_the_task_fields(reward_module) -> None:
    tasks = generate("mod", "train", 2, 0)
    reward = reward_function(f"{reward_module}:exact", "answer", probe=tasks[0])
    assert reward(tasks, [tasks[0].solution, "nothing"]) == [1.0, 0.0]
    with pytest.raises(ConfigError, match="2 rewards for 3 completions|1 rewards for 2"):
        reward_function(f"{reward_module}:too_few", "answer")(tasks, ["a", "b"])


@pytest.mark.parametrize("spec, message", [
    ("my_rewards:missing", "has no 'missing'"),
    ("no_such_module_xyz:fn", "cannot be imported"),
    ("my_rewards:NOT_CALLABLE", "not a function"),
    ("my_rewards:positional", "does not accept the reward keywords"),
    ("my_rewards:not_numbers", "must be a finite int or float"),
    ("my_rewards:fails", "failed on its start-up check.*KeyError"),
    ("my_rewards:", "must be 'module:function'"),
])
def test_a_bad_reward_function_fails_at_start_naming_it(reward_module, spec, message) -> None:
    with pytest.raises(ConfigError, match=message):
        reward_function(spec, "answer", probe=generate("mod", "train", 1, 0)[0])


def test_grpo_settings_are_validated() -> None:
    for field, value, message in (("grpo_loss", "ppo", "one of grpo, dapo, dr_grpo"),
                                  ("ppo_epochs", 0, "an integer >= 1"),
                                  ("reward", "no_colon", "module:function"),
                                  ("mask_truncated", "yes", "true or false")):
        with pytest.raises(ConfigError, match=f"post.{field}=.*{message}"):
            PostConfig(**{field: value})


def test_grpo_with_every_option_trains_one_group_to_the_end(post_config, demo_data, tmp_path,
                                                            reward_module) -> None:
    """Two passes per rollout, token-level loss, both filters, no KL (so no reference model:
    without train.init_from, loading one would fail) and a user reward, through the trainer:
    every step commits."""
    from ftlm.post import run
    config = post_config(tmp_path / "grpo", data={"tokenizer": str(demo_data / "tokenizer.json")},
                         train={"steps": 2, "batch_size": 2, "grad_accum": 2},
                         post={"kl_coef": 0.0, "ppo_epochs": 2, "grpo_loss": "dapo",
                               "filter_zero_variance": True, "mask_truncated": True,
                               "reward": f"{reward_module}:exact"})
    summary = run.run("grpo", config)
    assert summary["steps_committed"] == 2
    assert summary["data"]["duplicates"] == 0 and summary["data"]["gaps"] == 0
    # Each committed step's rollout statistics, once (two micro-batches averaged); step 1 also
    # trained step 0's rollout again, so it reports the clipped share.
    stats = [e for e in read_events(tmp_path / "grpo" / "events.jsonl") if e["kind"] == "objective"]
    assert [e["step"] for e in stats] == [0, 1]
    assert all(0.0 <= e[k] <= 1.0 for e in stats for k in ("reward", "zero_variance", "truncated"))
    assert "clipped" not in stats[0] and 0.0 <= stats[1]["clipped"] <= 1.0
