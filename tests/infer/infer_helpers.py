"""Tiny models and the uncached greedy reference shared by the inference and server tests."""

from __future__ import annotations

import torch

from ftlm.model import ModelConfig, Transformer


def tiny_model(seed: int = 1, max_seq_len: int = 64, vocab_size: int = 96) -> Transformer:
    # init_std 0.2 spreads the logits of a random model so greedy choices are not near-ties.
    cfg = ModelConfig(size="tiny", vocab_size=vocab_size, dim=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, ffn_dim=128, max_seq_len=max_seq_len, init_std=0.2)
    model = Transformer(cfg)
    model.init_weights(seed)
    return model.eval()


def greedy_uncached(model: Transformer, prompt: list[int], steps: int) -> list[int]:
    """Reference: re-run the whole context each step and take the argmax."""
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(tokens)[:, -1].argmax(dim=-1, keepdim=True)
            tokens = torch.cat((tokens, nxt), dim=1)
    return tokens[0, len(prompt):].tolist()


def hf_llama(model: Transformer):
    """A float32 ``transformers`` LlamaForCausalLM with ``model``'s weights (via ftlm.model.hf)."""
    import transformers

    from ftlm.model.hf import config_to_hf, state_to_hf
    config = transformers.LlamaConfig(**config_to_hf(model.cfg))
    config._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(config)
    missing, unexpected = hf.load_state_dict(state_to_hf(model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    return hf.float().eval()
