"""Pure PyTorch model code: the Llama-style decoder, its size table, counts and sampling.

Imports only torch (never ``torch.distributed``); parallelism is applied from outside by
``ftlm.train``.
"""

from ftlm.model.config import SIZES, ModelConfig
from ftlm.model.counts import flops_per_token, param_count
from ftlm.model.generate import generate
from ftlm.model.llama import Transformer

__all__ = ["ModelConfig", "SIZES", "Transformer", "param_count", "flops_per_token", "generate"]
