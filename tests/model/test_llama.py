"""Behaviour of the Llama-style decoder: shapes, causality, attention parity, tying, init."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import ftlm.model
from ftlm.model import ModelConfig, Transformer
from ftlm.model.llama import rope_table


def small_cfg(**overrides) -> ModelConfig:
    values = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                  max_seq_len=24, tie_embeddings=True)
    values.update(overrides)
    return ModelConfig(size="tiny", **values)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_forward_returns_logits_per_position():
    cfg = small_cfg()
    model = Transformer(cfg)
    logits = model(torch.randint(0, cfg.vocab_size, (3, 10)))
    assert logits.shape == (3, 10, cfg.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_changing_a_token_never_changes_earlier_logits():
    cfg = small_cfg()
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    base = model(tokens)
    for t in (0, 5, 15):
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, t], base[:, t])  # the change is visible from t on


def naive_attention(attn, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Reference: explicit per-pair rotation, explicit kv-head choice, masked softmax."""
    batch, seq, _ = x.shape
    hd, half = cfg.head_dim, cfg.head_dim // 2
    q = (x @ attn.wq.weight.T).view(batch, seq, cfg.n_heads, hd)
    k = (x @ attn.wk.weight.T).view(batch, seq, cfg.n_kv_heads, hd)
    v = (x @ attn.wv.weight.T).view(batch, seq, cfg.n_kv_heads, hd)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t)
        for pos in range(seq):
            for i in range(half):
                angle = pos * cfg.rope_theta ** (-i / half)
                c, s = math.cos(angle), math.sin(angle)
                a, b = t[:, pos, :, i], t[:, pos, :, i + half]
                out[:, pos, :, i] = a * c - b * s
                out[:, pos, :, i + half] = a * s + b * c
        return out

    q, k = rotate(q), rotate(k)
    group = cfg.n_heads // cfg.n_kv_heads
    mask = torch.full((seq, seq), float("-inf")).triu(1)
    heads = []
    for h in range(cfg.n_heads):
        kv = h // group  # query head h shares kv head h // group
        scores = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(hd) + mask
        heads.append(torch.softmax(scores, dim=-1) @ v[:, :, kv])
    out = torch.stack(heads, dim=2).reshape(batch, seq, cfg.n_heads * hd)
    return out @ attn.wo.weight.T


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_attention_matches_naive_reference(n_kv_heads):
    cfg = small_cfg(n_kv_heads=n_kv_heads)
    model = Transformer(cfg)
    model.init_weights(3)
    x = torch.randn(2, 12, cfg.dim)
    attn = model.layers[0].attention
    got = attn(x, model.rope_cos[:12], model.rope_sin[:12])
    with torch.no_grad():
        want = naive_attention(attn, x, cfg)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    from ftlm.model.llama import apply_rope
    cfg = small_cfg()
    cos, sin = rope_table(cfg)
    q, k = torch.randn(cfg.head_dim), torch.randn(cfg.head_dim)

    def score(m: int, n: int) -> torch.Tensor:
        qs = apply_rope(q.expand(1, cfg.max_seq_len, 1, -1), cos, sin)[0, m, 0]
        ks = apply_rope(k.expand(1, cfg.max_seq_len, 1, -1), cos, sin)[0, n, 0]
        return qs @ ks

    torch.testing.assert_close(score(7, 3), score(17, 13), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(7, 3), score(7, 5))


