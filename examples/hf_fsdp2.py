"""The loop of ``hf_causal_lm.py`` with the model sharded by FSDP2 inside each replica group.

Each replica group is two processes (ranks) holding half of the model each; groups are replicas
of each other, and ftlm averages the sharded gradients across groups, shard by shard:

    ftlm launch local examples/chaos.toml --groups 3 --ranks-per-group 2 --chaos-mtbf 8 \
        -- examples/hf_fsdp2.py

The launcher starts each rank with the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT): the default process group below is this replica group's own.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig

from ftlm.train import Session

VOCAB, SEQ_LEN = 64, 32


def sample(position: int) -> torch.Tensor:
    """Sample ``position`` of the data set: a counting sequence modulo the vocabulary."""
    g = torch.Generator().manual_seed(position)
    start, stride = torch.randint(0, VOCAB, (2,), generator=g).tolist()
    return (start + (stride % 7 + 1) * torch.arange(SEQ_LEN)) % VOCAB


def main() -> None:
    dist.init_process_group("gloo")  # the ranks of this replica group
    torch.manual_seed(0)  # every rank of every group builds the same initial model
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ_LEN)
    model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:  # shard each decoder layer, then the rest
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)

    with Session(model, optimizer, lr=3e-3, grad_clip=1.0, steps=60, batch_size=8) as session:
        for step in session:  # step.samples: this rank's share of its group's samples
            batch = torch.stack([sample(i) for i in step.samples])
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            if session.commit(loss) and step.step % 10 == 0 and dist.get_rank() == 0:
                print(f"step {step.step} loss {session.losses[-1]:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
