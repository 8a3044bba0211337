"""Post-training on the fault-tolerant trainer: SFT, DPO and GRPO (RL with verifiable rewards).

Each command is an ``Objective`` and a ``TrainData`` (``ftlm.train.objective``) handed to the same
``Trainer`` that pretrains, so quorums, catch-up, checkpoints, exactly-once data and the run summary
work unchanged:

* ``data``: instruction, preference and prompt files -> fixed-shape rows (packing with document ids);
* ``forward``: the document-masked forward and per-token log-probs;
* ``sft``, ``dpo``, ``grpo``: the objectives; ``rollout``: sampling a prompt's group of completions
  (KV-cache engine, or re-running the model under FSDP2);
* ``pairs``: preference pairs from the task suite; ``run``: building and running a group.

Not here: the training loop and fault tolerance (``ftlm.train``, ``ftlm.ft``), the chat template
(``ftlm.data.chat``), the task suite (``ftlm.tasks``), the commands ``ftlm sft | dpo | grpo |
pairs`` (``ftlm.post_cli``), evaluation of a finished model (``ftlm eval``).
"""
