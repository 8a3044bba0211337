"""The closed-form parameter and FLOP counts agree with a real module and torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ftlm.model import (
    SIZES,
    ModelConfig,
    Transformer,
    flops_per_token,
    forward_flops,
    param_count,
)


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied matrix once


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("size", ["tiny", "small"])
def test_param_count_matches_a_real_module(size, tie):
    cfg = ModelConfig(size=size, tie_embeddings=tie)
    assert param_count(cfg) == numel(Transformer(cfg))


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("size", ["125m", "1b", "8b"])
def test_param_count_matches_a_meta_module(size, tie):
    cfg = ModelConfig(size=size, tie_embeddings=tie)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert param_count(cfg) == numel(model)


@pytest.mark.parametrize("tie", [True, False])
def test_non_embedding_count_drops_only_the_embedding_table(tie):
    cfg = ModelConfig(size="tiny", tie_embeddings=tie)
    model = Transformer(cfg)
    assert param_count(cfg, include_embedding=False) == (
        numel(model) - model.tok_embeddings.weight.numel())


def test_named_sizes_have_their_nominal_scale():
    assert 0.8e6 <= param_count(ModelConfig(size="tiny")) <= 1.5e6
    assert 12e6 <= param_count(ModelConfig(size="small")) <= 18e6
    assert 7.9e9 <= param_count(ModelConfig(size="8b")) <= 8.1e9  # Llama 3 8B: 8.03B
    assert list(SIZES) == ["tiny", "small", "125m", "1b", "8b"]


def measured_flops(cfg: ModelConfig, batch: int, seq: int, backward: bool) -> int:
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    # The fused CPU SDPA kernel is not in the FLOP counter's registry; the math backend runs the
    # same attention as two counted batched matmuls (the full square, as our formula counts).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        if backward:
            logits.sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token_is_three_forward_passes(tie):
    cfg = ModelConfig(size="tiny", vocab_size=300, dim=64, n_layers=3, n_heads=4, n_kv_heads=2,
                      ffn_dim=160, max_seq_len=64, tie_embeddings=tie)
    batch, seq = 2, 48
    forward = measured_flops(cfg, batch, seq, backward=False)
    # Exact: the counter counts only matmuls, and so does the formula (norms, rotary, softmax and
    # the embedding lookup are left out of both).
    assert 3 * forward == pytest.approx(flops_per_token(cfg, seq) * batch * seq, rel=1e-9)


def test_flops_per_token_matches_a_counted_training_step():
    cfg = ModelConfig(size="tiny", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=1,
                      ffn_dim=128, max_seq_len=32)
    batch, seq = 2, 32
    total = measured_flops(cfg, batch, seq, backward=True)
    # Backward is twice the forward for every matmul, including the first layer's projections
    # (their input, the embedding output, needs a gradient) and both attention matmuls.
    assert total == pytest.approx(flops_per_token(cfg, seq) * batch * seq, rel=1e-9)


def test_attention_term_grows_linearly_with_sequence_length():
    cfg = ModelConfig(size="small")
    step = flops_per_token(cfg, 2048) - flops_per_token(cfg, 1024)
    assert step == 12 * cfg.n_layers * cfg.dim * 1024
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(cfg, 0)


def test_forward_flops_of_a_small_config_by_hand():
    cfg = ModelConfig(size="tiny", vocab_size=100, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                      ffn_dim=32, max_seq_len=64)
    # Per block: q 16x16, k and v 16x8 each, o 16x16, SwiGLU 3 x 16x32; output projection 100x16.
    matmul = 2 * (16 * 16 + 2 * 16 * 8 + 16 * 16 + 3 * 16 * 32) + 100 * 16
    # A prompt of 3 tokens and 2 generated: 5 positions, position t attends to t keys.
    pairs = 1 + 2 + 3 + 4 + 5
    per_pair = 4 * 2 * 2 * 8  # Q K^T and A V, 2 FLOPs per multiply-add, 2 layers, 2 heads of 8
    assert forward_flops(cfg, 3, 2) == 2 * matmul * 5 + per_pair * pairs
    assert forward_flops(cfg, 5) == forward_flops(cfg, 3, 2)  # a read and a decode cost alike
    assert forward_flops(cfg, 0) == 0
    with pytest.raises(ValueError, match="generated=-1"):
        forward_flops(cfg, 3, -1)


def test_forward_flops_is_a_counted_forward_pass_less_the_keys_after_each_query():
    cfg = ModelConfig(size="tiny", vocab_size=300, dim=64, n_layers=3, n_heads=4, n_kv_heads=2,
                      ffn_dim=160, max_seq_len=64)
    seq = 24
    full_square = measured_flops(cfg, 1, seq, backward=False)
    above_diagonal = seq * (seq - 1) // 2  # (query, later key) pairs a causal decode never reads
    per_pair = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    assert forward_flops(cfg, seq) == pytest.approx(full_square - per_pair * above_diagonal,
                                                    rel=1e-9)
