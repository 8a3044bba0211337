"""Sampling with a model sharded over the ranks of a group (FSDP2): every rank runs the model the
same number of times, whatever its own prompts' lengths and stops.

Each rank samples its own prompts (its share of the group's batch). The model's forward pass is
a collective (FSDP2 gathers each layer's weights from every rank), so a rank that stopped
sampling earlier than its peer, at its own budget or when all its samples ended, left the peer's
next gathers unmatched: the group crashed (gloo: a size mismatch) or hung.
"""

from __future__ import annotations

import textwrap

_WORKER = textwrap.dedent("""
    import copy, json, sys
    import torch, torch.distributed as dist
    rank, store = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    from ftlm.config import build_config
    from ftlm.post.rollout import rollout
    from ftlm.train.parallelize import group_mesh, parallelize
    from ftlm.train.trainer import build_model
    config = build_config({"model": {"size": "tiny", "vocab_size": 64, "dim": 32, "n_layers": 2,
                                     "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                                     "max_seq_len": 64}}).trainer_config()
    device = torch.device("cpu")
    plain = build_model(config, device)
    sharded = parallelize(copy.deepcopy(plain), group_mesh(device), activation_checkpointing=False,
                          compile=False)
    passes = []
    sharded.register_forward_hook(lambda *_: passes.append(1))
    # Rank 0: a short budget. Rank 1: a longer one, and token 5 ends a sample (some end early).
    budget, prompt = (3, [1, 2, 3]) if rank == 0 else (12, [4, 5])
    draws = lambda: torch.Generator().manual_seed(100 + rank)
    got = rollout(sharded, prompt, 3, budget, 5, 0, generator=draws())
    alone = rollout(plain, prompt, 3, budget, 5, 0, generator=draws())
    total = torch.tensor([len(passes)])
    dist.all_reduce(total)  # the group still works after the sampling
    print(json.dumps({"got": got, "alone": alone, "passes": len(passes), "total": int(total)}))
    dist.destroy_process_group()
""")


def test_ranks_with_different_budgets_and_stops_run_the_model_alike(two_ranks) -> None:
    a, b = two_ranks(_WORKER)
    assert a["passes"] == b["passes"] and a["total"] == 2 * a["passes"], (a, b)
    for rank in (a, b):  # the passes for the peer change nothing: the same draws as unsharded
        assert rank["got"] == rank["alone"]
    assert max(map(len, a["got"])) <= 3 and max(map(len, b["got"])) > 3
