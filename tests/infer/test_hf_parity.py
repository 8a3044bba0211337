"""Greedy output of the engine equals ``transformers``' greedy ``generate`` on the same weights."""

from __future__ import annotations

import pytest
import torch
from infer_helpers import hf_llama, tiny_model

from ftlm.infer import Engine, SamplingParams

transformers = pytest.importorskip("transformers")


# Importing transformers alone takes 5-15 s on the shared CPU box: the slow tier.
@pytest.mark.slow
def test_engine_greedy_equals_transformers_greedy_generate():
    model = tiny_model(seed=3)
    hf = hf_llama(model)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (6, 6, 6)]
    with torch.no_grad():
        x = torch.tensor(prompts)
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-4, rtol=1e-4)
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16,
                           do_sample=False, pad_token_id=0)[:, 6:].tolist()
    got = Engine(model, max_batch=2).generate(prompts, SamplingParams(max_new_tokens=16,
                                                                      temperature=0.0))
    assert [s.tokens for s in got] == want
