"""ftlm's DPO and GRPO against TRL itself: the loss and the gradients of ``trl.DPOTrainer`` and
``trl.GRPOTrainer`` on one batch.

``make setup`` installs ``trl`` (the ``trl`` extra, pinned), so these run in ``make test``; they
skip, saying why, where it is not installed. The same random model runs as an ftlm ``Transformer`` and, through
``ftlm.model.hf``, as transformers' ``LlamaForCausalLM``; a ``DPOTrainer`` holding the HF policy
and reference computes its training loss (``DPOTrainer._compute_loss``: TRL's own log-prob
kernel, masks and loss) on the same preference rows that ftlm's ``DPO`` objective sees. Loss and
every parameter's gradient must agree (fp32). Cases: the sigmoid loss, IPO, and sigmoid plus
the NLL term on chosen tokens (RPO: TRL's ``loss_type=["sigmoid", "sft"]``); GRPO's loss types
grpo, dapo and dr_grpo (``GRPOTrainer._compute_loss`` on given completions and log-probs).
"""

from __future__ import annotations

import copy

import pytest
import torch

from ftlm.model import Transformer
from ftlm.model.config import ModelConfig
from ftlm.model.hf import config_to_hf, hf_name, state_to_hf
from ftlm.post.objectives import DPO

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

