"""Buckets of the cross-group all-reduce: one plan for every group, started in plan order from
backward hooks, the rest after the backward."""

from __future__ import annotations

import torch
from torch import nn

from ftlm.train.grad_sync import GradientSync, bucket_plan


def test_the_plan_takes_parameters_last_first_within_the_byte_bound() -> None:
    f32 = torch.float32
    plan = bucket_plan([(40, f32), (40, f32), (100, f32), (10, f32), (10, torch.bfloat16)], 80)
    assert plan == [[4], [3], [2], [1, 0]]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def test_hooks_start_buckets_during_backward_in_plan_order() -> None:
    model = _model()
    params = list(model.parameters())
    started: list[list[int]] = []
    during_backward: list[bool] = []
    in_backward = [False]

    def start(grads):
        started.append([g.numel() for g in grads])
        during_backward.append(in_backward[0])

    sync = GradientSync(params, bucket_bytes=16 * 16 * 4, start=start, local=lambda t: t,
                        hooks=True)
    sync.begin()
    x = torch.randn(5, 8)
    # Not armed (an earlier micro-batch): nothing starts.
    model(x).sum().backward()
    assert started == []
    sync.armed = True
    in_backward[0] = True
    model(x).sum().backward()
    in_backward[0] = False
    grads = sync.finish()
    expected = [[params[i].numel() for i in b] for b in sync.plan]
    assert started == expected and all(during_backward)
    assert [g.data_ptr() for g in grads] == [p.grad.data_ptr() for p in params]
    sync.close()


def test_without_hooks_every_bucket_starts_in_finish_and_unused_params_send_zeros() -> None:
    model = _model()
    extra = nn.Parameter(torch.ones(3))  # never used in the graph
    params = list(model.parameters()) + [extra]
    started: list[list[torch.Tensor]] = []
    sync = GradientSync(params, bucket_bytes=1 << 20, start=started.append, local=lambda t: t,
                        hooks=False)
    sync.begin()
    model(torch.randn(2, 8)).sum().backward()
    assert started == []
    sync.finish()
    assert len(started) == len(sync.plan) == 1
    assert torch.equal(extra.grad, torch.zeros(3))
