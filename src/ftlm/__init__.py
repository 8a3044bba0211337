"""ftlm: fault-tolerant hybrid-sharded data-parallel training of language models.

The package layout follows the pipeline: ``model`` (pure PyTorch modules), ``data`` (tokenizer,
prepare, loader), ``train`` (trainer, optimizer, checkpoints), ``ft`` (quorum, coordinator,
manager, live recovery), ``launch`` (local supervisor), ``observe`` (events, summary, report).
"""

__version__ = "0.1.0"