def test_tied_output_shares_the_embedding_parameter():
    model = Transformer(small_cfg(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    model(torch.randint(0, 97, (1, 5))).sum().backward()
    assert model.tok_embeddings.weight.grad is not None


def test_untied_output_has_its_own_parameter():
    cfg = small_cfg(tie_embeddings=False)
    model = Transformer(cfg)
    assert model.output.weight is not model.tok_embeddings.weight
    assert not torch.equal(model.output.weight, model.tok_embeddings.weight)
    names = [n for n, _ in model.named_parameters()]
    assert "output.weight" in names and "tok_embeddings.weight" in names


@pytest.mark.parametrize("tie", [True, False])
def test_meta_construction_then_init_equals_direct_construction(tie):
    cfg = small_cfg(tie_embeddings=tie)
    direct = Transformer(cfg)
    direct.init_weights(11)
    with torch.device("meta"):
        lazy = Transformer(cfg)
    assert lazy.tok_embeddings.weight.is_meta
    lazy.to_empty(device="cpu")
    lazy.init_weights(11)
    assert (lazy.output.weight is lazy.tok_embeddings.weight) == tie  # to_empty keeps the tie
    want, got = params_of(direct), params_of(lazy)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert torch.equal(direct.rope_cos, lazy.rope_cos)
    assert torch.equal(direct.rope_sin, lazy.rope_sin)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    assert torch.equal(direct(tokens), lazy(tokens))


def test_init_is_deterministic_per_seed():
    cfg = small_cfg()
    a, b, c = Transformer(cfg), Transformer(cfg), Transformer(cfg)
    a.init_weights(5)
    b.init_weights(5)
    c.init_weights(6)
    pa, pb, pc = params_of(a), params_of(b), params_of(c)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["layers.0.attention.wq.weight"], pc["layers.0.attention.wq.weight"])


def test_constructor_initialises_as_seed_zero():
    cfg = small_cfg()
    built = Transformer(cfg)
    reset = Transformer(cfg)
    reset.init_weights(0)
    assert all(torch.equal(p, params_of(reset)[n]) for n, p in params_of(built).items())


def test_init_scales_residual_projections_and_sets_norms_to_one():
    cfg = small_cfg(dim=128, ffn_dim=256, n_layers=8)
    model = Transformer(cfg)
    p = params_of(model)
    assert p["tok_embeddings.weight"].std().item() == pytest.approx(cfg.init_std, rel=0.05)
    assert p["layers.0.attention.wq.weight"].std().item() == pytest.approx(cfg.init_std, rel=0.05)
    scaled = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    assert p["layers.3.attention.wo.weight"].std().item() == pytest.approx(scaled, rel=0.05)
    assert p["layers.3.feed_forward.w2.weight"].std().item() == pytest.approx(scaled, rel=0.05)
    assert torch.equal(p["norm.weight"], torch.ones(cfg.dim))
    assert torch.equal(p["layers.1.ffn_norm.weight"], torch.ones(cfg.dim))


def test_init_in_bfloat16_is_the_float32_init_rounded():
    cfg = small_cfg()
    ref = Transformer(cfg)
    ref.init_weights(4)
    low = Transformer(cfg).to(torch.bfloat16)
    low.init_weights(4)
    for name, p in params_of(low).items():
        assert torch.equal(p, params_of(ref)[name].to(torch.bfloat16)), name


def test_rope_buffers_are_not_in_the_state_dict():
    model = Transformer(small_cfg())
    assert not any("rope" in key for key in model.state_dict())


def test_sequence_longer_than_max_seq_len_is_refused():
    cfg = small_cfg(max_seq_len=8)
    model = Transformer(cfg)
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, cfg.vocab_size)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_layers_are_a_module_list_of_blocks():
    from ftlm.model.llama import TransformerBlock
    cfg = small_cfg(n_layers=3)
    model = Transformer(cfg)
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == 3
    assert all(isinstance(block, TransformerBlock) for block in model.layers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_init_on_cuda_is_bitwise_the_cpu_init():
    cfg = small_cfg()
    cpu = Transformer(cfg)
    cpu.init_weights(9)
    with torch.device("meta"):
        gpu = Transformer(cfg)
    gpu.to_empty(device="cuda")
    gpu.init_weights(9)
    for name, p in params_of(gpu).items():
        assert torch.equal(p.cpu(), params_of(cpu)[name]), name
    assert torch.equal(gpu.rope_cos.cpu(), cpu.rope_cos)


def test_model_package_never_imports_torch_distributed():
    package_dir = Path(ftlm.model.__file__).parent
    for path in package_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.startswith("torch.distributed") for n in names), (path, names)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_matches_cpu_in_float32_and_bfloat16():
    cfg = small_cfg()
    cpu = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len))
    want = cpu(tokens)
    gpu = Transformer(cfg).cuda()
    assert gpu.output.weight is gpu.tok_embeddings.weight
    torch.testing.assert_close(gpu(tokens.cuda()).cpu(), want, rtol=1e-4, atol=1e-4)
    low = gpu.to(torch.bfloat16)
    torch.testing.assert_close(low(tokens.cuda()).float().cpu(), want, rtol=0.05, atol=0.05)
