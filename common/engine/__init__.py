"""The inference engine: paged KV cache, continuous batching and the KV hand-off over unmodified HF models.

Importing the package installs a logging filter (below) before anything imports transformers, which imports
torchao to check its quantizers whenever torchao is installed.
"""

from __future__ import annotations

import logging


class _DropImportNoise(logging.Filter):
    """Drops two warnings every model load printed once torchao is installed (transformers imports it to
    check its quantizers): torchao's CPU wheel failing to load its CUDA-only kernels (``Failed to load
    .../torchao/_C_...so``) and torch's pytree deprecation of ``register_constant`` for torchao's enums.
    Neither says anything about the model or the run; every other record of both loggers passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (("Failed to load" in message and "torchao/_C" in message)
                    or ("register_constant() on Enum subclasses is deprecated" in message))  # fmt: skip


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_DropImportNoise())
