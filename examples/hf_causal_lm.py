"""A plain PyTorch loop training a Hugging Face causal LM, made fault tolerant by ftlm.

Run it as one group (no fault tolerance, plain PyTorch speed):

    ftlm run examples/hf_causal_lm.py

or as three replica groups with random failures injected (groups killed and restarted):

    ftlm launch local examples/chaos.toml --groups 3 --chaos-mtbf 15 -- examples/hf_causal_lm.py

The model is built from a config (nothing is downloaded). The data is synthetic and defined by
index: sample ``i`` is a counting sequence whose start and stride come from ``i``, so the loss
falls within a few dozen steps. ftlm hands each step the sample positions this group trains
(exactly once across the job, whatever fails); everything else here is an ordinary loop.
"""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ftlm.train import Session

VOCAB, SEQ_LEN = 64, 32


def sample(position: int) -> torch.Tensor:
    """Sample ``position`` of the data set: a counting sequence modulo the vocabulary."""
    g = torch.Generator().manual_seed(position)
    start, stride = torch.randint(0, VOCAB, (2,), generator=g).tolist()
    return (start + (stride % 7 + 1) * torch.arange(SEQ_LEN)) % VOCAB


def main() -> None:
    torch.manual_seed(0)  # every group builds the same initial model
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ_LEN)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)

    # steps and batch_size come from the launcher's config (examples/chaos.toml) when launched;
    # alone, these defaults apply.
    with Session(model, optimizer, lr=3e-3, grad_clip=1.0, steps=60, batch_size=8) as session:
        for step in session:  # quorum, recovery and catch-up happen inside the iteration
            batch = torch.stack([sample(i) for i in step.samples])
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            if session.commit(loss) and step.step % 10 == 0:  # gradients averaged, update applied
                print(f"step {step.step} loss {session.losses[-1]:.3f}", flush=True)


if __name__ == "__main__":
    main()
