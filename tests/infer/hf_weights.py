"""A ``transformers`` LlamaForCausalLM holding the same weights as an ftlm ``Transformer``.

Test helper only (``ftlm.model.hf`` is the real converter). ftlm's attention uses the
"rotate half" rotary pairing, the layout Hugging Face Llama checkpoints use, so the weights map
one to one by name.
"""

from __future__ import annotations

import torch

from ftlm.model.llama import Transformer

_LAYER = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
          "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
          "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
          "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
          "ffn_norm": "post_attention_layernorm"}


def hf_llama(model: Transformer):
    """A float32 LlamaForCausalLM with ``model``'s weights (eager attention, eval mode)."""
    import transformers
    cfg = model.cfg
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    hf_cfg._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(hf_cfg)
    state = {"model.embed_tokens.weight": model.tok_embeddings.weight,
             "model.norm.weight": model.norm.weight, "lm_head.weight": model.output.weight}
    for i, layer in enumerate(model.layers):
        for ours, theirs in _LAYER.items():
            state[f"model.layers.{i}.{theirs}.weight"] = layer.get_submodule(ours).weight
    missing, unexpected = hf.load_state_dict({k: v.detach().float() for k, v in state.items()},
                                             strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf.float().eval()
