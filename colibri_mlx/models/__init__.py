"""The DeepSeek-V3 model family (DeepSeek-V3/R1, Kimi-K2, DeepSeek-V3.2, GLM-5.x) on MLX.

``load(path)`` reads a colibri container or a Hugging Face checkpoint directory and returns
``(model, tokenizer)``; ``load_model(path)`` returns the model alone.
"""

from __future__ import annotations

from .deepseek_v3 import MODEL_TYPES, Model, ModelArgs
from .loading import load_model

__all__ = ["MODEL_TYPES", "Model", "ModelArgs", "load", "load_model"]


def load(path=None, **options):
    """``(model, tokenizer)`` from a container or Hugging Face checkpoint directory.

    ``path=None`` is reserved for the bundled demo model (not shipped yet). Expert streaming
    options (``ram_gb``, ``pin``, ``pin_gb``, ``expert_top_p``, store options): see
    :func:`load_model` and docs/streaming.md.
    """
    if path is None:
        raise ValueError("no model given and no bundled demo model (pass a container or checkpoint directory)")
    import os

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: model directory does not exist")
    unknown = set(options) - STREAMING_OPTIONS
    if unknown:
        raise TypeError(f"load() got unknown option(s): {sorted(unknown)}")
    from ..tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    return load_model(path, **options), tokenizer


STREAMING_OPTIONS = frozenset(("ram_gb", "pin", "pin_gb", "expert_top_p", "prefetch", "workers", "max_inflight",
                               "usage_path", "record_usage", "preload_pinned", "drop_read_pages"))
