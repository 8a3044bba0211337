"""The KV-cache engine: equal to the uncached model, continuous batching, stopping, bad input."""

from __future__ import annotations

import pytest
import torch
from infer_helpers import greedy_uncached, tiny_model

from ftlm.errors import ConfigError
from ftlm.infer import Engine, SamplingParams, kv
from ftlm.model.generate import generate as uncached_generate

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def prompts(lengths=(3, 9, 1, 14, 5)) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]


def test_cached_logits_equal_the_full_forward(model):
    tokens = torch.tensor(prompts((10,))[0])
    cache = kv.KVCache.allocate(model, slots=2)
    with torch.no_grad():
        want = model(tokens[None])[0]  # [T, vocab]
        first = kv.prefill(model, cache, tokens[None, :4], torch.tensor([4]), torch.tensor([1]))
        got = [first[0]]
        # Slot 0 is idle junk at position 0: the rows do not see each other.
        for pos in range(4, 10):
            logits = kv.decode(model, cache, torch.tensor([0, int(tokens[pos])]),
                               torch.tensor([0, pos]), kv_len=pos + 1)
            got.append(logits[1])
    torch.testing.assert_close(torch.stack(got), want[3:], atol=1e-4, rtol=1e-4)


def test_greedy_batch_equals_uncached_greedy_with_more_prompts_than_slots(model):
    engine = Engine(model, max_batch=2)  # 5 prompts through 2 slots: sequences join and leave
    seqs = engine.generate(prompts(), GREEDY)
    for prompt, seq in zip(prompts(), seqs):
        assert seq.tokens == greedy_uncached(model, prompt, 12)
        assert seq.finish_reason == "length"
        assert len(seq.logprobs) == 12 and all(lp <= 0 for lp in seq.logprobs)
    assert not engine.has_work() and engine.active == 0
    # and it agrees with the public uncached sampler of ftlm.model
    out = uncached_generate(model, torch.tensor([prompts()[1]]), 12, temperature=0.0)
    assert out[0, 9:].tolist() == seqs[1].tokens


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    alone = Engine(model, max_batch=1).generate([prompts()[0]], params)[0].tokens
    crowd = Engine(model, max_batch=4).generate(
        prompts()[1:3] + [prompts()[0]],
        [SamplingParams(max_new_tokens=6, temperature=0.8, seed=s) for s in (1, 2)] + [params])
    assert crowd[2].tokens == alone
    other = Engine(model, max_batch=1).generate(
        [prompts()[0]], SamplingParams(max_new_tokens=10, temperature=1.0, seed=8))[0].tokens
    assert other != alone


def test_eos_stop_ids_and_stop_strings_end_a_sequence(model):
    free = greedy_uncached(model, prompts()[0], 12)
    eos = free[4]
    engine = Engine(model, max_batch=2, eos_id=eos, detokenize=lambda ids: " ".join(map(str, ids)))
    seq = engine.generate([prompts()[0]], GREEDY)[0]
    assert seq.tokens == free[:free.index(eos)] and seq.finish_reason == "stop"
    ignored = engine.generate([prompts()[0]], SamplingParams(max_new_tokens=12, temperature=0,
                                                             ignore_eos=True))[0]
    assert ignored.tokens == free
    by_id = engine.generate([prompts()[0]], SamplingParams(max_new_tokens=12, temperature=0,
                                                           ignore_eos=True, stop_ids=(free[2],)))
    assert by_id[0].tokens == free[:free.index(free[2])]
    text = engine.generate([prompts()[0]], SamplingParams(
        max_new_tokens=12, temperature=0, ignore_eos=True, stop=(f"{free[1]} {free[2]}",)))[0]
    assert text.tokens == free[:3] and text.finish_reason == "stop"


def test_the_context_length_ends_a_sequence():
    model = tiny_model(max_seq_len=16)
    seq = Engine(model, max_batch=1).generate([[1] * 10], GREEDY)[0]
    assert len(seq.tokens) == 6 and seq.finish_reason == "length"
    assert seq.tokens == greedy_uncached(model, [1] * 10, 6)


def test_zero_tokens_cancel_and_bad_prompts(model):
    engine = Engine(model, max_batch=1)
    assert engine.add([1, 2], SamplingParams(max_new_tokens=0)).finish_reason == "length"
    running = engine.add([1, 2], GREEDY)
    waiting = engine.add([3], GREEDY)
    engine.step()
    engine.cancel(running)
    engine.cancel(waiting)
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert not engine.has_work()
    with pytest.raises(ConfigError, match="empty"):
        engine.add([], GREEDY)
    with pytest.raises(ConfigError, match="shorten it to at most 63"):
        engine.add([1] * 64, GREEDY)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.add([96], GREEDY)
    with pytest.raises(ConfigError, match="detokenize"):
        engine.add([1], SamplingParams(stop=("x",)))


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_k", -1), ("top_p", 0.0),
                                         ("min_p", 1.0), ("max_new_tokens", -2), ("seed", -1),
                                         ("temperature", float("nan")), ("stop", ("",))])
def test_bad_sampling_params_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.slow  # compiling takes tens of seconds on a CPU
def test_compiled_decode_gives_the_same_greedy_tokens(model):
    eager = Engine(model, max_batch=2).generate(prompts()[:3], GREEDY)
    compiled = Engine(model, max_batch=2, compile=True).generate(prompts()[:3], GREEDY)
    assert [s.tokens for s in compiled] == [s.tokens for s in eager]


def test_fused_unmasked_decode_equals_the_masked_one_when_rows_are_level(model):
    level = prompts((6, 6, 6))  # every row at the same position: the engine drops the mask
    cache = kv.KVCache.allocate(model, slots=3)
    weights = kv.DecodeWeights.of(model)
    with torch.no_grad():
        kv.prefill(model, cache, torch.tensor(level), torch.tensor([6] * 3), torch.arange(3))
        args = (model, cache, torch.tensor([5, 7, 9]), torch.tensor([6] * 3), 7, weights)
        masked = kv.decode(*args, masked=True)
        unmasked = kv.decode(*args, masked=False)
    torch.testing.assert_close(unmasked, masked, atol=1e-5, rtol=1e-5)
    seqs = Engine(model, max_batch=3).generate(level, GREEDY)
    assert [s.tokens for s in seqs] == [greedy_uncached(model, p, 12) for p in level]
