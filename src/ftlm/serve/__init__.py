"""``ftlm serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

``ftlm.serve.server`` (aiohttp routes, auth, errors, SSE), ``ftlm.serve.runner`` (the decode-loop
thread that batches every request in flight), ``ftlm.serve.protocol`` (request validation and
response shapes, pure), ``ftlm.serve.metrics`` (Prometheus families), ``ftlm.serve.config``.
"""

from ftlm.serve.config import ServeConfig
from ftlm.serve.server import Server

__all__ = ["ServeConfig", "Server"]