SHAPE = {"size": "tiny", "vocab_size": 1024, "dim": 32, "n_layers": 2, "n_heads": 4,
         "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 64}
PAD = 2


def _pairs(seed: int, n: int = 3, width: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Preference rows ``[n, 4, width]`` (shared prompt, random completions, right padding)
    and the matching attention masks ``[2n, width]`` (chosen rows, then rejected rows)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.full((n, 4, width), 0, dtype=torch.long)
    rows[:, 0::2] = PAD
    attention = torch.zeros(2, n, width, dtype=torch.long)
    for i in range(n):
        prompt = int(torch.randint(3, 7, (1,), generator=g))
        head = torch.randint(10, 1000, (prompt,), generator=g)
        for k, side in enumerate((0, 2)):
            length = int(torch.randint(prompt + 2, width + 1, (1,), generator=g))
            rows[i, side, :prompt] = head
            rows[i, side, prompt:length] = torch.randint(10, 1000, (length - prompt,), generator=g)
            rows[i, side + 1, prompt:length] = 1
            attention[k, i, :length] = 1
    return rows, attention.reshape(2 * n, width)


def _hf_copy(model: Transformer):
    config = transformers.LlamaConfig(**config_to_hf(model.cfg))
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(state_to_hf(model), strict=not model.cfg.tie_embeddings)
    return hf.float()


def _trl_loss_and_grads(policy: Transformer, reference: Transformer, rows, attention, tmp_path,
                        **dpo_args) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    hf_policy, hf_reference = _hf_copy(policy), _hf_copy(reference)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), pad_token="<|pad|>",
        eos_token="<|eos|>", bos_token="<|bos|>")
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True,
                         precompute_ref_log_probs=False, bf16=False, fp16=False, **dpo_args)
    pairs = datasets.Dataset.from_dict({"prompt": ["a b"], "chosen": [" c"], "rejected": [" d"]})
    trainer = trl.DPOTrainer(model=hf_policy, ref_model=hf_reference, args=args,
                             train_dataset=pairs, processing_class=tokenizer)
    trainer.model.train()
    inputs = {"input_ids": torch.cat((rows[:, 0], rows[:, 2])), "attention_mask": attention,
              "completion_mask": torch.cat((rows[:, 1], rows[:, 3]))}
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    loss.backward()
    grads = {n: p.grad for n, p in hf_policy.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("case", [
    {"loss_type": "sigmoid", "beta": 0.1, "nll": 0.0},
    {"loss_type": "ipo", "beta": 0.5, "nll": 0.0},
    {"loss_type": "sigmoid", "beta": 0.2, "nll": 0.7}], ids=["sigmoid", "ipo", "rpo"])
def test_dpo_loss_and_gradients_equal_trl(tmp_path, demo_data, case) -> None:
    (tmp_path / "tokenizer.json").write_bytes((demo_data / "tokenizer.json").read_bytes())
    torch.manual_seed(0)
    reference = Transformer(ModelConfig(**SHAPE))
    reference.init_weights(1)
    policy = copy.deepcopy(reference)
    with torch.no_grad():  # the policy has moved away from the reference
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    rows, attention = _pairs(0)

    objective = DPO(reference, seq_len=rows.shape[-1] - 1, beta=case["beta"],
                    loss_type=case["loss_type"], nll_coef=case["nll"])
    ours = objective.loss(policy, rows)
    ours.backward()

    types, weights = [case["loss_type"]], None
    if case["nll"]:
        types, weights = [case["loss_type"], "sft"], [1.0, case["nll"]]
    theirs, grads = _trl_loss_and_grads(policy, reference, rows, attention, tmp_path,
                                        beta=case["beta"], loss_type=types, loss_weights=weights)
    torch.testing.assert_close(ours.detach(), theirs, rtol=1e-5, atol=1e-6)
    assert abs(float(theirs) - 0.6931) > 1e-3, "the policy must differ from the reference"
    for name, p in policy.named_parameters():
        if name == "output.weight" and policy.cfg.tie_embeddings:
            continue
        torch.testing.assert_close(p.grad, grads[hf_name(name)], rtol=1e-4, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def grpo_trainer(tmp_path_factory, demo_data):
    """One ``trl.GRPOTrainer`` for the GRPO cases (building one takes most of a case's time).

    Built with beta 0 (with another beta it would load a reference model from the hub); each
    case sets ``beta`` and ``loss_type`` on it: the loss reads them, and the reference's log-probs
    from its inputs. ``use_bias_correction_kl=False``: TRL 1.16 multiplies the KL term by the
    importance ratio by default, ftlm keeps DeepSeekMath's plain k3 (docs/post-training.md)."""
    tmp_path = tmp_path_factory.mktemp("grpo")
    torch.manual_seed(0)
    policy = Transformer(ModelConfig(**SHAPE))
    policy.init_weights(1)
    (tmp_path / "tokenizer.json").write_bytes((demo_data / "tokenizer.json").read_bytes())
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), pad_token="<|pad|>",
        eos_token="<|eos|>", bos_token="<|bos|>")
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True,
                          bf16=False, fp16=False, num_generations=2, per_device_train_batch_size=2,
                          max_completion_length=GRPO_WIDTH - GRPO_PROMPT, epsilon=0.2,
                          use_bias_correction_kl=False)
    prompts = datasets.Dataset.from_dict({"prompt": ["a b", "c d"]})
    trainer = trl.GRPOTrainer(model=_hf_copy(policy),
                              reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                              args=args, train_dataset=prompts, processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return policy, trainer


GRPO_PROMPT, GRPO_WIDTH = 4, 14


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_grpo_loss_types_and_gradients_equal_trl(grpo_trainer, loss_type) -> None:
    """``GRPOTrainer._compute_loss`` (TRL's log-prob kernel, clip, KL and reduction) and ftlm's
    ``grpo_loss`` on the same completions, advantages and old / reference log-probs."""
    from ftlm.post.forward import sequence_logprobs
    from ftlm.post.grpo import grpo_loss
    policy, trainer = grpo_trainer
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(10, 1000, (4, GRPO_WIDTH), generator=g)
    mask = torch.zeros(4, GRPO_WIDTH - GRPO_PROMPT, dtype=torch.long)
    for i, n in enumerate((10, 3, 7, 5)):  # completions of different lengths, right-padded
        mask[i, :n] = 1
        tokens[i, GRPO_PROMPT + n:] = PAD
    with torch.no_grad():
        now = sequence_logprobs(policy, tokens)[:, GRPO_PROMPT - 1:]
    old = now + torch.randn(now.shape, generator=g) * 0.3  # ratios in and out of the clip
    ref = now + torch.randn(now.shape, generator=g) * 0.5
    advantages = torch.tensor([1.0, -1.0, 0.7, -0.7])

    policy.zero_grad()
    logp = sequence_logprobs(policy, tokens)[:, GRPO_PROMPT - 1:]
    ours = grpo_loss(logp, old, ref, advantages, mask.float(), 0.2, 0.04, loss_type=loss_type,
                     max_tokens=GRPO_WIDTH - GRPO_PROMPT)
    ours.backward()

    trainer.beta, trainer.loss_type = 0.04, loss_type
    trainer.model.zero_grad()
    inputs = {"prompt_ids": tokens[:, :GRPO_PROMPT],
              "prompt_mask": torch.ones_like(tokens[:, :GRPO_PROMPT]),
              "completion_ids": tokens[:, GRPO_PROMPT:], "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    theirs = trainer._compute_loss(trainer.model, inputs)
    theirs.backward()
    grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)
    for name, p in policy.named_parameters():
        if name == "output.weight" and policy.cfg.tie_embeddings:
            continue
        torch.testing.assert_close(p.grad, grads[hf_name(name)], rtol=1e-4, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
